"""Decode paged-attention timing on the GPU: legacy kernel (kernel="legacy") vs split-KV, Qwen3-30B-A3B dims.

    python scripts/bench_attention.py [--batches 1 16 64 128] [--contexts 128 1024] [--max-model-len 0]

Each configuration is timed inside a CUDA graph of --calls launches (as in the decode graphs, so no
Python launch overhead), median of --reps replays; prints µs per call, the KV bytes one call reads
(K and V of every cached position of every sequence) and the achieved GB/s, and the max |new - old|.
--max-model-len N sizes the block table width as the decode graphs do (N / block_size blocks per row);
0 = exactly the context's blocks.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moelora.kernels.attention_triton import choose_splits, paged_attention


def bench(fn, calls: int, reps: int) -> float:
    """µs per call of fn, captured `calls` times in one CUDA graph, median over reps replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 4, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=48, help="launches per graph (48 = one per layer)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    Hq, Hkv, D = args.heads
    BS, dt = args.block_size, torch.bfloat16
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()} · Hq={Hq} Hkv={Hkv} D={D} block={BS} bf16 · µs per call (graph of {args.calls})")
    print(f"{'batch':>5} {'ctx':>6} {'width':>6} {'splits':>6} {'KV MB':>8} "
          f"{'old µs':>9} {'old GB/s':>9} {'new µs':>8} {'new GB/s':>9} {'speedup':>8} {'max|diff|':>10}")
    for ctx in args.contexts:
        for B in args.batches:
            width = max(-(-ctx // BS), args.max_model_len // BS)
            nb = B * -(-ctx // BS) + 1
            k_cache = torch.randn(nb, BS, Hkv, D, device=dev, dtype=dt)
            v_cache = torch.randn(nb, BS, Hkv, D, device=dev, dtype=dt)
            bt = torch.zeros(B, width, dtype=torch.int32, device=dev)
            bt[:, : -(-ctx // BS)] = (torch.randperm(nb - 1, device=dev)[: B * -(-ctx // BS)] + 1).view(B, -1).int()
            q = torch.randn(B, Hq, D, device=dev, dtype=dt)
            token_seq = torch.arange(B, dtype=torch.int32, device=dev)
            seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
            out_old, out_new = torch.zeros_like(q), torch.zeros_like(q)
            scale = D**-0.5

            def old():
                paged_attention(q, k_cache, v_cache, bt, token_seq, seq_lens, qsl, scale, None, out_old, kernel="legacy")

            def new():
                paged_attention(q, k_cache, v_cache, bt, token_seq, seq_lens, qsl, scale, None, out_new)

            t_old, t_new = bench(old, args.calls, args.reps), bench(new, args.calls, args.reps)
            diff = (out_old.float() - out_new.float()).abs().max().item()
            kv_bytes = B * ctx * Hkv * D * 2 * k_cache.element_size()
            nsplit = choose_splits(B, Hkv, torch.cuda.get_device_properties(0).multi_processor_count)
            print(f"{B:>5} {ctx:>6} {width:>6} {nsplit:>6} {kv_bytes / 1e6:>8.2f} "
                  f"{t_old:>9.1f} {kv_bytes / t_old / 1e3:>9.1f} {t_new:>8.1f} {kv_bytes / t_new / 1e3:>9.1f} "
                  f"{t_old / t_new:>7.1f}x {diff:>10.2e}")
            del k_cache, v_cache


if __name__ == "__main__":
    main()
