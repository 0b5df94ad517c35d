"""Convert a PEFT `target_parameters` adapter (fused 3-D experts) to the per-expert 2-D layout
(`mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`) that older trainers and serving stacks read.

The fused gate_up factor (A [r*E, H], B [2I, r*E]) becomes, per expert, gate_proj with (A_e, B_e[:I])
and up_proj with (A_e, B_e[I:]): both share A_e and keep rank r and the same scaling.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from moelora.config import ModelConfig


def target_parameters_to_per_expert(src: str, dst: str, model_path: str) -> None:
    """src, dst: adapter folders · model_path: the base model folder (its config gives E, H and I)."""
    cfg = ModelConfig.from_pretrained(model_path)
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        conf = json.load(f)
    out: dict[str, torch.Tensor] = {}
    fused: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (experts prefix, lora_A, lora_B)
    for key, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)(?:\.base_layer)*\.lora_([AB])\.weight", key)
        if m is None:
            out[key] = t
        elif m[2] == "A":
            fused.append((m[1], t, tensors[key.replace("lora_A", "lora_B")]))
    rank_pattern = dict(conf.get("rank_pattern") or {})
    alpha_pattern = dict(conf.get("alpha_pattern") or {})
    for prefix, a, b in fused:
        r = a.shape[0] // E
        a3 = a.reshape(E, r, a.shape[1])  # [E, r, in]
        b3 = b.reshape(b.shape[0], r, E).permute(2, 0, 1)  # [E, out, r]
        gate_up = a.shape[1] == H and b.shape[0] == 2 * inter
        for e in range(E):
            if gate_up:
                for kind, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                    out[f"{prefix}.{e}.{kind}.lora_A.weight"] = a3[e].clone()
                    out[f"{prefix}.{e}.{kind}.lora_B.weight"] = b3[e, rows].contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.lora_A.weight"] = a3[e].contiguous()
                out[f"{prefix}.{e}.down_proj.lora_B.weight"] = b3[e].contiguous()
    # per-module rank/alpha: a pattern on the fused parameter now applies to each expert module
    for pat in (rank_pattern, alpha_pattern):
        for k in [k for k in pat if k.endswith("gate_up_proj")]:
            pat[r".*\.experts\.\d+\.(gate_proj|up_proj)"] = pat.pop(k)
    conf.update(rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, target_parameters=None)
    conf["target_modules"] = sorted(set(conf.get("target_modules") or []) | {"gate_proj", "up_proj", "down_proj"})
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    readme = os.path.join(src, "README.md")
    if os.path.isfile(readme):
        shutil.copy(readme, dst)
