"""What prefetching base weights into L2 beside a latency-bound stretch can give (GPU), and the H200's read bandwidth.

1. Read bandwidth: the byte floor of `bench decode` counts bytes at the device-to-device copy bandwidth; a step that
   only reads weights may stream faster than a copy (no writes). Measured: the copy (read + write counted), torch's
   amax over the buffer, and a Triton streaming read (sum of int32 words, swept launch), all over 2 GB.
2. The FP8 gate_up expert GEMM at Qwen3-30B-A3B shapes (64 tokens, top-8), each call after a `wait_us` spin kernel on
   one SM (standing in for the router and alignment, which leave HBM idle), with and without
   l2_prefetch.expert_rows_range(w, rows) forked on the prefetch stream before the spin. Layers' weights in rotation
   (403 MB each) so that L2 holds nothing from the previous call. µs per (spin + GEMM) from CUDA-graph replay.
3. The same for the dense qkv and o_proj GEMMs (whole weight prefetched) after a shorter spin.

    python scripts/bench_l2_prefetch.py [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

from moelora.bench._read_kernel import read_words
from moelora.bench.common import graph_time_us, hbm_bandwidth_gbs, time_ms, write_json
from moelora.kernels.fp8 import quantize_weight_block
from moelora.kernels.fp8_triton import fp8_expert_gemm, fp8_linear, quantize_act_group
from moelora.kernels.fused_moe_triton import moe_align, pick_config
from moelora.kernels.l2_prefetch import expert_rows_range, l2_prefetch, prefetch_stream, whole_range
from moelora.kernels.streams import fork, join

H, I, E, K, Q, KV = 2048, 768, 128, 8, 4096, 512
BLOCK = (128, 128)


def read_bandwidth(nbytes: int = 2 << 30) -> dict:
    buf = torch.randint(-1000, 1000, (nbytes // 4,), dtype=torch.int32, device="cuda")
    out = {"copy_gbs": hbm_bandwidth_gbs(nbytes)}
    bf = buf.view(torch.bfloat16)
    out["torch_amax_gbs"] = nbytes / (time_ms(lambda: bf.amax(), rep=50) * 1e-3) / 1e9
    best = (0.0, "")
    for block, iters, warps in [(2048, 8, 4), (4096, 4, 8), (4096, 16, 8), (8192, 4, 8), (8192, 8, 16),
                                (16384, 2, 16)]:
        gbs = nbytes / (time_ms(lambda: read_words(buf, block, iters, warps), rep=50) * 1e-3) / 1e9
        out[f"triton_read_{block}x{iters}w{warps}_gbs"] = gbs
        best = max(best, (gbs, f"{block}x{iters}w{warps}"))
    out["triton_read_best_gbs"], out["triton_read_best"] = best
    return out


def spin_cycles(us: float) -> int:
    """torch.cuda._sleep's cycle count for about `us` µs (calibrated once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1 << 20
    torch.cuda._sleep(cycles)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    per_us = cycles / (start.elapsed_time(end) * 1e3)
    return max(1, int(us * per_us))


def with_prefetch(gemm, ranges_of, cycles: int, form: str | None):
    """fn(layer): [fork the prefetch of ranges_of(layer) (form None: none)], spin, [join], GEMM."""
    def fn(li: int):
        pf = prefetch_stream(torch.device("cuda"))
        main = None
        if form is not None:
            main = fork(pf)
            with torch.cuda.stream(pf):
                l2_prefetch(ranges_of(li), form)
        if cycles:
            torch.cuda._sleep(cycles)
        if main is not None:
            join(main, pf)
        return gemm(li)
    return fn


def expert_case(T: int, layers: int):
    dev = "cuda"
    ws = [quantize_weight_block((torch.randn(E, 2 * I, H, device=dev) * H**-0.5).bfloat16(), BLOCK)
          for _ in range(layers)]
    topk = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    bm = pick_config(T * K).block_m
    align = moe_align(topk, E, bm)
    xq, xs = quantize_act_group(torch.randn(T, H, device=dev).bfloat16())
    touched = int(topk.unique().numel())

    def gemm(li):
        w, s = ws[li]
        return fp8_expert_gemm(xq, w, s, BLOCK, topk, align, True, bm, x_scale=xs)

    return gemm, (lambda li, rows: [expert_rows_range(ws[li][0], rows)]), touched * 2 * I * H


