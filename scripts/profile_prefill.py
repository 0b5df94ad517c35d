"""Where the prefill LoRA tax goes (GPU): Qwen3-30B-A3B dimensions, dummy weights, the engine of
`moelora bench report --parts prefill` (16 prompts x 2,048 tokens in 8,192-token chunks), one prefill pass
under torch.profiler per adapter count; the kernels by device time, and the per-kernel difference against no
adapter (moelora_bench/profile.py's profile_tax).

A small prefill (`--prompts 2 --prompt-len 128`) shows how much of a serving prefill step is the host's: the timed
pass's wall time beside its kernels' device time.

Why: prefill with adapters kept only 53-66% of the no-adapter tokens/s (bench/results/report.jsonl, set
report-prefill: bf16 56,417 -> 34,346 / 30,092 with 1 / 4 adapters; fp8 49,889 -> 32,553 / 33,105), although
rank-16 LoRA adds ~0.1% of the FLOPs. Its rows: bench/results/prefill.jsonl.

    python scripts/profile_prefill.py [--dtype fp8] [--adapters 0,1,4] [--json out.json] [--lines 25]
        [--variants "noepi:moe_lora.prefill_epilogue=0"] [--no-profile] [--host-profile N]
The defaults run first, then each variant: the kernel config with those dotted fields set (bench decode --ab's
syntax, docs/configuration.md), applied to the one engine between runs (LLMEngine.reconfigure); each variant times
every adapter count (a warm-up pass, then a timed one) and, unless --no-profile, profiles a third.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from moelora.kernels.config import KernelConfig
from moelora_bench import decode, report
from moelora_bench.ab import parse_ab
from moelora_bench.common import git_commit
from moelora_bench.profile import format_profile, format_profile_tax, profile_steps, profile_tax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--adapters", default="0,1,4")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lines", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="", help="--ab style 'name:key=value[,key=value];...', after the defaults")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also run one more pass under cProfile and print its N functions of most own host time")
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None, metavar="N",
                    help="the engine's --max-prefill-graph-tokens (default: the engine's; 0: every step eager)")
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen3-MoE on the CPU (a smoke test of the script)")
    args = ap.parse_args()
    variants = [("default", KernelConfig())] + parse_ab(args.variants, KernelConfig())
    device = torch.device("cpu" if args.tiny else "cuda")
    counts = [int(n) for n in args.adapters.split(",")]
    folder = report._write_config(dict(decode.TINY if args.tiny else decode.QWEN3_30B_A3B))
    g = {"batches": [64], "prefill_prompts": args.prompts, "prefill_len": args.prompt_len, "workload": "vllm",
         "decode_steps": 32}
    if args.max_prefill_graph_tokens is not None:
        g["max_prefill_graph_tokens"] = args.max_prefill_graph_tokens
    kv_bytes = None if args.tiny else report._kv_bytes(folder, report.engine_dtype(args.dtype)["dtype"],
                                args.prompts * (args.prompt_len + 16) + 64 * 272)
    engine = report._build_engine(folder, args.dtype, args.rank, max(max(counts), 1), g, device, kv_bytes)
    report._register_adapters(engine, max(max(counts), 1), args.rank)
    rows = []
    for vname, cfg in variants:
        engine.reconfigure(cfg)
        base = None
        for n in counts:
            report.prefill_case(engine, args.prompts, args.prompt_len, n, seed=5)  # compile, autotune, loads
            timed = report.prefill_case(engine, args.prompts, args.prompt_len, n, seed=6)
            row = {"variant": vname, "kernel_config": cfg.diff(), "adapters": n,
                   "tokens_per_s": timed["tokens_per_s"], "seconds": timed["seconds"]}
            print(f"{vname}: {args.dtype} prefill, {n} adapters: {timed['tokens_per_s']:.0f} tok/s "
                  f"({timed['seconds'] * 1e3:.0f} ms)", flush=True)
            if not args.no_profile:
                prof = profile_steps(
                    lambda: report.prefill_case(engine, args.prompts, args.prompt_len, n, seed=7), 1, device)
                row["profile"] = prof
                print(format_profile(prof, args.lines))
                busy = prof["total_us"] / 1e3
                print(f"{vname}, {n} adapters: the timed pass took {timed['seconds'] * 1e3:.1f} ms, its "
                      f"{prof['device']} {busy:.1f} ms ({busy / (timed['seconds'] * 1e3):.0%})"
                      + ("; the rest the GPU waited for the host (launches, Python, host-device syncs)"
                         if device.type == "cuda" else ""), flush=True)
                if n == 0:
                    base = prof
                elif base is not None:
                    row["tax"] = profile_tax(base, prof)
                    print(format_profile_tax(row["tax"], args.lines, f"LoRA tax by kernel, {n} adapters"))
            if args.host_profile:
                host_profile(lambda: report.prefill_case(engine, args.prompts, args.prompt_len, n, seed=8),
                             args.host_profile, f"{vname}, {n} adapters")
            rows.append(row)
    print("variant      adapters    tok/s   kept")
    for r in rows:
        b = next((q for q in rows if q["variant"] == r["variant"] and q["adapters"] == 0), None)
        kept = f"{r['tokens_per_s'] / b['tokens_per_s']:.1%}" if b else "-"
        print(f"{r['variant']:<12} {r['adapters']:8d} {r['tokens_per_s']:8.0f} {kept:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "profile-prefill", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "device": "cpu" if args.tiny else torch.cuda.get_device_name(), "commit": git_commit(), "dtype": args.dtype,
                       "prompts": args.prompts, "prompt_len": args.prompt_len, "rank": args.rank, "rows": rows,
                       "max_prefill_graph_tokens": engine.args.max_prefill_graph_tokens},
                      f, indent=1)


def host_profile(fn, lines: int, title: str) -> None:
    """fn() under cProfile: its functions by own host time (where a host-bound pass spends it), then by total."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(lines)
        text = out.getvalue()
        print(f"host profile, {title}, by {key}:\n" + text[text.find("ncalls"):], flush=True)


if __name__ == "__main__":
    main()
