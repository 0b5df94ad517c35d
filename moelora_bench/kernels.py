"""`moelora bench kernels`: each multi-LoRA kernel at real shapes against its byte floor, a torch loop
over adapters, and the base layer's own GEMM.

Cases: a dense 4096-wide layer, and Qwen3-30B-A3B's routed experts (H 2048, I 768, E 128, top-8) for
gate_up and down; 1/16/64/256 tokens; 1/4/8/32 adapters (tokens spread round-robin over the adapters);
rank 16 and 64; bf16. time_ms is the CUDA-graph replay time (GPU work only, as decode runs it),
eager_ms the same launches from Python. The MoE cases take the layer's backend for their number of pairs
(MoELoRAKernels.pick: the per-pair fused kernel, or the grouped one from moe_lora.grouped_min_pairs; "path").
Bytes = every input read once and every output written once: x, the A and B factors of the slots (dense) or of the
(slot, expert) pairs (MoE) that some token uses, the dense h, and y.
"""

from __future__ import annotations

import torch

from moelora_bench.common import captured_graph, hbm_bandwidth_gbs, time_ms, write_result
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.shrink_expand_triton import lora_expand, lora_shrink, lora_shrink_buffer
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.backend import MoELoRAKernels

TOKENS = (1, 16, 64, 256)
ADAPTERS = (1, 4, 8, 32)
RANKS = (16, 64)
EL = 2  # bf16 bytes


def _dense_case(T: int, n_ad: int, R: int, H: int = 4096, O: int = 4096) -> dict:
    dev, dt = "cuda", torch.bfloat16
    S = n_ad
    slots = (torch.arange(T) % n_ad).to(torch.int32)
    groups = SlotGroups.build(slots, S, dev)
    a = torch.randn(1, S, R, H, device=dev, dtype=dt) * 0.01
    b = torch.randn(S, O, R, device=dev, dtype=dt) * 0.01
    ranks = torch.full((1, S), R, dtype=torch.int32, device=dev)
    scaling = torch.ones(1, S, device=dev)
    off = torch.tensor([0, O], dtype=torch.int32, device=dev)
    x = torch.randn(T, H, device=dev, dtype=dt)
    y = torch.randn(T, O, device=dev, dtype=dt)
    w = torch.randn(O, H, device=dev, dtype=dt) * 0.01
    h = lora_shrink_buffer(1, T, R, H, dev)

    def kernels():
        lora_shrink(x, a, ranks, groups, h)
        lora_expand(h, b, off, ranks, scaling, groups, y)

    used = len(groups.slot_ids)
    nbytes = used * (R * H + O * R) * EL + T * H * EL + 2 * T * O * EL + 2 * T * R * 4
    slot_rows = [(s, (slots == s).nonzero().squeeze(1).to(dev)) for s in groups.slot_ids]

    def torch_loop():
        for s, rows in slot_rows:
            y.index_add_(0, rows, (x[rows] @ a[0, s].T) @ b[s].T)

    return _record("dense", T, n_ad, R, nbytes, kernels, torch_loop, lambda: x @ w.T, {"H": H, "O": O})


