"""FP8 / NVFP4 base GEMMs against bf16 and their byte floors (GPU): the routed experts' gate_up GEMM at
Qwen3-30B-A3B shapes (H 2048, I 768, E 128, top-8) over (token, k) pairs, and a 4096x4096 dense layer.
Times are medians of triton.testing.do_bench, alignment included; floor = weight bytes touched / copy bandwidth.

    python scripts/bench_fp8_kernels.py            # prints one line per case
"""

from __future__ import annotations

import torch

from moelora.bench.common import hbm_bandwidth_gbs, time_ms
from moelora.kernels.fp8 import quantize_weight_block
from moelora.kernels.fp8_triton import fp8_grouped_align, fp8_grouped_gemm, fp8_linear
from moelora.kernels.moe import _ExpertGemm
from moelora.kernels.nvfp4 import quantize_nvfp4
from moelora.kernels.nvfp4_triton import nvfp4_grouped_gemm, nvfp4_linear

H, I, E, K = 2048, 768, 128, 8


def main() -> None:
    dev = "cuda"
    bw = hbm_bandwidth_gbs() * 1e9  # bytes/s
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5).bfloat16()
    q, s = quantize_weight_block(w)
    p4, s4, g4 = quantize_nvfp4(w)
    g4 = g4.expand(E, 2 * I).contiguous()
    for T in (1, 16, 64, 256):
        pair_exp = torch.randint(0, E, (T * K,), device=dev, generator=g)
        x = torch.randn(T * K, H, device=dev, generator=g).bfloat16()
        touched = int(pair_exp.unique().numel())
        gemm = _ExpertGemm(pair_exp, E)
        t_bf16 = time_ms(lambda: gemm(x, w))
        t_fp8 = time_ms(lambda: fp8_grouped_gemm(x, q, s, pair_exp, align=fp8_grouped_align(pair_exp, E)))
        t_fp4 = time_ms(lambda: nvfp4_grouped_gemm(x, p4, s4, g4, pair_exp, align=fp8_grouped_align(pair_exp, E)))
        el = touched * 2 * I * H
        floors = [el * b / bw * 1e3 for b in (2, 1 + 4 / 128**2, 0.5 + 1 / 16)]
        print(f"experts gate_up T={T:4d} touched={touched:3d}: bf16 {t_bf16 * 1e3:7.1f} us (floor {floors[0] * 1e3:6.1f})"
              f"  fp8 {t_fp8 * 1e3:7.1f} us (floor {floors[1] * 1e3:6.1f})  nvfp4 {t_fp4 * 1e3:7.1f} us "
              f"(floor {floors[2] * 1e3:6.1f})", flush=True)
    wd = (torch.randn(4096, 4096, device=dev, generator=g) * 4096**-0.5).bfloat16()
    qd, sd = quantize_weight_block(wd)
    pd, sd4, gd4 = quantize_nvfp4(wd)
    gd4 = gd4.expand(4096).contiguous()
    for T in (1, 16, 64, 256):
        x = torch.randn(T, 4096, device=dev, generator=g).bfloat16()
        t_bf16 = time_ms(lambda: torch.nn.functional.linear(x, wd))
        t_fp8 = time_ms(lambda: fp8_linear(x, qd, sd))
        t_fp4 = time_ms(lambda: nvfp4_linear(x, pd, sd4, gd4))
        floors = [4096 * 4096 * b / bw * 1e6 for b in (2, 1, 0.5625)]
        print(f"dense 4096x4096 T={T:4d}: bf16 {t_bf16 * 1e3:6.1f} us (floor {floors[0]:5.1f})  fp8 {t_fp8 * 1e3:6.1f} us "
              f"(floor {floors[1]:5.1f})  nvfp4 {t_fp4 * 1e3:6.1f} us (floor {floors[2]:5.1f})", flush=True)


if __name__ == "__main__":
    main()
