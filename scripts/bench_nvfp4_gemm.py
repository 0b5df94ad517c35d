"""NVFP4 weight-only GEMMs on the GPU at Qwen3-30B-A3B decode shapes: the session-11 kernel (nibble planes through
e4m3 bit patterns, kernels/nvfp4_triton.py) over a sweep of its launch configurations, against the kernel it
replaced (scripts/_nvfp4_v1_kernel.py: per-element decode with exp2), each beside its byte floor (packed weights +
scales + activations + output at the measured copy bandwidth). Checks each result against the reference.
Usage: python scripts/bench_nvfp4_gemm.py OUT.json"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import _nvfp4_v1_kernel as v1  # noqa: E402
from moelora.kernels import nvfp4_triton as v2  # noqa: E402
from moelora.kernels.fp8_triton import fp8_grouped_align  # noqa: E402
from moelora.kernels.nvfp4 import quantize_nvfp4  # noqa: E402


def timed(fn, iters=40) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # µs


def copy_bw() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() / us / 1e3  # GB/s


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(out_path: str) -> None:
    torch.manual_seed(0)
    bw = copy_bw()
    E, K_TOP, H, I = 128, 8, 2048, 768
    cases = []
    for name, N, Kd in (("gate_up", 2 * I, H), ("down", H, I)):
        w = torch.randn(E, N, Kd, device="cuda") * Kd**-0.5
        p, s, s2 = quantize_nvfp4(w)
        s2 = s2.expand(E, N).contiguous()
        del w
        for T in (64, 128, 256):
            P = T * K_TOP
            pe = torch.randint(0, E, (P,), device="cuda")
            x = torch.randn(P, Kd, device="cuda").bfloat16()
            cases.append((f"{name} T {T}", "grouped", x, p, s, s2, pe))
    for name, N, Kd in (("qkv", 5120, H), ("o_proj", H, 4096)):
        w = torch.randn(N, Kd, device="cuda") * Kd**-0.5
        p, s, s2 = quantize_nvfp4(w)
        s2 = s2.expand(N).contiguous()
        x = torch.randn(64, Kd, device="cuda").bfloat16()
        cases.append((f"{name} T 64", "dense", x, p, s, s2, None))
    configs = [dict(block_n=64, block_k=128, num_warps=4, num_stages=3), dict(block_n=128, block_k=128, num_warps=4, num_stages=3),
               dict(block_n=128, block_k=128, num_warps=8, num_stages=3), dict(block_n=64, block_k=256, num_warps=4, num_stages=3),
               dict(block_n=128, block_k=256, num_warps=8, num_stages=3), dict(block_n=64, block_k=128, num_warps=4, num_stages=4),
               dict(block_n=32, block_k=256, num_warps=4, num_stages=3)]
    rows = []
    print(f"copy bandwidth {bw:.0f} GB/s; µs per call")
    for label, kind, x, p, s, s2, pe in cases:
        experts = pe.unique().numel() if pe is not None else 1
        nbytes = (p[0].numel() + s[0].numel() + s2[0].numel() * 4) * experts if pe is not None else \
            p.numel() + s.numel() + s2.numel() * 4
        nbytes += x.numel() * 2 + x.shape[0] * p.shape[-2] * 2
        floor = nbytes / bw / 1e3
        if kind == "grouped":
            ref = v2.nvfp4_grouped_gemm_ref(x, p, s, s2, pe)
            old = lambda: v1.nvfp4_grouped_gemm(x, p, s, s2, pe, align)  # noqa: E731
            align = fp8_grouped_align(pe, p.shape[0])
            new = lambda: v2.nvfp4_grouped_gemm(x, p, s, s2, pe, align)  # noqa: E731
        else:
            ref = v2.nvfp4_linear_ref(x, p, s, s2)
            old = lambda: v1.nvfp4_linear(x, p, s, s2)  # noqa: E731
            new = lambda: v2.nvfp4_linear(x, p, s, s2)  # noqa: E731
        row = dict(case=label, floor_us=floor, bytes=nbytes, v1_us=timed(old), v1_rel=rel(old(), ref), configs=[])
        for cfg in configs:
            for dbm in ((0, 16) if kind == "dense" else (0,)):
                v2.CONFIG.update(cfg, dense_block_m=dbm)
                try:
                    row["configs"].append(dict(cfg, dense_block_m=dbm, us=timed(new), rel=rel(new(), ref)))
                except Exception as err:  # a configuration out of resources: noted, not fatal
                    row["configs"].append(dict(cfg, dense_block_m=dbm, error=repr(err)[:200]))
        ok = [c for c in row["configs"] if "us" in c]
        best = min(ok, key=lambda c: c["us"])
        dflt = ok[0]
        print(f"{label:16s} floor {floor:7.1f} | v1 {row['v1_us']:8.1f} (rel {row['v1_rel']:.1e}) | default "
              f"{dflt['us']:7.1f} (rel {dflt['rel']:.1e}) | best {best['us']:7.1f} "
              f"{best['block_n']}x{best['block_k']} w{best['num_warps']} s{best['num_stages']} bm{best['dense_block_m']}")
        rows.append(row)
    totals = {}
    for row in rows:
        for c in row["configs"]:
            if "us" in c:
                key = f"{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']} bm{c['dense_block_m']}"
                totals[key] = totals.get(key, 0.0) + c["us"]
    print("sum over cases:", ", ".join(f"{k} {v:.0f}" for k, v in sorted(totals.items(), key=lambda kv: kv[1])[:5]))
    meta = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("MOELORA_COMMIT", "?"), copy_gb_s=bw,
                torch=torch.__version__)
    with open(out_path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, totals=totals), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
