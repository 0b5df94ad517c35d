"""Checkpoint loading: safetensors (one file or sharded with an index), fused or per-expert expert
names, fp32/bf16/fp16; and dummy weights for runs without a checkpoint.

Checkpoint names are mapped onto the model's fused parameters (qkv_proj, gate_up_proj, expert
stacks); each name fills one region of one parameter, and every parameter must end up covered.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.num_batches_tracked)$")


class WeightLoadError(RuntimeError):
    """A checkpoint that does not fit the model; the message names the file and tensor."""


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a model folder: from model.safetensors.index.json when present."""
    if not os.path.isdir(path):
        raise WeightLoadError(f"checkpoint folder {path!r} does not exist (or is not a folder)")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightLoadError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise WeightLoadError(f"{index} names shards that are not in {path}: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {path!r}; moelora reads safetensors checkpoints")
    return [os.path.join(path, f) for f in files]


def tensor_files(path: str) -> dict[str, tuple[str, str]]:
    """checkpoint name -> (file, safetensors dtype string)."""
    out = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                out[name] = (file, f.get_slice(name).get_dtype())
    return out


def read_tensor(files: dict[str, tuple[str, str]], name: str) -> torch.Tensor:
    """One checkpoint tensor by name (files: tensor_files)."""
    with safe_open(files[name][0], framework="pt") as f:
        return f.get_tensor(name)


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _is_mtp_layer(name: str, cfg) -> bool:
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer
    (model.layers.{num_hidden_layers}...); transformers skips them, and so does moelora."""
    if cfg.architecture != "DeepseekV3ForCausalLM":
        return False
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= cfg.num_hidden_layers


def _qkv_rows(cfg, which: str) -> slice:
    q, kv = cfg.q_size, cfg.kv_size
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[which]


def resolve_name(name: str, cfg, params: dict[str, nn.Parameter]) -> tuple[str, tuple] | None:
    """Checkpoint tensor name -> (model parameter name, index into it); None if it is to be ignored."""
    if _IGNORED.match(name) or _is_mtp_layer(name, cfg):
        return None
    n = name.replace(".block_sparse_moe.", ".mlp.")
    m = re.fullmatch(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)", n)
    if m and f"{m[1]}.qkv_proj.weight" in params:  # MLA (DeepSeek) keeps q_proj on its own
        return f"{m[1]}.qkv_proj.{m[3]}", (_qkv_rows(cfg, m[2]),)
    if m := re.fullmatch(r"(.*\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)", n):
        target = f"{m[1]}.fused_qkv_a_proj.{m[3]}"
        if target in params:
            q = cfg.mla.q_lora_rank
            return target, (slice(0, q) if m[2] == "q_a_proj" else slice(q, params[target].shape[0]),)
    if m := re.fullmatch(r"(.*\.mlp(?:\.shared_experts?)?)\.(gate|up)_proj\.weight", n):
        target = f"{m[1]}.gate_up_proj.weight"
        if target in params:
            inter = params[target].shape[0] // 2
            return target, (slice(0, inter) if m[2] == "gate" else slice(inter, 2 * inter),)
    if m := re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight", n):
        e, kind = int(m[2]), {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
        if kind == "down_proj":
            return f"{m[1]}.down_proj", (e,)
        inter = params[f"{m[1]}.gate_up_proj"].shape[1] // 2 if f"{m[1]}.gate_up_proj" in params else 0
        return f"{m[1]}.gate_up_proj", (e, slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter))
    if (m := re.fullmatch(r"(.*\.mlp\.gate)\.weight", n)) and m[1] in params:  # a bare [E, H] router parameter
        return m[1], ()
    if n == "lm_head.weight":
        return ("lm_head", ()) if "lm_head" in params else None  # tied embeddings: the copy is not needed
    return n, ()


@torch.no_grad()
def load_weights(model: nn.Module, path: str, show_progress: bool = False, mapper=None) -> None:
    """Fill every parameter of `model` from the checkpoint at `path` (a folder); a progress bar on request.
    mapper: for a quantized checkpoint, fp8_weights.Fp8CheckpointLoader or nvfp4_weights.Nvfp4CheckpointLoader
    (maps the scales, dequantizes the weights of modules that stay unquantized)."""
    params = dict(model.named_parameters())
    covered = {k: 0 for k in params}
    filled: set[tuple[str, str]] = set()  # (parameter, region) already written: a repeat must not count twice
    cfg = model.config
    tensors = iter_checkpoint(path)
    if show_progress:
        tensors = progress_bar(tensors, len(tensor_files(path)), "loading weights", "tensor")
    for name, tensor in tensors:
        if mapper is not None:
            resolved, tensor = mapper.resolve(name, tensor)
        else:
            resolved = resolve_name(name, cfg, params)
        if resolved is None:
            continue
        target, index = resolved
        if target not in params and tensor.numel() == 0:
            continue  # e.g. DeepSeek with n_shared_experts=0: transformers saves [H, 0] shared experts
        if target not in params:
            raise WeightLoadError(f"{path}: checkpoint tensor {name!r} has no place in {cfg.architecture} "
                                  f"(mapped to {target!r}); is this checkpoint for another architecture?")
        try:
            dst = params[target].data[index] if index else params[target].data
        except IndexError:  # e.g. experts.{e} with e >= num_experts
            raise WeightLoadError(f"{path}: checkpoint tensor {name!r} indexes {target} (shape "
                                  f"{list(params[target].shape)}) out of range; does the checkpoint have more experts "
                                  f"than the config ({cfg.num_experts})?") from None
        if tuple(dst.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"{path}: tensor {name!r}: expected shape {list(dst.shape)} for {target}, found "
                                  f"{list(tensor.shape)}")
        dst.copy_(tensor.to(dst.dtype))
        region = (target, repr(index))
        if region not in filled:
            filled.add(region)
            covered[target] += dst.numel()
    missing = [k for k, p in params.items() if covered[k] < p.numel()]
    if missing:
        raise WeightLoadError(f"{path}: checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights from the config alone (benchmarks and tests without a checkpoint):
    norms 1, biases 0, everything else N(0, std)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(std).to(p.dtype))


def progress_bar(it, total: int, desc: str, unit: str):
    """A tqdm bar over `it` (None: a bar updated by hand); without tqdm (it comes with transformers), `it` itself."""
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, unit=unit)
