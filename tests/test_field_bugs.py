"""Two shipped bugs of FIELD_NOTES' table whose cover was partial (docs/field-bugs.md, "Gaps"), end to end on the
CPU: a routed-expert adapter whose gate and up have different A's (SGLang #27274: the up half's A dropped), in a
mixed batch; and in-major (GPT-OSS style) fused expert factors given to an out-major base (vLLM #41384: A and B
roles flipped) refused with the tensor named."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, save_tiny_model, tmp
from safetensors.torch import load_file, save_file

from moelora.adapters.errors import AdapterError

E, H, I = 8, 32, 12  # the tiny Qwen3-MoE of helpers.hf_tiny: 8 experts, hidden 32, expert intermediate 12
EXPERTS = "base_model.model.model.layers.0.mlp.experts"


def test_gate_and_up_with_different_a_match_the_merged_model(tmp_path):
    """Per-expert 2-D gate_proj / up_proj factors, every A different: moelora's log-probabilities equal the base
    model with each expert's B @ A merged into its gate and up rows, in a batch beside a base row; dropping the up
    half's A (or reading gate's for it) moves them by far more than the tolerance."""
    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    r, alpha = 4, 8
    g = torch.Generator().manual_seed(0)
    tensors, merged = {}, copy.deepcopy(base)
    experts = merged.model.layers[0].mlp.experts
    with torch.no_grad():
        for e in range(E):
            for proj, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
                a, b = torch.randn(r, H, generator=g) * 0.3, torch.randn(I, r, generator=g) * 0.3
                tensors[f"{EXPERTS}.{e}.{proj}.lora_A.weight"] = a
                tensors[f"{EXPERTS}.{e}.{proj}.lora_B.weight"] = b
                experts.gate_up_proj[e, rows] += alpha / r * b @ a
    path = tmp(tmp_path, "gate_up_adapter")
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    run = Runner(tmp(tmp_path, "m"), max_lora_rank=16)
    run.load("gu", path)
    ids, other = rows_of(3, [9, 7])
    got, _ = run.logprobs([(ids, "gu"), (other, None)])
    want, plain = peft_logprobs(merged, None, ids), peft_logprobs(base, None, ids)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert (want - plain).abs().max() > 0.05  # the adapter moves the log-probabilities: the check can fail


@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_in_major_fused_expert_factors_are_refused(tmp_path, site):
    """PEFT target_parameters on fused 3-D experts: transformers 5's Qwen3-MoE stores gate_up_proj out-major
    [E, 2I, H] (A reads H), GPT-OSS in-major [E, H, 2I] (A reads 2I). An adapter written for the in-major layout
    must be refused, naming the tensor and the shape expected, not loaded with A and B in each other's roles."""
    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    good = tmp(tmp_path, "good")
    save_peft_adapter(base, good, 1, r=6, lora_alpha=12, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    tensors = load_file(os.path.join(good, "adapter_model.safetensors"))
    r = 6
    prefix = f"{EXPERTS}.base_layer." if site == "gate_up" else f"{EXPERTS}."
    a_key, b_key = prefix + "lora_A.weight", prefix + "lora_B.weight"
    assert a_key in tensors and b_key in tensors, sorted(tensors)
    a_in, b_out = (2 * I, H) if site == "gate_up" else (H, I)  # in-major: the other side's widths
    tensors[a_key], tensors[b_key] = torch.randn(r * E, a_in), torch.randn(b_out, r * E)
    bad = tmp(tmp_path, f"in_major_{site}")
    shutil.copytree(good, bad, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(bad, "adapter_model.safetensors"))
    run = Runner(tmp(tmp_path, "m"), max_lora_rank=16)
    with pytest.raises(AdapterError) as err:
        run.registry.load("in_major", bad)
    assert err.value.tensor in (a_key, b_key), (err.value.tensor, str(err.value))
    assert str(list(tensors[err.value.tensor].shape)) in str(err.value) or \
        str(tuple(tensors[err.value.tensor].shape)) in str(err.value), str(err.value)