def _moe_case(site: str, T: int, n_ad: int, R: int, H: int = 2048, inter: int = 768, E: int = 128, K: int = 8) -> dict:
    dev, dt = "cuda", torch.bfloat16
    S = n_ad
    gen = torch.Generator().manual_seed(T * 131 + n_ad)
    slots = (torch.arange(T) % n_ad).to(torch.int32).to(dev)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    if site == "gate_up":
        n, D, O, per_pair = 2, H, 2 * inter, False
        x = torch.randn(T, H, device=dev, dtype=dt)
    else:
        n, D, O, per_pair = 1, inter, H, True
        x = torch.randn(T * K, inter, device=dev, dtype=dt)
    a = torch.randn(n, S, E, R, D, device=dev, dtype=dt) * 0.01
    b = torch.randn(S, E, O, R, device=dev, dtype=dt) * 0.01
    ranks = torch.full((n, S), R, dtype=torch.int32, device=dev)
    scaling = torch.ones(n, S, device=dev)
    off = torch.tensor([0, inter, 2 * inter] if n == 2 else [0, H], dtype=torch.int32, device=dev)
    y = torch.randn(T * K, O, device=dev, dtype=dt)
    lora = ProjLoRA(a, b, off, ranks, scaling, O // n)
    routing = Routing(ids, slots, E, S)
    path = type(MoELoRAKernels(triton=True).pick(routing)).__name__  # the layer's backend for this many pairs

    def kernels():  # as the MoE layer runs them: the backend of this call (a grouped one aligns the pairs first)
        MoELoRAKernels(triton=True).pick(routing).delta(x, lora, routing, y, x_per_pair=per_pair, store=False)

    pair_v = (slots.long().repeat_interleave(K) * E + ids.reshape(-1)).unique()
    used = int(pair_v.numel())  # (slot, expert) pairs some token uses
    rows_in = T if not per_pair else T * K
    nbytes = used * (n * R * D + O * R) * EL + rows_in * D * EL + 2 * T * K * O * EL  # h stays in registers
    pair_slot = slots.long().repeat_interleave(K)
    pair_exp = ids.reshape(-1)
    per_slot = [(s, (pair_slot == s).nonzero().squeeze(1)) for s in range(n_ad)]

    def torch_loop():  # per adapter: gather each pair's factors, batched matmuls
        for s, p in per_slot:
            e = pair_exp[p]
            xin = x[p] if per_pair else x[p // K]
            for i in range(n):
                hh = torch.bmm(a[i, s, e], xin[:, :, None])  # [m, R, 1]
                o0, o1 = (i * inter, (i + 1) * inter) if n == 2 else (0, H)
                y[p, o0:o1] += torch.bmm(b[s, e, o0:o1], hh)[:, :, 0]

    w_base = torch.randn(E, O, D, device=dev, dtype=dt) * 0.01
    touched = ids.reshape(-1).unique()
    xin_base = x if per_pair else x.repeat_interleave(K, 0)

    def base():  # the base expert GEMMs of this layer for these tokens, grouped (torch._grouped_mm) or looped
        if hasattr(torch, "_grouped_mm"):
            order = torch.argsort(pair_exp)
            counts = torch.bincount(pair_exp, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            return torch._grouped_mm(xin_base[order].contiguous(), w_base.transpose(1, 2), offs=offs)
        for e in touched.tolist():
            xin_base[pair_exp == e] @ w_base[e].T

    return _record(f"moe_{site}", T, n_ad, R, nbytes, kernels, torch_loop, base,
                   {"H": H, "I": inter, "E": E, "top_k": K, "slot_expert_pairs": used,
                    "path": path})


def _graph_time_ms(fn) -> float:
    """Time of fn's kernels replayed from a CUDA graph: the GPU cost without Python launch overhead
    (how the engine runs them in decode)."""
    graph, _ = captured_graph(fn)
    return time_ms(graph.replay)


def _record(kind, T, n_ad, R, nbytes, kernels, torch_loop, base, extra) -> dict:
    kernels()
    torch.cuda.synchronize()
    t_eager = time_ms(kernels)
    t = _graph_time_ms(kernels)
    t_loop = time_ms(torch_loop, rep=20)
    try:
        t_base = time_ms(base)
    except RuntimeError as e:  # e.g. a grouped GEMM this torch build does not have
        t_base, extra = None, {**extra, "base_error": str(e)[:200]}
    return {"case": kind, "tokens": T, "adapters": n_ad, "rank": R, "time_ms": t, "eager_ms": t_eager, "bytes": nbytes,
            "torch_loop_ms": t_loop, "base_gemm_ms": t_base, **extra}


def run(quick: bool = False, out_dir: str = "bench/results") -> str:
    if not torch.cuda.is_available():
        raise SystemExit("moelora bench kernels needs a CUDA GPU (the kernels are Triton kernels)")
    bw = hbm_bandwidth_gbs()
    rows = []
    tokens, adapters, ranks = ((1, 64), (1, 8), (16,)) if quick else (TOKENS, ADAPTERS, RANKS)
    for R in ranks:
        for n_ad in adapters:
            for T in tokens:
                for fn in (_dense_case, lambda *a: _moe_case("gate_up", *a), lambda *a: _moe_case("down", *a)):
                    r = fn(T, n_ad, R)
                    r["achieved_gbs"] = r["bytes"] / (r["time_ms"] * 1e-3) / 1e9
                    r["share_of_hbm"] = r["achieved_gbs"] / bw
                    r["floor_ms"] = r["bytes"] / (bw * 1e9) * 1e3
                    r["speedup_vs_torch_loop"] = r["torch_loop_ms"] / r["time_ms"]
                    rows.append(r)
                    write_result("kernels", {"hbm_gbs": bw, "rows": rows}, out_dir)  # a cut-off run keeps its rows
                    base_us = "-" if r["base_gemm_ms"] is None else f"{r['base_gemm_ms'] * 1e3:.1f} us"
                    print(f"{r['case']:12s} T={T:4d} adapters={n_ad:3d} r={R:3d}  graph {r['time_ms'] * 1e3:7.1f} us "
                          f"eager {r['eager_ms'] * 1e3:7.1f} us  "
                          f"floor {r['floor_ms'] * 1e3:7.1f} us  {100 * r['share_of_hbm']:5.1f}% HBM  "
                          f"loop {r['torch_loop_ms'] * 1e3:8.1f} us ({r['speedup_vs_torch_loop']:5.1f}x)  base {base_us}",
                          flush=True)
    return write_result("kernels", {"hbm_gbs": bw, "rows": rows}, out_dir)
