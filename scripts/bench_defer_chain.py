"""The deferred dense LoRA chain beside its base GEMM (GPU), µs per call from CUDA-graph replay, at Qwen3-30B-A3B's
qkv (2048 -> 4096 + 512 + 512) and o_proj (4096 -> 2048), fp8 base, rank 16, max_loras 8, tokens round-robin over
the adapters, x prequantized as the decode step's producers leave it:
  gemm      the plain base GEMM alone (what the no-adapter step runs)
  chain     the chain alone on the current stream (lora_shrink with the deferred splits and K tile, lora_delta)
  <variant> LoRALinear.forward_deferred (chain on the side stream beside the GEMM, then the join) with the --ab style
            switches of the variant applied (bench/switches.py); "default" applies none, "serial" is the chain
            then the GEMM on one stream
Why (sessions 24-27): beside the chain the qkv / o_proj GEMMs take ~14 µs instead of 8.4 / 9.5, and every launch
experiment so far was measured only end to end; this one times the part itself, many variants in one process.
(The variants are measured against the defaults of the commit they run at: since session 28 the delta kernel runs
8 warps and o_proj's shrink splits 8 ways, so "dw8" and "kps512" are the default there.)

    python scripts/bench_defer_chain.py [--tokens 64] [--adapters 4,8] [--json out.json]
        [--variants "name:ENV=V,ENV=V;..."]   (default: the list below) [--gemm-too] [--parts]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.bench import switches
from moelora.bench.common import git_commit, graph_time_us
from moelora.kernels.fp8_triton import attach_act_quant, quantize_act_group
from moelora.kernels.lora_delta_triton import lora_delta
from moelora.kernels.lora_triton import lora_shrink
from moelora.kernels.streams import fork, join, side_stream
from moelora.layers.linear import DEFER_DELTA_WARPS, DEFER_SHRINK_BLOCK_K, dense_lora_h, defer_shrink_max_splits

from bench_fp8_lora_epilogue import MAX_LORAS, SHAPES, build  # noqa: E402  (scripts/ on sys.path when run as a script)

VARIANTS = ("default:;serial:MOELORA_DENSE_DEFER_ORDER=serial;"
            "sw1:MOELORA_LORA_SHRINK_WARPS=1;sw2:MOELORA_LORA_SHRINK_WARPS=2;sw8:MOELORA_LORA_SHRINK_WARPS=8;"
            "dw1:MOELORA_LORA_DELTA_WARPS=1;dw2:MOELORA_LORA_DELTA_WARPS=2;dw8:MOELORA_LORA_DELTA_WARPS=8;"
            "s2:MOELORA_LORA_SHRINK_SPLITS=2;s8:MOELORA_LORA_SHRINK_SPLITS=8;kps512:MOELORA_DENSE_DEFER_K_PER_SPLIT=512;"
            "bk64:MOELORA_LORA_SHRINK_BLOCK_K=64;bk256:MOELORA_LORA_SHRINK_BLOCK_K=256;"
            "t64x128:MOELORA_LORA_DELTA_TILE=64x128;"
            "qkvt:MOELORA_LORA_DELTA_TILE=64x128,MOELORA_LORA_DELTA_TILE_MIN_O=4096;"
            "sw2dw2:MOELORA_LORA_SHRINK_WARPS=2,MOELORA_LORA_DELTA_WARPS=2")


PARTS = ("forkjoin", "b.shrink", "b.delta")


def beside(side_fn, li: int, main_fn) -> None:
    """side_fn(li) on the side stream beside main_fn() on the current stream, forked and joined as
    LoRALinear.forward_deferred does (the side work issued first)."""
    side = side_stream(torch.device("cuda"))
    main = fork(side)
    with torch.cuda.stream(side):
        side_fn(li)
    main_fn()
    join(main, side)


def parse_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, body = part.partition(":")
        env = dict(kv.split("=", 1) for kv in filter(None, body.split(",")))
        unknown = [k for k in env if k not in switches.SWITCHES]
        if unknown:
            raise SystemExit(f"variant {name}: {unknown} are not --ab switches (moelora/bench/switches.py)")
        out.append((name, env))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--adapters", default="4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", action="store_true",
                    help="also time the GEMM beside parts of the chain on the side stream: 'forkjoin' (a one-element "
                         "add: the fork / join alone), 'b.shrink' (the shrink alone), 'b.delta' (the delta kernel alone)")
    ap.add_argument("--gemm-too", action="store_true",
                    help="also time each variant's base GEMM alone (column <variant>.gemm), at the launch "
                         "forward_deferred gives it (LoRALinear.deferred_base): for switches of the GEMM")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    variant_cols = [c for n, _ in variants for c in ([n, n + ".gemm"] if args.gemm_too else [n])]
    cols = ["gemm", "chain"] + (list(PARTS) if args.parts else []) + variant_cols
    print(f"{'case':>4} {'T':>4} {'ad':>3} | " + " ".join(f"{c:>10}" for c in cols) + "  (µs per call)", flush=True)
    for name in SHAPES:
        mods = build(name, args.layers, g)
        D = SHAPES[name][0]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
            attach_act_quant(x, *quantize_act_group(x, 128), 128)
            for n_ad in (int(a) for a in args.adapters.split(",")):
                batch = LoRABatch.build([t % n_ad for t in range(T)], MAX_LORAS, "cuda")
                if not mods[0].defer_ok(x, batch):
                    raise SystemExit(f"{name}: forward_deferred would not defer at {T} tokens, {n_ad} adapters")
                hs = [dense_lora_h(m.lora, x, defer_shrink_max_splits(D)) for m in mods]
                deltas = [torch.empty(T, sum(m.out_features), dtype=x.dtype, device="cuda") for m in mods]

                def shrink(li: int) -> None:
                    w = mods[li].lora
                    lora_shrink(x, w.a, w.rank_tensor, batch.groups, hs[li], block_k=DEFER_SHRINK_BLOCK_K)

                def delta(li: int) -> None:
                    w = mods[li].lora
                    lora_delta(hs[li], w.b_cat, w.slice_offsets, tuple(w.slice_offsets_host), w.rank_tensor,
                               w.scaling, batch.groups.token_slots, batch.groups.active_slots, deltas[li],
                               num_warps=DEFER_DELTA_WARPS)

                def chain(li: int) -> None:
                    shrink(li)
                    delta(li)

                row = {"case": name, "tokens": T, "adapters": n_ad,
                       "gemm": graph_time_us(lambda li: mods[li].base(x), args.layers),
                       "chain": graph_time_us(chain, args.layers)}
                if args.parts:
                    one = torch.zeros(1, device="cuda")
                    for part, fn in (("forkjoin", lambda li: one.add_(1)), ("b.shrink", shrink), ("b.delta", delta)):
                        row[part] = graph_time_us(lambda li, fn=fn: beside(fn, li, lambda: mods[li].base(x)),
                                                  args.layers)
                for vname, env in variants:
                    before = switches.current(list(env))
                    switches.apply(env)
                    try:
                        row[vname] = graph_time_us(lambda li: mods[li].forward_deferred(x, batch), args.layers)
                        if args.gemm_too:
                            row[vname + ".gemm"] = graph_time_us(lambda li: mods[li].deferred_base(x), args.layers)
                    finally:
                        switches.apply(before)
                rows.append(row)
                print(f"{name:>4} {T:>4} {n_ad:>3} | " + " ".join(f"{row[c]:10.1f}" for c in cols), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "commit": git_commit(), "variants": dict(variants), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
