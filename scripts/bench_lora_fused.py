"""Time the fused decode LoRA kernels against the current path, µs per call from CUDA-graph replay.

Cases (Qwen3-30B-A3B, bf16): routed-expert gate_up (H 2048 -> 2 x 768, own A per slice) and down (768 -> 2048,
router weight), dense qkv (2048 -> 4096 + 512 + 512) and o_proj (4096 -> 2048); T = 1, 16, 64, 128 tokens
(top-8: P = 8 ... 1024 pairs); 4 and 8 adapters (tokens round-robin); rank 16 and 64.
current: what fused_moe_pairs' project() / apply_dense_lora run today (MoE: h.zero_, shrink, expand; dense: shrink
into split-K partials, expand);
fused: moe_lora_fused / lora_fused_decode (1 launch); store: the fused kernel in store mode into an fp32 delta
(the side-stream variant). floor: bytes / measured HBM bandwidth, bytes = the factors of the (slot, expert) pairs
(MoE) or slots (dense) the batch uses + x read + y read and written (the fused path has no h traffic).
Several layers' weights in rotation (--layers) so L2 does not hold a layer's factors between calls.

Usage: python scripts/bench_lora_fused.py [--tokens 1,16,64,128] [--adapters 4,8] [--ranks 16,64] [--sweep]
--sweep: also the fused kernels at num_warps 4/8/16 x split_n 1/2/4/8/16 (to tune fused_num_warps and
FUSED_TARGET_PROGRAMS); --stages 1,2,3,4: the MoE store-mode kernel with its shrink loop pipelined that deep
(set_fused_lora_stages, session 16); --cases gate_up,down,qkv,o
(Session 7 swept a grouped (slot, expert) kernel here too: slower than the per-pair kernel in all 36 of its
launch configurations for gate_up and down at 64 and 256 tokens, so it was removed;
bench/results/gpu-session7-2026-11-30-NVIDIA-H200.log.)
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from moelora.bench.common import graph_time_us, hbm_bandwidth_gbs
from moelora.kernels.groups import SlotGroups
from moelora.kernels.lora_fused_triton import lora_fused_decode
from moelora.kernels.lora_triton import lora_expand, lora_shrink, lora_shrink_buffer
from moelora.kernels.moe_lora_fused_triton import moe_lora_fused
from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink

H, I, E, K = 2048, 768, 128, 8
EL = 2  # bf16


def moe_inputs(site: str, T: int, n_ad: int, R: int, layers: int, ids: torch.Tensor, dev: str,
               dt: torch.dtype) -> SimpleNamespace:
    """One routed-expert projection's inputs at Qwen3-30B-A3B shapes (also scripts/sweep_grouped_prefill.py): gate_up
    (x [T, H], two I-wide slices) or down (x [P, I] per pair, router weights w [P]); n_ad adapters round-robin over
    the T tokens, rank R, `layers` copies of the factors. Fields: slots, P, n, D, O, per_pair, x, w (None for
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


def moe_case(site: str, T: int, n_ad: int, R: int, layers: int):
    """(current(li), fused(li, split_n), store(li), check() -> rel err, bytes) for one routed-expert projection."""
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(T * 131 + n_ad)
    S = n_ad
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    c = moe_inputs(site, T, n_ad, R, layers, ids, dev, dt)
    slots, P, n, D, O, per_pair, x, wts = c.slots, c.P, c.n, c.D, c.O, c.per_pair, c.x, c.w
    a, b, ranks, scaling, off = c.a, c.b, c.ranks, c.scaling, c.off
    y = torch.randn(P, O, device=dev, dtype=dt)
    delta = torch.empty(P, O, device=dev, dtype=torch.float32)
    h = torch.empty(P, n, R, device=dev, dtype=torch.float32)

    def current(li):  # fused_moe_pairs' project(), switch off
        h.zero_()
        align = moe_lora_plan(ids, slots, E, S)
        moe_lora_shrink(x, a[li], ranks, ids, slots, E, h, per_pair, align=align)
        moe_lora_expand(h, b[li], off, ranks, scaling, ids, slots, E, y, wts, align=align)

    def fused(li, split_n=None, num_warps=None):
        moe_lora_fused(x, a[li], b[li], off, ranks, scaling, ids, slots, E, y, per_pair, wts, split_n=split_n,
                       num_warps=num_warps)

    def store(li, split_n=None, num_warps=None):
        moe_lora_fused(x, a[li], b[li], off, ranks, scaling, ids, slots, E, delta, per_pair, wts, store=True,
                       split_n=split_n, num_warps=num_warps)

    def check() -> float:
        y0 = y.clone()
        current(0)
        d_cur = (y.float() - y0.float())
        y.copy_(y0)
        store(0)
        return ((delta - d_cur).norm() / d_cur.norm()).item()

    used = int((slots.long().repeat_interleave(K) * E + ids.reshape(-1)).unique().numel())
    nbytes = used * (n * R * D + O * R) * EL + x.numel() * EL + 2 * P * O * EL
    return current, fused, store, check, nbytes, f"pairs={P} slot_expert={used}"


def dense_case(site: str, T: int, n_ad: int, R: int, layers: int):
    dev, dt = "cuda", torch.bfloat16
    S = n_ad
    slots = (torch.arange(T) % n_ad).to(torch.int32)
    groups = SlotGroups.build(slots, S, dev)
    D, outs = (H, [4096, 512, 512]) if site == "qkv" else (4096, [H])
    n, O = len(outs), sum(outs)
    off_l = [0]
    for o in outs:
        off_l.append(off_l[-1] + o)
    a = [torch.randn(n, S, R, D, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    b = [torch.randn(S, O, R, device=dev, dtype=dt) * 0.05 for _ in range(layers)]
    ranks = torch.full((n, S), R, dtype=torch.int32, device=dev)
    scaling = torch.ones(n, S, device=dev)
    off = torch.tensor(off_l, dtype=torch.int32, device=dev)
    x = torch.randn(T, D, device=dev, dtype=dt)
    y = torch.randn(T, O, device=dev, dtype=dt)
    delta = torch.empty(T, O, device=dev, dtype=torch.float32)
    h = lora_shrink_buffer(n, T, R, D, dev)  # split-K partials, as apply_dense_lora's buffer

    def current(li):  # apply_dense_lora in a graph (no single-slot cuBLAS path), switch off
        lora_shrink(x, a[li], ranks, groups, h)
        lora_expand(h, b[li], off, ranks, scaling, groups, y)

    def fused(li, split_n=None, num_warps=None):
        lora_fused_decode(x, a[li], b[li], off, ranks, scaling, groups, y, max_width=max(outs), split_n=split_n,
                          num_warps=num_warps or 4)

    def store(li):
        lora_fused_decode(x, a[li], b[li], off, ranks, scaling, groups, delta, store=True, max_width=max(outs))

    def check() -> float:
        y0 = y.clone()
        current(0)
        d_cur = (y.float() - y0.float())
        y.copy_(y0)
        store(0)
        return ((delta - d_cur).norm() / d_cur.norm()).item()

    used = len(groups.slot_ids)
    nbytes = used * n * R * D * EL + used * O * R * EL + T * D * EL + 2 * T * O * EL
    return current, fused, store, check, nbytes, f"D={D} outs={outs}"


def sweep_tiles(store, layers: int, t_default: float) -> None:
    """Time store(li, split_n, num_warps) over launch shapes and loop pipelining; print each and the best."""
    from moelora.kernels import moe_lora_fused_triton as mf

    keep = (mf._D_STAGES[0], mf._E_STAGES[0])
    res = {}
    try:
        for d_st, e_st in ((1, 1), (3, 1), (1, 3), (3, 3)):
            mf.set_fused_lora_stages(d_st, e_st)
            for w in (4, 8):
                for sp in (1, 2):
                    try:
                        res[(w, sp, d_st, e_st)] = graph_time_us(lambda li, sp=sp, w=w: store(li, sp, w), layers)
                    except Exception as e:  # noqa: BLE001 (e.g. out of shared memory: reported, skipped)
                        print(f"         w{w} split{sp} st{d_st}/{e_st}: {type(e).__name__}", flush=True)
    finally:
        mf.set_fused_lora_stages(*keep)
    items = sorted(res.items(), key=lambda kv: kv[1])
    print("         (warps, split_n, d_stages, e_stages): " +
          "  ".join(f"{k}: {v:.1f}" for k, v in items), flush=True)
    best = items[0]
    print(f"         best {best[0]} {best[1]:.1f} against the default's {t_default:.1f} µs", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,128")
    ap.add_argument("--adapters", default="4,8")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--cases", default="gate_up,down,qkv,o")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tiles", action="store_true",
                    help="the MoE store-mode kernel over warps 4/8 x split_n 1/2 x (shrink, expand) loop stages (1,1) "
                    "(3,1) (1,3) (3,3) (session 17; its sweep also had 2x wider tiles, which lost everywhere)")
    ap.add_argument("--stages", default="", help="also the MoE store-mode kernel with its shrink loop pipelined "
                    "this deep, e.g. 1,2,3,4 (set_fused_lora_stages)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = hbm_bandwidth_gbs()
    print(f"HBM {bw:.0f} GB/s measured; bf16; {args.layers} layers in rotation; CUDA-graph replay; µs per call")
    print(f"{'case':>8} {'T':>4} {'ad':>3} {'R':>3} | {'current':>8} {'fused':>8} {'store':>8} "
          f"{'floor':>7} | {'speedup':>7} {'rel err':>9} | info")
    for R in (int(r) for r in args.ranks.split(",")):
        for n_ad in (int(a) for a in args.adapters.split(",")):
            for T in (int(t) for t in args.tokens.split(",")):
                for case in args.cases.split(","):
                    make = moe_case if case in ("gate_up", "down") else dense_case
                    current, fused, store, check, nbytes, info = make(case, T, n_ad, R, args.layers)
                    err = check()
                    t_cur = graph_time_us(current, args.layers)
                    t_fused = graph_time_us(fused, args.layers)
                    t_store = graph_time_us(store, args.layers)
                    floor = nbytes / (bw * 1e9) * 1e6
                    print(f"{case:>8} {T:4d} {n_ad:3d} {R:3d} | {t_cur:8.1f} {t_fused:8.1f} {t_store:8.1f} "
                          f"{floor:7.1f} | {t_cur / t_fused:6.2f}x {err:9.2e} | {info}", flush=True)
                    if args.stages and make is moe_case:
                        from moelora.kernels.moe_lora_fused_triton import _D_STAGES, set_fused_lora_stages

                        keep = _D_STAGES[0]
                        st = {}
                        try:
                            for n in (int(v) for v in args.stages.split(",")):
                                set_fused_lora_stages(n)
                                st[n] = graph_time_us(store, args.layers)
                        finally:
                            set_fused_lora_stages(keep)
                        print("         store, stages: " + "  ".join(f"{n}: {t:.1f}" for n, t in st.items()), flush=True)
                    if args.sweep_tiles and make is moe_case:
                        sweep_tiles(store, args.layers, t_store)
                    if args.sweep:
                        for w in (4, 8, 16):
                            sw = {s: graph_time_us(lambda li, s=s, w=w: fused(li, s, w), args.layers)
                                  for s in (1, 2, 4, 8, 16)}
                            print(f"         warps {w:2d} split_n: " + "  ".join(f"{s}: {t:.1f}" for s, t in sw.items()),
                                  flush=True)
                    current = fused = store = check = None  # free this case before the next
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