def dense_case(site: str, T: int, layers: int):
    dev = "cuda"
    N, D = (Q + 2 * KV, H) if site == "qkv" else (H, Q)
    ws = [quantize_weight_block((torch.randn(N, D, device=dev) * D**-0.5).bfloat16(), BLOCK) for _ in range(layers)]
    xq, xs = quantize_act_group(torch.randn(T, D, device=dev).bfloat16())

    def gemm(li):
        w, s = ws[li]
        return fp8_linear(xq, w, s, BLOCK, x_scale=xs)

    return gemm, (lambda li: [whole_range(ws[li][0])]), N * D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", default="64,128,192,256,384")
    ap.add_argument("--wait-us", default="0,12")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = read_bandwidth()
    print("bandwidth GB/s: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in bw.items()), flush=True)
    rows_out = []
    layers = 4
    gemm, ranges, nbytes = expert_case(args.tokens, layers)
    ref = gemm(0).clone()
    for wait in (float(w) for w in args.wait_us.split(",")):
        cyc = spin_cycles(wait) if wait else 0
        spin_only = graph_time_us(lambda li: torch.cuda._sleep(cyc), layers) if cyc else 0.0
        base = graph_time_us(with_prefetch(gemm, None, cyc, None), layers)
        print(f"gate_up T={args.tokens} wait {wait:4.1f} us (spin alone {spin_only:5.1f}): no prefetch {base:6.1f} us "
              f"(GEMM {base - spin_only:5.1f}, floor {nbytes / bw['copy_gbs'] / 1e3:5.1f} at copy bw)", flush=True)
        rows_out.append({"case": "gate_up", "wait_us": wait, "spin_us": spin_only, "rows": 0, "form": None,
                         "us": base})
        for form in ("line", "bulk"):
            for r in (int(v) for v in args.rows.split(",")):
                fn = with_prefetch(gemm, lambda li, r=r: ranges(li, r), cyc, form)
                same = torch.equal(fn(0), ref)
                t = graph_time_us(fn, layers)
                mb = E * r * H / 1e6
                flag = "" if same else " DIFFERS"
                print(f"   {form:4s} rows {r:3d} ({mb:5.1f} MB): {t:6.1f} us  ({t - base:+5.1f}){flag}", flush=True)
                rows_out.append({"case": "gate_up", "wait_us": wait, "spin_us": spin_only, "rows": r, "form": form,
                                 "us": t, "delta_us": t - base, "same_output": same})
    del gemm, ranges
    torch.cuda.empty_cache()
    for site in ("qkv", "o_proj"):
        gemm, ranges, nbytes = dense_case(site, args.tokens, 16)
        for wait in (0.0, 6.0):
            cyc = spin_cycles(wait) if wait else 0
            spin_only = graph_time_us(lambda li: torch.cuda._sleep(cyc), 16) if cyc else 0.0
            base = graph_time_us(with_prefetch(gemm, None, cyc, None), 16)
            line = f"{site} T={args.tokens} wait {wait:3.1f} (spin {spin_only:4.1f}): none {base:5.1f} us"
            rows_out.append({"case": site, "wait_us": wait, "spin_us": spin_only, "form": None, "us": base})
            for form in ("line", "bulk"):
                t = graph_time_us(with_prefetch(gemm, ranges, cyc, form), 16)
                line += f", {form} {t:5.1f} ({t - base:+4.1f})"
                rows_out.append({"case": site, "wait_us": wait, "spin_us": spin_only, "form": form, "us": t,
                                 "delta_us": t - base})
            print(line, flush=True)
    if args.json:
        write_json(args.json, "bench_l2_prefetch", {"bandwidth": bw, "rows": rows_out})


if __name__ == "__main__":
    main()
