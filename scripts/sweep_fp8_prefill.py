"""Sweep the FP8 block-scaled GEMM's launch parameters at Qwen3-30B-A3B prefill shapes (GPU), beside the bf16 GEMM
of the same shape: ms per call (eager, median), TFLOP/s, and the FP8 / bf16 time ratio.

Why: FP8 prefill ran at 32k tok/s against bf16's 57k (16 x 2,048 tokens, 2026-11-30), and fp8_gemm_config's
launch parameters were swept at decode sizes only (scripts/sweep_fp8_gemm.py, 64 / 256 tokens). At prefill the
grouped GEMM takes 64-wide column tiles with 4 warps where the bf16 fused-MoE GEMM takes 128 x 128 tiles with 8
warps (kernels/moe/gemm_triton.py pick_config). Compiled for sm_90 without a GPU (Triton 3.9, unit strides specialised as the
JIT does), the candidates fit: grouped 128 x 64 / 4 warps (the default) 220 registers, 128 x 128 / 8 warps 235-241,
no spills; 128 x 128 / 4 warps and 128 x 256 / 8 warps spill (255 registers and a stack).

Cases: routed experts gate_up (E 128, N 2 x 768, D 2048; token rows read in place) and down (N 2048, D 768; one row
a pair) on the fast path's alignment, with the alignment's block_m 64 or 128; dense qkv (N 4096 + 512 + 512,
D 2048) and o_proj (N 2048, D 4096). Inputs quantized beforehand, as the engine does (fp8_prequantize). Every
config's output is checked against the default's (the same sums: rel err at bf16 rounding).

    python scripts/sweep_fp8_prefill.py [--tokens 2048,16384] [--cases gate_up,down,qkv,o] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from moelora_bench.common import time_ms
from moelora.kernels.quant.fp8 import quantize_weight_block
from moelora.kernels.quant.fp8_act_triton import quantize_act_group
from moelora.kernels.quant.fp8_experts_triton import fp8_expert_gemm
from moelora.kernels.quant.fp8_triton import Fp8GemmConfig, fp8_gemm_config, fp8_linear
from moelora.kernels.moe.align_triton import moe_align
from moelora.kernels.moe.gemm_triton import expert_gemm, pick_config

H, I, E, K, Q, KV = 2048, 768, 128, 8, 4096, 512
BLOCK = (128, 128)


def expert_case(site: str, T: int, block_m: int):
    """(fp8 fn, bf16 fn, flops): the grouped GEMM of one site on an alignment of block_m rows."""
    dev = "cuda"
    N, D = (2 * I, H) if site == "gate_up" else (H, I)
    w = (torch.randn(E, N, D, device=dev) * D**-0.5).bfloat16()
    wq, ws = quantize_weight_block(w, BLOCK)
    topk = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    gather = site == "gate_up"
    rows = T if gather else T * K
    x = torch.randn(rows, D, device=dev).bfloat16()
    xq, xs = quantize_act_group(x)
    align = moe_align(topk, E, block_m)
    out = torch.empty(T * K, N, dtype=torch.bfloat16, device=dev)
    bf16_cfg = pick_config(T * K)
    bf16_align = moe_align(topk, E, bf16_cfg.block_m)

    def fp8(cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
        return fp8_expert_gemm(xq, wq, ws, BLOCK, topk, align, gather, block_m, x_scale=xs, config=cfg)

    def bf16() -> torch.Tensor:
        return expert_gemm(x, w, bf16_align, T * K, K, out, gather, config=bf16_cfg)

    return fp8, bf16, 2.0 * T * K * N * D


def dense_case(site: str, T: int):
    dev = "cuda"
    N, D = (Q + 2 * KV, H) if site == "qkv" else (H, Q)
    w = (torch.randn(N, D, device=dev) * D**-0.5).bfloat16()
    wq, ws = quantize_weight_block(w, BLOCK)
    x = torch.randn(T, D, device=dev).bfloat16()
    xq, xs = quantize_act_group(x)
    return (lambda cfg=None: fp8_linear(xq, wq, ws, BLOCK, x_scale=xs, config=cfg)), (lambda: F.linear(x, w)), \
        2.0 * T * N * D


def configs(kind: str, quick: bool = False) -> list[Fp8GemmConfig]:
    """The sweep's configs; quick: the few that compile for sm_90 without spills and differ most from the default
    (128-wide tiles at 8 warps; 64-wide at 8 warps)."""
    if kind == "expert":  # block_m is the alignment's (the outer loop)
        if quick:
            return [Fp8GemmConfig(128, 8, 3), Fp8GemmConfig(128, 8, 4), Fp8GemmConfig(64, 8, 4)]
        return [Fp8GemmConfig(bn, w, st) for bn, w, st in itertools.product((64, 128, 256), (4, 8), (3, 4))]
    if quick:
        return [Fp8GemmConfig(128, 8, 3, 128, 1), Fp8GemmConfig(128, 8, 4, 128, 1)]
    return [Fp8GemmConfig(bn, w, st, bm, 1)
            for bn, w, st, bm in itertools.product((128, 256), (4, 8), (3, 4), (64, 128))]


def sweep(name: str, kind: str, T: int, fp8, bf16, flops: float, rows: list, note: str, quick: bool) -> None:
    ref = fp8().float()
    t_def = time_ms(fp8, warmup=3, rep=20)
    t_bf = time_ms(bf16, warmup=3, rep=20)
    tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    print(f"{name:>8} T={T:5d} {note}: fp8 default {t_def:7.3f} ms ({tf(t_def):6.0f} TFLOP/s), bf16 {t_bf:7.3f} ms "
          f"({tf(t_bf):6.0f}); fp8 / bf16 {t_def / t_bf:.2f}", flush=True)
    rows.append({"case": name, "tokens": T, "note": note, "config": "default", "ms": t_def, "tflops": tf(t_def),
                 "default_ms": t_def, "bf16_ms": t_bf, "bf16_tflops": tf(t_bf)})
    best = (t_def, "default")
    for cfg in configs(kind, quick):
        try:
            err = ((fp8(cfg).float() - ref).norm() / ref.norm()).item()
            t = time_ms(lambda cfg=cfg: fp8(cfg), warmup=3, rep=20)
        except Exception as exc:  # out of shared memory etc.: skip this config, say so
            print(f"           {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
            continue
        rows.append({"case": name, "tokens": T, "note": note, "config": str(cfg), "block_n": cfg.block_n, "num_warps": cfg.num_warps,
                     "num_stages": cfg.num_stages, "block_m": cfg.block_m, "ms": t, "tflops": tf(t),
                     "default_ms": t_def, "bf16_ms": t_bf, "rel_err": err})
        flag = " <" if t < best[0] else ""
        best = min(best, (t, str(cfg)))
        print(f"           bn {cfg.block_n:3d} w {cfg.num_warps} st {cfg.num_stages} bm {cfg.block_m:3d}: {t:7.3f} ms "
              f"({tf(t):6.0f} TFLOP/s)  err {err:.1e}{flag}", flush=True)
    print(f"  best {name} T={T} {note}: {best[0]:.3f} ms with {best[1]}; default {t_def:.3f}, bf16 {t_bf:.3f} "
          f"(best fp8 / bf16 {best[0] / t_bf:.2f})", flush=True)


def _write(path: str, rows: list) -> None:
    import datetime
    import os

    import triton

    meta = {"kind": "sweep_fp8_prefill", "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(), "commit": os.environ.get("MOELORA_COMMIT"),
            "torch": torch.__version__, "triton": triton.__version__}
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,16384")
    ap.add_argument("--cases", default="gate_up,down,qkv,o")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="a few configs (configs(quick=True)) and only the alignment's default block_m")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list = []
    for T in (int(t) for t in args.tokens.split(",")):
        for case in args.cases.split(","):
            if case in ("gate_up", "down"):
                for bm in ((pick_config(T * K).block_m,) if args.quick else (64, 128)):
                    fp8, bf16, flops = expert_case(case, T, bm)
                    sweep(case, "expert", T, fp8, bf16, flops, rows, f"align block_m {bm}", args.quick)
            else:
                fp8, bf16, flops = dense_case(case, T)
                sweep(case, "dense", T, fp8, bf16, flops, rows,
                      f"default {fp8_gemm_config(T // 64, (Q + 2 * KV) if case == 'qkv' else H, False)}", args.quick)
            torch.cuda.empty_cache()
            if args.json:  # after every case: a run cut short keeps what it measured
                _write(args.json, rows)


if __name__ == "__main__":
    main()
