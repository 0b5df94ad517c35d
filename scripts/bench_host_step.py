"""Host time of one CUDA-graph decode step, without a GPU: what the GPU waits for between two steps.

The engine's decode step is synchronous (sampling reads the tokens back), so the scheduler, the graph's
input tensors and the per-request bookkeeping run while the GPU idles. This times, on the CPU, the parts that
do not need the GPU: Scheduler.schedule() over B running requests of a given context, the runner's per-request
inputs (ModelRunner._graph_step's lists), incremental_host_inputs (DecodeHostInputs.build: the graph's padded host
tensors, kept arrays, block tables updated in place, in steady decode) and SlotGroups.build of the LoRA slots; the
GPU's sampling and copies are not in it. Median µs of --reps steps.

Usage: python scripts/bench_host_step.py [--batches 64,256] [--contexts 128,1024] [--reps 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date

import torch

from moelora_bench.decode import QWEN3_30B_A3B
from moelora.config import ModelConfig
from moelora.engine.graph_inputs import DecodeHostInputs
from moelora.engine.kv_cache import KVCache
from moelora.engine.request import Request, Status
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.scheduler import Scheduler
from moelora.kernels.lora.groups import SlotGroups

BLOCK = 16


def _median_us(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def case(batch: int, ctx: int, reps: int) -> dict:
    cfg = ModelConfig.from_dict({**QWEN3_30B_A3B, "num_hidden_layers": 1})
    width = -(-(ctx + 256) // BLOCK)
    kv = KVCache(cfg, batch * width + 1, BLOCK, torch.bfloat16, "meta")  # block bookkeeping only
    sched = Scheduler(kv, None, None, max_num_seqs=batch, max_num_batched_tokens=8192)
    g = torch.Generator().manual_seed(batch + ctx)
    for i in range(batch):
        req = Request(f"r{i}", torch.randint(0, 151936, (ctx,), generator=g).tolist(), SamplingParams(), None, i,
                      output_ids=[1, 2, 3])
        req.status, req.num_computed = Status.RUNNING, req.num_tokens - 1
        req.block_table = kv.allocate(-(-req.num_tokens // BLOCK))
        sched.running.append(req)
    chunks = sched.schedule()
    assert len(chunks) == batch and all(c.num_tokens == 1 for c in chunks)

    def inputs():
        return ([c.request.token_at(c.start) for c in chunks], [c.start for c in chunks],
                [c.request.block_table for c in chunks], [c.request.slot for c in chunks])

    toks, pos, tables, slots = inputs()
    bs = next(b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256) if b >= batch)
    host = DecodeHostInputs(bs, width, BLOCK, 0)  # what StepGraphs.run uses by default: steady state here
    lora_slots = torch.tensor([i % 4 for i in range(batch)] + [-1] * (bs - batch), dtype=torch.int32)
    parts = {
        "schedule": lambda: sched.schedule(),
        "runner_inputs": inputs,
        "incremental_host_inputs": lambda: host.build(toks, pos, tables, bs),
        "slot_groups": lambda: SlotGroups.build(lora_slots, 8, "cpu"),
    }
    us = {k: round(_median_us(f, reps), 1) for k, f in parts.items()}
    total = sum(us.values())
    return {"batch": batch, "context": ctx, "us": us, "total_us": round(total, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [case(b, c, args.reps) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    for r in rows:
        print(f"batch {r['batch']:4d} context {r['context']:5d}: {r['total_us']:8.1f} µs  "
              + "  ".join(f"{k} {v:.1f}" for k, v in r["us"].items()))
    if args.out:
        meta = {"date": str(date.today()), "device": "cpu (host side only)", "git_commit": os.environ.get("MOELORA_COMMIT", "")}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
