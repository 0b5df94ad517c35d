"""Time one decode step's sampling on the GPU: the Sampler's one-pass kernel (kernels/sample_triton.py) against its
torch path, at Qwen3's vocabulary (151,936) in bf16, temperature 1 (the `bench decode` setting) and greedy.
CUDA events around Sampler.sample (the .tolist() synchronisation included), median of 50 after 5 warm-ups.
"T=0": every row greedy but the last (T=1), so that the fused path runs (an all-greedy batch takes the torch path).

Usage: python scripts/bench_sampler.py [--batches 64,256] [--vocab 151936] [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moelora.engine.sampler import Sampler
from moelora.engine.sampling_params import SamplingParams


def time_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        logits = torch.randn(B, a.vocab, device="cuda").to(torch.bfloat16)
        for temp in (1.0, 0.0):
            params = [SamplingParams(temperature=temp)] * (B - 1) + [SamplingParams(temperature=1.0)]
            row = {"batch": B, "vocab": a.vocab, "temperature": temp}
            for fused in (False, True):
                s = Sampler(fused=fused)
                row["fused_ms" if fused else "torch_ms"] = time_ms(lambda: s.sample(logits, params, [None] * B))
            # the byte floor: one read of the bf16 logits at the device's copy bandwidth is ~B * V * 2 / 4.2e12 s
            row["floor_ms"] = B * a.vocab * 2 / 4.2e9
            rows.append(row)
            print(f"batch {B:4d} T={temp}: torch {row['torch_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms "
                  f"(logits read once: {row['floor_ms']:.3f} ms)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
