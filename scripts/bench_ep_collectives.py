"""The expert-parallel transports measured on 2 GPUs (issue 10: "all-gather/reduce-scatter or all-to-all; choose by
measurement"), one MoE layer's collectives at decode sizes, each captured 48 times (one per layer) in a CUDA
graph as the decode step runs them, then replayed; µs per layer.

  all_reduce     [T, H] summed over the ranks: what moelora runs (attention replicated, every rank holds every
                 token, computes its experts' pairs, the all-reduce combines).
  ag_rs          all-gather [T/ep, H] -> [T, H] then reduce-scatter [T, H] -> [T/ep, H]: data-parallel attention
                 (each rank its own sequences) with the same replicated-token expert compute.
  a2a_tokens     all-to-all dispatch + combine of [T/ep, H] per peer: data-parallel attention, each token sent
                 once to each rank holding one of its experts (top-8 of 128 over 2 ranks: almost every token),
                 buffers of fixed size as a CUDA graph needs.
  a2a_pairs      the same with one row per (token, expert) pair, sized for the worst case ([T/ep * top_k, H]
                 per peer), as a dispatch without per-rank deduplication needs inside a graph.

Usage: python scripts/bench_ep_collectives.py [--tokens 64,256] [--hidden 2048] [--top-k 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import date

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS = 48


def _time_graph(fn, reps: int = 20) -> float:
    """µs per call of fn, from a CUDA graph of LAYERS calls replayed reps times (median replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / LAYERS)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    H, K = args.hidden, args.top_k
    rows = []
    for T in args.tokens:
        full = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)  # [T, H]
        part = torch.randn(T // world, H, device="cuda", dtype=torch.bfloat16)  # [T/ep, H]
        tok_in = torch.randn(T // world * world, H, device="cuda", dtype=torch.bfloat16)  # [T/ep per peer, H]
        tok_out = torch.empty_like(tok_in)
        pair_in = torch.randn(T // world * K * world, H, device="cuda", dtype=torch.bfloat16)
        pair_out = torch.empty_like(pair_in)

        def ag_rs():
            dist.all_gather_into_tensor(full, part)
            dist.reduce_scatter_tensor(part, full)

        def a2a(inp, out):
            def f():
                dist.all_to_all_single(out, inp)  # dispatch
                dist.all_to_all_single(inp, out)  # combine
            return f

        cases = {
            "all_reduce": (lambda: dist.all_reduce(full), T * H * 2),
            "ag_rs": (ag_rs, 2 * T * H * 2),
            "a2a_tokens": (a2a(tok_in, tok_out), 2 * tok_in.numel() * 2),
            "a2a_pairs": (a2a(pair_in, pair_out), 2 * pair_in.numel() * 2),
        }
        for name, (fn, nbytes) in cases.items():
            us = _time_graph(fn)
            rows.append({"tokens": T, "transport": name, "us_per_layer": round(us, 2),
                         "ms_per_step_48_layers": round(us * LAYERS / 1000, 3), "buffer_bytes": nbytes})
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,256", help="decode batch sizes (tokens per step)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", default=None, help="folder for ep-collectives-<date>-<device>.json")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    world = 2
    if torch.cuda.device_count() < world:
        raise SystemExit(f"bench_ep_collectives: needs {world} GPUs, found {torch.cuda.device_count()}")
    from moelora.distributed.parallel_state import free_port

    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, free_port(), args, q), nprocs=world, join=True)
    rows = q.get()
    for r in rows:
        print(f"T {r['tokens']:>4} {r['transport']:>11}: {r['us_per_layer']:8.1f} µs/layer "
              f"{r['ms_per_step_48_layers']:7.3f} ms/step  ({r['buffer_bytes'] / 1e6:.2f} MB moved per rank)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        dev = torch.cuda.get_device_name().replace(" ", "-")
        path = os.path.join(args.out, f"ep-collectives-{date.today()}-{dev}.json")
        meta = {"date": str(date.today()), "device": torch.cuda.get_device_name(), "world": world,
                "hidden": args.hidden, "top_k": args.top_k, "layers": LAYERS,
                "git_commit": os.environ.get("MOELORA_COMMIT", "")}
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print("results:", path)


if __name__ == "__main__":
    main()
