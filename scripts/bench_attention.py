"""Paged-attention timing on the GPU: legacy kernel (kernel="legacy") vs the new kernels, Qwen3-30B-A3B dims.

    python scripts/bench_attention.py [--batches 1 16 64 128] [--contexts 128 1024] [--max-model-len 0]
                                      [--prefill 512 2048]

Decode: each configuration is timed inside a CUDA graph of --calls launches (as in the decode graphs: no
Python launch overhead), each launch on its own KV cache ("layers", cycled over enough caches to pass
the L2 cache), median of --reps replays; prints µs per call, the KV bytes one call reads (K and V of
every cached position of every sequence), the achieved GB/s, the split count, and max |new - old|.
--max-model-len N sizes the block-table width as the decode graphs do (N / block_size blocks per row;
0 = exactly the context's blocks). Prefill (--prefill N ...): one sequence of N new tokens, eager,
legacy vs the tiled prefill kernel. Tuning: --num-splits / --min-tiles override the split rule.
Smoke run without a GPU: TRITON_INTERPRET=1 python scripts/bench_attention.py --device cpu --batches 1
--contexts 100 --heads 4 2 16 --calls 2 --reps 1 --prefill 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moelora.kernels.attention_triton import choose_splits, paged_attention

L2_BYTES = 256 << 20  # cycle over enough KV caches to read at least this much per graph
DEV = ["cuda"]  # --device cpu: a smoke run under TRITON_INTERPRET=1 (fp16, timings meaningless)
DTYPE = [torch.bfloat16]


def bench_graph(fn, calls: int, reps: int) -> float:
    """µs per call of fn(i), captured for i in range(calls) in one CUDA graph, median over reps replays."""
    if DEV[0] != "cuda":
        return bench_eager(lambda: [fn(i) for i in range(calls)], reps) / calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
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


def bench_eager(fn, reps: int) -> float:
    fn()
    if DEV[0] != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def make_caches(n: int, blocks: int, BS: int, Hkv: int, D: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(blocks, BS, Hkv, D, device=DEV[0], dtype=DTYPE[0]),
             torch.randn(blocks, BS, Hkv, D, device=DEV[0], dtype=DTYPE[0])) for _ in range(n)]


def decode(args, Hq: int, Hkv: int, D: int, BS: int, sms: int) -> None:
    print(f"decode · µs per call (CUDA graph of {args.calls} calls)")
    print(f"{'batch':>5} {'ctx':>6} {'width':>6} {'splits':>6} {'KV MB':>8} {'old µs':>9} {'old GB/s':>9} "
          f"{'new µs':>8} {'new GB/s':>9} {'speedup':>8} {'max|diff|':>10}")
    for ctx in args.contexts:
        for B in args.batches:
            nblk = -(-ctx // BS)
            width = max(nblk, args.max_model_len // BS)
            kv_bytes = B * ctx * Hkv * D * 2 * 2  # K and V, bf16
            caches = make_caches(min(args.calls, -(-L2_BYTES // kv_bytes)), B * nblk + 1, BS, Hkv, D)
            bt = torch.zeros(B, width, dtype=torch.int32, device=DEV[0])
            bt[:, :nblk] = (torch.randperm(B * nblk, device=DEV[0]) + 1).view(B, nblk).int()
            q = torch.randn(B, Hq, D, device=DEV[0], dtype=DTYPE[0])
            token_seq = torch.arange(B, dtype=torch.int32, device=DEV[0])
            seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV[0])
            qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV[0])
            out_old, out_new = torch.zeros_like(q), torch.zeros_like(q)
            scale = D**-0.5

            def run(i: int, out: torch.Tensor, kernel: str) -> None:
                k, v = caches[i % len(caches)]
                paged_attention(q, k, v, bt, token_seq, seq_lens, qsl, scale, None, out, kernel=kernel,
                                num_splits=args.num_splits, min_tiles=args.min_tiles)

            t_old = bench_graph(lambda i: run(i, out_old, "legacy"), args.calls, args.reps)
            t_new = bench_graph(lambda i: run(i, out_new, "auto"), args.calls, args.reps)
            run(0, out_old, "legacy")
            run(0, out_new, "auto")
            splits = args.num_splits or choose_splits(B, Hkv, sms)
            diff = (out_old.float() - out_new.float()).abs().max().item()
            print(f"{B:>5} {ctx:>6} {width:>6} {splits:>6} {kv_bytes / 1e6:>8.2f} "
                  f"{t_old:>9.1f} {kv_bytes / t_old / 1e3:>9.1f} {t_new:>8.1f} {kv_bytes / t_new / 1e3:>9.1f} "
                  f"{t_old / t_new:>7.1f}x {diff:>10.2e}")
            del caches
            if DEV[0] == "cuda":
                torch.cuda.empty_cache()


def prefill(args, Hq: int, Hkv: int, D: int, BS: int) -> None:
    print("prefill · one sequence, eager, µs per call")
    print(f"{'tokens':>6} {'old µs':>10} {'new µs':>10} {'speedup':>8} {'max|diff|':>10}")
    for n in args.prefill:
        nblk = -(-n // BS)
        ((k, v),) = make_caches(1, nblk + 1, BS, Hkv, D)
        bt = (torch.arange(nblk, device=DEV[0], dtype=torch.int32) + 1)[None]
        q = torch.randn(n, Hq, D, device=DEV[0], dtype=DTYPE[0])
        token_seq = torch.zeros(n, dtype=torch.int32, device=DEV[0])
        seq_lens = torch.tensor([n], dtype=torch.int32, device=DEV[0])
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV[0])
        outs = {name: torch.zeros_like(q) for name in ("legacy", "auto")}
        times = {name: bench_eager(lambda: paged_attention(q, k, v, bt, token_seq, seq_lens, qsl, D**-0.5, None, out,
                                                           kernel=name), args.reps)
                 for name, out in outs.items()}
        diff = (outs["legacy"].float() - outs["auto"].float()).abs().max().item()
        print(f"{n:>6} {times['legacy']:>10.1f} {times['auto']:>10.1f} {times['legacy'] / times['auto']:>7.1f}x "
              f"{diff:>10.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--prefill", type=int, nargs="*", default=[])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 4, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=48, help="launches per graph (48 = one per layer)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--num-splits", type=int, default=None, help="override choose_splits (tuning)")
    ap.add_argument("--min-tiles", type=int, default=None, help="override SPLIT_MIN_TILES (tuning)")
    ap.add_argument("--device", default="cuda", help="cpu: smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    DEV[0] = args.device
    if DEV[0] != "cuda":
        DTYPE[0] = torch.float16
    Hq, Hkv, D = args.heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV[0] == "cuda" else 132
    name = torch.cuda.get_device_name() if DEV[0] == "cuda" else "cpu"
    print(f"{name} ({sms} SMs) · Hq={Hq} Hkv={Hkv} D={D} block={args.block_size} {str(DTYPE[0]).removeprefix('torch.')}")
    decode(args, Hq, Hkv, D, args.block_size, sms)
    if args.prefill:
        prefill(args, Hq, Hkv, D, args.block_size)


if __name__ == "__main__":
    main()
