"""Routed-expert LoRA at Qwen3-30B-A3B decode shapes (GPU): the per-pair fused kernel against the grouped kernel
((slot, expert) groups, kernels/moe_lora/grouped_triton.py) over launch configs, µs per call from CUDA-graph
replay beside the byte floor. Both in store mode (the side-stream path the engine runs); the grouped kernel's
alignment (one a layer, shared by gate_up and down) timed on its own.

Cases: gate_up (x [T, 2048] -> [P, 2 x 768], two slices) and down (x [P, 768] -> [P, 2048]); T tokens, top-8 of
128 experts without repeats; adapters round-robin over the tokens; rank 16 (and --ranks). floor = bytes / copy
bandwidth, bytes = the factors of the (slot, expert) groups the batch uses + x + the fp32 delta written. Several
layers' factors in rotation so L2 does not hold them between calls. Every config's delta is checked against
the per-pair kernel's (relative error, must stay ~1e-3 or below).

    python scripts/sweep_moe_lora_grouped.py [--tokens 64,256] [--adapters 4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from moelora_bench.common import graph_time_us, hbm_bandwidth_gbs
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused
from moelora.kernels.moe_lora.grouped_triton import GroupedConfig, grouped_align, moe_lora_grouped

H, I, E, K = 2048, 768, 128, 8
CONFIGS = [GroupedConfig(bd, bn, w, st) for bd, bn, w, st in itertools.product(
    (128, 256), (128, 256), (4, 8), (3, 4))]


def _key(cfg: GroupedConfig) -> str:
    return f"d{cfg.block_d}-n{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"


def case(site: str, T: int, n_ad: int, R: int, layers: int):
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(T * 131 + n_ad)
    S = n_ad
    slots = (torch.arange(T) % n_ad).to(torch.int32).to(dev)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    P = T * K
    if site == "gate_up":
        n, D, O, per_pair, outs = 2, H, 2 * I, False, [0, I, 2 * I]
        x = torch.randn(T, H, device=dev, dtype=dt)
    else:
        n, D, O, per_pair, outs = 1, I, H, True, [0, H]
        x = torch.randn(P, I, device=dev, dtype=dt)
    a = [torch.randn(n, S, E, R, D, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    b = [torch.randn(S, E, O, R, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    ranks = torch.full((n, S), R, dtype=torch.int32, device=dev)
    scaling = torch.ones(n, S, device=dev)
    off = torch.tensor(outs, dtype=torch.int32, device=dev)
    delta = torch.empty(P, O, device=dev, dtype=torch.float32)
    align = grouped_align(ids, slots, E, S)
    used = int((slots.long().repeat_interleave(K) * E + ids.reshape(-1)).unique().numel())
    nbytes = used * (n * R * D + O * R) * 2 + x.numel() * 2 + P * O * 4

    routing = Routing(ids, slots, E, S)

    def lora(li):
        return ProjLoRA(a[li], b[li], off, ranks, scaling, O // n)

    def per_pair_fn(li):
        moe_lora_fused(x, lora(li), routing, delta, x_per_pair=per_pair, store=True)

    def grouped_fn(li, cfg=None):
        moe_lora_grouped(x, lora(li), routing, delta, x_per_pair=per_pair, store=True, align=align, config=cfg)

    def align_fn(li):
        grouped_align(ids, slots, E, S)

    return per_pair_fn, grouped_fn, align_fn, delta, nbytes, used, P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,128,256")
    ap.add_argument("--adapters", default="4,8")
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--best-out", default=None, help="write the config with the least total time over all cases "
                    "(block_d,block_n,num_warps,num_stages: grouped_triton.GROUPED_CONFIG's fields)")
    args = ap.parse_args()
    bw = hbm_bandwidth_gbs()
    print(f"HBM {bw:.0f} GB/s; bf16; store mode; {args.layers} layers in rotation; µs per call", flush=True)
    rows = []
    for R, n_ad, T, site in itertools.product([int(r) for r in args.ranks.split(",")],
                                              [int(a) for a in args.adapters.split(",")],
                                              [int(t) for t in args.tokens.split(",")], ("gate_up", "down")):
        pp, grp, al, delta, nbytes, used, P = case(site, T, n_ad, R, args.layers)
        pp(0)
        ref = delta.clone()
        t_pp = graph_time_us(pp, args.layers)
        t_align = graph_time_us(al, args.layers)
        floor = nbytes / (bw * 1e9) * 1e6
        best, sweep = None, {}
        for cfg in CONFIGS:
            delta.fill_(float("nan"))
            grp(0, cfg)
            err = ((delta - ref).norm() / ref.norm()).item()
            t = graph_time_us(lambda li, cfg=cfg: grp(li, cfg), args.layers)
            sweep[_key(cfg)] = {"us": round(t, 2), "rel_err": err}
            if err < 1e-2 and (best is None or t < best[1]):
                best = (_key(cfg), t)
        print(f"{site:>7} T {T:4d} ad {n_ad} R {R:3d} | per-pair {t_pp:7.1f} | grouped best {best[1]:7.1f} ({best[0]}) "
              f"+ align {t_align:5.1f} | floor {floor:6.1f} | pairs {P} groups {used}", flush=True)
        rows.append({"site": site, "tokens": T, "adapters": n_ad, "rank": R, "pairs": P, "groups": used,
                     "per_pair_us": round(t_pp, 2), "align_us": round(t_align, 2), "floor_us": round(floor, 2),
                     "grouped_best": best[0], "grouped_best_us": round(best[1], 2), "grouped": sweep})
    big = [r for r in rows if r["tokens"] >= 128] or rows  # where the grouped kernel would run
    totals = {k: sum(r["grouped"][k]["us"] for r in big) for k in big[0]["grouped"]} if big else {}
    if totals:
        key = min(totals, key=totals.get)
        cfg = next(c for c in CONFIGS if _key(c) == key)
        print(f"least total (>= 128 tokens): {key} {totals[key]:.1f} µs over {len(big)} cases; "
              f"per-pair {sum(r['per_pair_us'] for r in big):.1f}", flush=True)
        if args.best_out:
            with open(args.best_out, "w") as f:
                f.write(f"{cfg.block_d},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
