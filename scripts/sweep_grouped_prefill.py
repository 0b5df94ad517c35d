"""The grouped routed-expert LoRA kernel at a prefill chunk (GPU): launch configs and block sizes, µs per call from
CUDA-graph replay beside the byte floor, at Qwen3-30B-A3B shapes (kernels/moe_lora/grouped_triton.py; what the
routed experts run above 2,048 pairs off the FP8 epilogue).

Cases: gate_up (x [T, 2048] -> delta [P, 2 x 768], two slices) and down (x [P, 768] -> delta [P, 2048], weighted by
the router); T tokens (8,192: the engine's prefill chunk), top-8 of 128 experts, adapters round-robin over the
tokens, rank 16; store mode into a bf16 delta (the engine's default delta dtype). floor = bytes / copy bandwidth,
bytes = x read once a slice + the delta written + the factors of the groups used. Every
variant's delta is checked against the default launch's (relative error). The alignment (moe_lora_align_fast at
the variant's block size) is timed on its own.

    python scripts/sweep_grouped_prefill.py [--tokens 8192] [--adapters 4] [--json out.json]
    TRITON_INTERPRET=1 python scripts/sweep_grouped_prefill.py --smoke   (CPU: the code path at 40 tokens, 2 variants)
"""

from __future__ import annotations

import argparse
import itertools
import json
from types import SimpleNamespace

import torch

from moelora_bench.common import graph_time_us, hbm_bandwidth_gbs
from moelora.kernels.moe_lora import grouped_triton as mg
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast
from moelora.kernels.moe_lora.grouped_triton import GroupedConfig, moe_lora_grouped

H, I, E, K = 2048, 768, 128, 8


def moe_inputs(site: str, T: int, n_ad: int, R: int, layers: int, ids: torch.Tensor, dev: str,
               dt: torch.dtype) -> SimpleNamespace:
    """One routed-expert projection's inputs at Qwen3-30B-A3B shapes: gate_up (x [T, H], two I-wide slices) or down
    (x [P, I] per pair, router weights w [P]); n_ad adapters round-robin over the T tokens, rank R, `layers` copies
    of the factors. Fields: slots, P, n, D, O, per_pair, x, w (None for
    gate_up), a [layers x [n, S, E, R, D]], b [layers x [S, E, O, R]], ranks, scaling, off."""
    S, P = n_ad, T * K
    c = SimpleNamespace(slots=(torch.arange(T) % n_ad).to(torch.int32).to(dev), P=P)
    if site == "gate_up":
        c.n, c.D, c.O, c.per_pair, outs = 2, H, 2 * I, False, [0, I, 2 * I]
        c.x, c.w = torch.randn(T, H, device=dev, dtype=dt), None
    else:
        c.n, c.D, c.O, c.per_pair, outs = 1, I, H, True, [0, H]
        c.x, c.w = torch.randn(P, I, device=dev, dtype=dt), torch.rand(P, device=dev)
    c.a = [torch.randn(c.n, S, E, R, c.D, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    c.b = [torch.randn(S, E, c.O, R, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    c.ranks = torch.full((c.n, S), R, dtype=torch.int32, device=dev)
    c.scaling = torch.ones(c.n, S, device=dev)
    c.off = torch.tensor(outs, dtype=torch.int32, device=dev)
    return c


def variants(site: str) -> list[tuple[int, GroupedConfig]]:
    """(block_m, config): the default first, then the grid."""
    out = [(mg.PREFILL_BLOCK_M, mg.PREFILL_CONFIG)]
    for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (3,)):
        v = (bm, GroupedConfig(128, bn, w, st))
        if v not in out:
            out.append(v)
    return out


def _key(bm: int, cfg: GroupedConfig) -> str:
    return f"m{bm}-d{cfg.block_d}-n{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"


def case(site: str, T: int, n_ad: int, R: int, layers: int, dev: str = "cuda"):
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(T * 7 + n_ad)
    S = n_ad
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
    c = moe_inputs(site, T, n_ad, R, layers, ids, dev, dt)
    slots, P, n, D, O, per_pair, x, w = c.slots, c.P, c.n, c.D, c.O, c.per_pair, c.x, c.w
    a, b, ranks, scaling, off = c.a, c.b, c.ranks, c.scaling, c.off
    delta = torch.empty(P, O, device=dev, dtype=dt)
    used = int((slots.long().repeat_interleave(K) * E + ids.reshape(-1)).unique().numel())
    aligns = {bm: moe_lora_align_fast(ids, slots, E, S, bm) for bm in (64, 128)}

    routing = Routing(ids, slots, E, S)

    def run(li, bm, cfg):
        moe_lora_grouped(x, ProjLoRA(a[li], b[li], off, ranks, scaling, O // n), routing, delta, x_per_pair=per_pair,
                         pair_weights=w, store=True, align=aligns[bm], config=cfg, block_m=bm)

    def nbytes() -> int:
        return used * (n * R * D + O * R) * 2 + n * P * D * 2 + P * O * 2

    return run, (lambda li, bm: moe_lora_align_fast(ids, slots, E, S, bm)), delta, nbytes, used, P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter: 40 tokens, two variants, no timing")
    args = ap.parse_args()
    timer = graph_time_us
    if args.smoke:
        args.tokens, timer = 40, (lambda fn, layers, iters: (fn(0), 1.0)[1])
    bw = 1.0 if args.smoke else hbm_bandwidth_gbs()
    print(f"HBM {bw:.0f} GB/s; bf16 delta, store mode; {args.tokens} tokens, {args.adapters} adapters, rank "
          f"{args.rank}; µs per call", flush=True)
    rows = []
    for site in ("gate_up", "down"):
        run, align, delta, nbytes, used, P = case(site, args.tokens, args.adapters, args.rank, args.layers,
                                                  "cpu" if args.smoke else "cuda")
        vs = variants(site)[:2] if args.smoke else variants(site)
        run(0, *vs[0])
        ref = delta.float().clone()
        t_align = {bm: timer(lambda li, bm=bm: align(li, bm), args.layers, args.iters) for bm in (64, 128)}
        sweep = {}
        for bm, cfg in vs:
            key = _key(bm, cfg)
            try:
                delta.fill_(float("nan"))
                run(0, bm, cfg)
                err = ((delta.float() - ref).norm() / ref.norm()).item()
                t = timer(lambda li, v=(bm, cfg): run(li, *v), args.layers, args.iters)
            except Exception as exc:  # a config that does not compile or launch (shared memory): reported, skipped
                print(f"  {site} {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            floor = nbytes() / (bw * 1e9) * 1e6
            sweep[key] = {"us": round(t, 1), "rel_err": err, "floor_us": round(floor, 1)}
            print(f"  {site:>7} {key:<28} {t:8.1f} µs  floor {floor:6.1f}  x{t / floor:4.2f}  err {err:.1e}", flush=True)
        ok = {k: v for k, v in sweep.items() if v["rel_err"] < 1e-2}
        best = min(ok, key=lambda k: ok[k]["us"])
        first = _key(*vs[0])
        print(f"{site}: default {first} {sweep[first]['us']} µs; best {best} {sweep[best]['us']} µs; align m64 "
              f"{t_align[64]:.1f} / m128 {t_align[128]:.1f} µs; pairs {P}, groups {used}", flush=True)
        rows.append({"site": site, "tokens": args.tokens, "adapters": args.adapters, "rank": args.rank, "pairs": P,
                     "groups": used, "align_us": {str(k): round(v, 1) for k, v in t_align.items()},
                     "default": first, "best": best, "variants": sweep})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
