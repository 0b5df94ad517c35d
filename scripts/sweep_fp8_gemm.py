"""Sweep the FP8 block-scaled GEMM's launch parameters at Qwen3-30B-A3B decode shapes (GPU), µs per call from
CUDA-graph replay beside the byte floor (weight bytes touched + scales, over the measured copy bandwidth).

Shapes: routed experts gate_up (E 128, N 2 x 768, K 2048) and down (N 2048, K 768) on the fast path's alignment
(kernels/moe/align_triton.py moe_align, block_m of gemm_triton.pick_config), inputs quantized beforehand as the engine does; dense
qkv (N 4096 + 512 + 512, K 2048) and o_proj (N 2048, K 4096). T = 64 and 256 tokens, top-8 routing drawn
per token without repeats. Several layers' weights in rotation so L2 does not hold them between calls.
Every config's output is checked against the default config's (the K step is the scale group, so the sums are the
same up to split-K's order of adding the partials; rel err must stay at bf16 rounding, ~1e-3).

    python scripts/sweep_fp8_gemm.py [--tokens 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from moelora_bench.common import graph_time_us, hbm_bandwidth_gbs, write_json
from moelora.kernels.quant.fp8 import quantize_weight_block
from moelora.kernels.quant.fp8_act_triton import quantize_act_group
from moelora.kernels.quant.fp8_experts_triton import fp8_expert_gemm
from moelora.kernels.quant.fp8_triton import Fp8GemmConfig, fp8_gemm_config, fp8_linear
from moelora.kernels.moe.align_triton import moe_align
from moelora.kernels.moe.gemm_triton import pick_config

H, I, E, K, Q, KV = 2048, 768, 128, 8, 4096, 512
BLOCK = (128, 128)
# the grouped expert GEMM's decode launches swept, block_n x warps x stages (the default is 64 x 4 x 4; none was
# faster at 64 or 256 tokens: bench/results/micro.jsonl, set sweep-fp8-expert-tiles)
EXPERT_TILES = ("16x2x4", "32x2x4", "32x4x4", "32x4x6", "64x4x3", "64x4x6", "64x8x4", "128x4x4", "128x8x4", "128x8x3")


def expert_case(site: str, T: int, layers: int):
    dev = "cuda"
    N, D = (2 * I, H) if site == "gate_up" else (H, I)
    ws = [quantize_weight_block((torch.randn(E, N, D, device=dev) * D**-0.5).bfloat16(), BLOCK) for _ in range(layers)]
    topk = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    bm = pick_config(T * K).block_m
    align = moe_align(topk, E, bm)
    rows = T if site == "gate_up" else T * K
    xq, xs = quantize_act_group(torch.randn(rows, D, device=dev).bfloat16())
    touched = int(topk.unique().numel())
    nbytes = touched * (N * D + 4 * N * D // 128**2)

    def fn(li, cfg=None):
        w, s = ws[li]
        return fp8_expert_gemm(xq, w, s, BLOCK, topk, align, site == "gate_up", bm, x_scale=xs, config=cfg)

    return fn, nbytes, f"touched={touched} block_m={bm}", align[1].shape[0]


def dense_case(site: str, T: int, layers: int):
    dev = "cuda"
    N, D = (Q + 2 * KV, H) if site == "qkv" else (H, Q)
    ws = [quantize_weight_block((torch.randn(N, D, device=dev) * D**-0.5).bfloat16(), BLOCK) for _ in range(layers)]
    xq, xs = quantize_act_group(torch.randn(T, D, device=dev).bfloat16())
    nbytes = N * D + 4 * N * D // 128**2

    def fn(li, cfg=None):
        w, s = ws[li]
        return fp8_linear(xq, w, s, BLOCK, x_scale=xs, config=cfg)

    return fn, nbytes, "", None


def configs(kind: str) -> list[Fp8GemmConfig]:
    if kind == "expert":
        return [Fp8GemmConfig(*(int(v) for v in t.split("x"))) for t in EXPERT_TILES]
    out = [Fp8GemmConfig(bn, 4, st, 64, sk) for bn, st, sk in itertools.product((64, 128), (3, 4), (1, 2, 4, 8))]
    return out + [Fp8GemmConfig(64, 4, 4, 16, sk) for sk in (1, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--cases", default="gate_up,down,qkv,o")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = hbm_bandwidth_gbs()
    print(f"HBM {bw:.0f} GB/s measured (copy); fp8 e4m3, 128x128 weight blocks; µs per call (CUDA-graph replay)")
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for case in args.cases.split(","):
            kind = "expert" if case in ("gate_up", "down") else "dense"
            layers = 2 if kind == "expert" else 8
            fn, nbytes, info, grid_m = (expert_case if kind == "expert" else dense_case)(case, T, layers)
            floor = nbytes / (bw * 1e9) * 1e6
            ref = fn(0).float()
            default = fp8_gemm_config(grid_m or 0, ref.shape[1], kind == "expert") if kind == "expert" else "auto"
            t_def = graph_time_us(fn, layers)
            print(f"{case:>8} T={T:4d} default {t_def:7.1f} us  floor {floor:6.1f} us ({floor / t_def:5.1%} of HBM)"
                  f"  {info} {default or ''}", flush=True)
            best = (t_def, "default")
            for cfg in configs(kind):
                try:
                    err = ((fn(0, cfg).float() - ref).norm() / ref.norm()).item()
                    t = graph_time_us(lambda li, cfg=cfg: fn(li, cfg), layers)
                except Exception as exc:  # out of shared memory etc.: skip this config, say so
                    print(f"           {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                    continue
                rows.append({"case": case, "tokens": T, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
                             "num_stages": cfg.num_stages, "block_m": cfg.block_m, "split_k": cfg.split_k, "us": t, "floor_us": floor,
                             "default_us": t_def, "rel_err": err})
                flag = " <" if t < best[0] else ""
                if t < best[0]:
                    best = (t, str(cfg))
                print(f"           bn {cfg.block_n:3d} w {cfg.num_warps} st {cfg.num_stages} bm {cfg.block_m:2d} sk {cfg.split_k}: "
                      f"{t:7.1f} us ({floor / t:5.1%})  err {err:.1e}{flag}", flush=True)
            print(f"  best {case} T={T}: {best[0]:.1f} us ({floor / best[0]:.1%} of HBM) with {best[1]}; "
                  f"default {t_def:.1f} us", flush=True)
            fn = None
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, "sweep_fp8_gemm", {"hbm_gbs": bw, "rows": rows})


if __name__ == "__main__":
    main()
