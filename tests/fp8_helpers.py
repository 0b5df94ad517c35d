"""Tiny FP8 checkpoints for tests: a tiny random model's linear weights quantized with the reference."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from helpers import save_tiny_model, tmp
from moelora.kernels.quant.fp8 import dequantize_weight_block, quantize_weight_block

BLOCK = (16, 32)  # block_n != block_k (a transposed scale grid fails); block_n divides every fused slice of TINY;
# block_k >= 32: the smallest K tile of an fp8 tl.dot on the GPU
TINY = dict(moe_intermediate_size=16, intermediate_size=32)  # q 32, kv 16, experts' I 16, dense I 32, hidden 32
_QUANTIZED = re.compile(r".*(_proj\.weight|_proj_with_mqa\.weight|experts\.(gate_up_proj|down_proj))$")


def write_fp8_checkpoint(root, family: str = "qwen3_moe", block=BLOCK, skip: tuple[str, ...] = (), seed: int = 0,
                         **over):
    """(base transformers model, folder of the FP8 checkpoint, folder of its dequantized fp32 twin).
    Every `*_proj.weight` (not the router `mlp.gate`, embeddings, norms, lm_head) becomes float8_e4m3fn with a
    `weight_scale_inv` per block; names matching `skip` stay fp32 (as `modules_to_not_convert`)."""
    src = tmp(root, "bf16")
    base = save_tiny_model(family, src, seed=seed, **{**TINY, **over})
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _QUANTIZED.match(name) and not any(s in name for s in skip):
            q, s = quantize_weight_block(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_weight_block(q, s, block)
        else:
            fp8[name] = deq[name] = t
    out = {}
    for kind, ts in (("fp8", fp8), ("deq", deq)):
        path = tmp(root, kind)
        save_file(ts, os.path.join(path, "model.safetensors"))
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        if kind == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                          "weight_block_size": list(block), "modules_to_not_convert": list(skip)}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        out[kind] = path
    return base, out["fp8"], out["deq"], src


def write_nvfp4_checkpoint(root, family: str = "qwen3_moe", skip: tuple[str, ...] = (), seed: int = 0):
    """Like write_fp8_checkpoint, in ModelOpt's NVFP4 layout: `X.weight` uint8 [N, K/2], `X.weight_scale` e4m3
    [N, K/16], `X.weight_scale_2` and `X.input_scale` fp32 scalars. Returns (base, nvfp4 folder, dequantized folder)."""
    from moelora.kernels.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    src = tmp(root, "bf16")
    base = save_tiny_model(family, src, seed=seed, **TINY)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    q4, deq = {}, {}
    for name, t in tensors.items():
        if _QUANTIZED.match(name) and name.endswith("weight") and not any(s in name for s in skip):
            p, s, s2 = quantize_nvfp4(t)
            q4[name], q4[name[:-6] + "weight_scale"], q4[name[:-6] + "weight_scale_2"] = p, s, s2
            q4[name[:-6] + "input_scale"] = torch.tensor(1.0)
            deq[name] = dequantize_nvfp4(p, s, s2)
        else:
            q4[name] = deq[name] = t
    out = {}
    for kind, ts in (("nvfp4", q4), ("deq", deq)):
        path = tmp(root, kind)
        save_file(ts, os.path.join(path, "model.safetensors"))
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        if kind == "nvfp4":
            cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                          "ignore": list(skip)}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        out[kind] = path
    return base, out["nvfp4"], out["deq"], src
