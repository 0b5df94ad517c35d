"""NVFP4 weight-only GEMMs on the GPU at Qwen3-30B-A3B decode shapes (kernels/nvfp4_triton.py) over a sweep of
their launch configurations (decode mode, tile sizes, dense split-K), timed in CUDA graphs, each beside its byte
floor (packed weights + scales + activations + output at the copy bandwidth measured the same way). Checks each
result against the reference. (Sessions 11's calls 3-4 also timed the kernel this one replaced: results under
bench/results/sweep-nvfp4-gemm-s11-*.)
Writes the best configuration per kind (least time summed over its cases) to best.json beside OUT.json, in
MOELORA_NVFP4_GEMM_CONFIG's format. Usage: python scripts/bench_nvfp4_gemm.py OUT.json"""

import json
import os
import sys

import torch

from moelora.kernels import nvfp4_triton as v2
from moelora.kernels.fused_moe_triton import moe_align, pick_config
from moelora.kernels.nvfp4 import quantize_nvfp4


def timed(fn, iters=20, replays=5) -> float:
    """µs per call, from a CUDA graph of `iters` calls (no host launch time, as in the engine's decode graphs);
    fn(i) is the i-th call (the dense cases rotate weight copies so that L2 holds none of them)."""
    fn(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * replays) * 1e3


def copy_bw() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda i: b.copy_(a), 4, 3)
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
            ids = torch.stack([torch.randperm(E, device="cuda")[:K_TOP] for _ in range(T)])  # [T, top_k]
            x = torch.randn(T * K_TOP, Kd, device="cuda").bfloat16()
            cases.append((f"{name} T {T}", "grouped", x, p, s, s2, ids))
    for name, N, Kd in (("qkv", 5120, H), ("o_proj", H, 4096)):
        w = torch.randn(N, Kd, device="cuda") * Kd**-0.5
        p, s, s2 = quantize_nvfp4(w)
        s2 = s2.expand(N).contiguous()
        copies = [(p.clone(), s.clone(), s2.clone()) for _ in range(20)]  # 20 x ~6 MB: none stays in L2
        for T in (64, 128):
            x = torch.randn(T, Kd, device="cuda").bfloat16()
            cases.append((f"{name} T {T}", "dense", x, p, s, s2, copies))
    grouped_cfgs = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=3, decode=d) for bn, bk, w, d in (
        (128, 128, 4, 2), (64, 128, 4, 0), (128, 128, 4, 0), (64, 128, 4, 2), (128, 128, 8, 2), (256, 128, 8, 2),
        (128, 256, 4, 2), (128, 128, 4, 1))]
    dense_cfgs = [dict(block_n=bn, block_k=128, num_warps=4, num_stages=3, decode=d, block_m=bm, split_k=sk)
                  for bn in (64, 128) for d in (0, 2) for bm in (0, 16) for sk in (0, 1)]
    rows = []
    print(f"copy bandwidth {bw:.0f} GB/s; µs per call")
    for label, kind, x, p, s, s2, pe in cases:
        grouped = kind == "grouped"
        experts = pe.unique().numel() if grouped else 1  # pe: topk_ids [T, top_k] (grouped)
        nbytes = (p[0].numel() + s[0].numel() + s2[0].numel() * 4) * experts if grouped else \
            p.numel() + s.numel() + s2.numel() * 4
        nbytes += x.numel() * 2 + x.shape[0] * p.shape[-2] * 2
        floor = nbytes / bw / 1e3
        if kind == "grouped":
            flat = pe.reshape(-1)
            ref = v2.nvfp4_grouped_gemm_ref(x, p, s, s2, flat)
            bm = pick_config(flat.numel()).block_m  # the engine's fast path: TritonExperts' alignment
            align = moe_align(pe, p.shape[0], bm)
            new = lambda i: v2.nvfp4_expert_gemm(x, p, s, s2, pe, align, False, bm)  # noqa: E731
        else:
            ref, copies = v2.nvfp4_linear_ref(x, p, s, s2), pe
            new = lambda i: v2.nvfp4_linear(x, *copies[i % len(copies)])  # noqa: E731
        row = dict(case=label, kind=kind, floor_us=floor, bytes=nbytes, 
                   configs=[])
        for cfg in (grouped_cfgs if kind == "grouped" else dense_cfgs):
            v2.CONFIG[kind] = dict(cfg)
            try:
                row["configs"].append(dict(cfg, us=timed(new), rel=rel(new(0), ref)))
            except Exception as err:  # a configuration out of resources: noted, not fatal
                row["configs"].append(dict(cfg, error=repr(err)[:200]))
        ok = [c for c in row["configs"] if "us" in c and c["rel"] < 2.0**-7]
        best = min(ok, key=lambda c: c["us"])
        print(f"{label:16s} floor {floor:7.1f} | first "
              f"{row['configs'][0].get('us', -1):7.1f} | best {best['us']:7.1f} "
              + " ".join(f"{k}={v}" for k, v in best.items() if k not in ("us", "rel")))
        bad = [c for c in row["configs"] if "us" not in c or c["rel"] >= 2.0**-7]
        for c in bad:
            print("   FAILED or wrong:", c)
        rows.append(row)
    best_cfg = {}
    for kind in ("grouped", "dense"):
        totals: dict = {}
        for row in rows:
            if row["kind"] != kind:
                continue
            for c in row["configs"]:
                key = json.dumps({k: v for k, v in c.items() if k not in ("us", "rel", "error")}, sort_keys=True)
                ok = "us" in c and c["rel"] < 2.0**-7
                totals[key] = totals.get(key, 0.0) + (c["us"] if ok else float("inf"))
        ranked = sorted(totals.items(), key=lambda kv: kv[1])
        best_cfg[kind] = json.loads(ranked[0][0])
        print(f"{kind}: sum over its cases, best five:", "; ".join(f"{k} {v:.0f}" for k, v in ranked[:5]))
    print("best:", json.dumps(best_cfg))
    with open(os.path.join(os.path.dirname(out_path), "best.json"), "w") as f:
        json.dump(best_cfg, f)
    meta = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("MOELORA_COMMIT", "?"), copy_gb_s=bw,
                torch=torch.__version__)
    with open(out_path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, best=best_cfg), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
