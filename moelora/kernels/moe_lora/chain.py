"""Routed-expert multi-LoRA over (token, k) pairs, pair p = t * K + k: the shrink and expand references (the
semantics of every kernel in this package, composed by fused_triton.moe_lora_fused_ref), and the alignment of pairs
by virtual expert slot * E + e (reference; chain_triton.moe_lora_align_fast on the GPU).

gate_up: h = shrink(x[t]) with A[i, slot, e] per slice (gate, up); gu[p] += scaling * B h  (before the activation)
down:    h = shrink(act[p]) with A[0, slot, e];                    o[p]  += w[p] * scaling * B h (router weight)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moelora.kernels.moe_lora.args import ProjLoRA, Routing


def moe_lora_shrink_ref(x: torch.Tensor, lora: ProjLoRA, routing: Routing, out: torch.Tensor, *,
                        x_per_pair: bool) -> None:
    """Semantics (a, ranks of lora; topk_ids, token_slots of routing):
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            if s >= 0 and e >= 0: for i: r = ranks[i, s]; out[p, i, :r] = row @ a[i, s, e (0 if shared), :r].T
                       with row = x[p] if x_per_pair else x[t]          (other entries untouched)
    x: [T, D] or [T*K, D] · out: [T*K, n, R] fp32
    """
    a, K = lora.a, routing.topk_ids.shape[1]
    rk = lora.ranks.tolist()
    shared = a.shape[2] == 1
    for s, e, pairs in _slot_expert_groups(routing):
        rows = x[pairs] if x_per_pair else x[pairs // K]
        for i in range(a.shape[0]):
            r = rk[i][s]
            if r:
                # fp32 products, like the kernels' fp32 accumulation (bf16 matmul output would round h)
                out[pairs, i, :r] = rows.float() @ a[i, s, 0 if shared else e, :r].float().T


def moe_lora_expand_ref(h: torch.Tensor, lora: ProjLoRA, routing: Routing, y: torch.Tensor, *,
                        pair_weights: torch.Tensor | None = None) -> None:
    """Semantics (b_cat = lora.b; slice i owns columns o_i = offsets[i]:offsets[i+1]):
        for p in range(T * K): e, s = topk_ids.flatten()[p], token_slots[p // K]
            if s >= 0 and e >= 0: for i with r = ranks[i, s] > 0:
                y[p, o_i] += w[p] * scaling[i, s] * h[p, i, :r] @ b_cat[s, e (0 if shared), o_i, :r].T
        w = pair_weights (the router weights, [T*K]) or 1
    h: [T*K, n, R] fp32 · y: [T*K, O] updated in place
    """
    b_cat, scaling = lora.b, lora.scaling
    rk, off = lora.ranks.tolist(), lora.offsets.tolist()
    shared = b_cat.shape[1] == 1
    for s, e, pairs in _slot_expert_groups(routing):
        for i in range(len(off) - 1):
            r = rk[i][s]
            if not r:
                continue
            bm = b_cat[s, 0 if shared else e, off[i] : off[i + 1], :r].float()  # [O_i, r]
            delta = (h[pairs, i, :r] @ bm.T) * scaling[i, s]
            if pair_weights is not None:
                delta = delta * pair_weights[pairs, None].float()
            y[pairs, off[i] : off[i + 1]] += delta.to(y.dtype)


def _slot_expert_groups(routing: Routing) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(slot s >= 0, expert e >= 0, the pair ids [m] int64 of that slot and expert) for every group present. Pairs
    of tokens without an adapter (slot -1) and pairs on expert -1 (another rank's expert under expert parallelism)
    are in no group: the references leave their rows untouched."""
    K = routing.topk_ids.shape[1]
    pair_slot = routing.token_slots.long().repeat_interleave(K)  # [P]
    pair_exp = routing.topk_ids.reshape(-1).long()
    for s in torch.unique(pair_slot[pair_slot >= 0]).tolist():
        for e in torch.unique(pair_exp[(pair_slot == s) & (pair_exp >= 0)]).tolist():
            yield s, e, ((pair_slot == s) & (pair_exp == e)).nonzero().squeeze(1)


def pair_virtual_experts(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int) -> torch.Tensor:
    """v[p] = slot * E + expert of pair p = t * K + k, or V = max_loras * E (left out) for a token without an
    adapter (slot -1) or a pair on expert -1 (another rank's expert under expert parallelism).
    topk_ids: [T, K] · token_slots: [T] · returns [T*K] int64."""
    K = topk_ids.shape[1]
    slot = token_slots.to(torch.int64).repeat_interleave(K)  # [P]
    exp = topk_ids.reshape(-1).to(torch.int64)
    return torch.where((slot >= 0) & (exp >= 0), slot * num_experts + exp, torch.full_like(slot, max_loras * num_experts))


def moe_lora_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by virtual expert v = slot * E + expert, each group padded to block_m.

    Returns sorted_pair_ids [P_max] int32 (pair ids; padding = T*K) and block_vexpert [P_max / block_m]
    int32 (the virtual expert of each block of block_m entries, -1 past the end). Pairs of tokens without
    an adapter, and pairs on expert -1, are left out. Sizes depend only on T, K, E, max_loras and block_m, and nothing is read back
    to the host, so the same buffers serve CUDA-graph replays.
    """
    T, K = topk_ids.shape
    P = T * K
    V = max_loras * num_experts
    dev = topk_ids.device
    v = pair_virtual_experts(topk_ids, token_slots, num_experts, max_loras)  # [P]
    counts = torch.zeros(V + 1, dtype=torch.int64, device=dev).scatter_add_(0, v, torch.ones_like(v))[:V]
    padded = (counts + block_m - 1) // block_m * block_m
    cum = torch.cumsum(padded, 0)
    starts = cum - padded
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each group
    order = torch.argsort(v, stable=True)
    vs = v[order]
    valid = vs < V
    vc = vs.clamp(max=V - 1)
    dest = starts[vc] + torch.arange(P, device=dev) - first[vc]
    p_max = P + min(V, P) * (block_m - 1)
    p_max = (p_max + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((p_max,), P, dtype=torch.int32, device=dev)
    dest = torch.where(valid, dest, torch.full_like(dest, p_max))  # invalid pairs go to a dropped extra slot
    tmp = torch.cat([sorted_ids, sorted_ids.new_full((1,), P)])
    tmp.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = tmp[:p_max]
    block_start = torch.arange(0, p_max, block_m, device=dev)
    bv = torch.searchsorted(cum, block_start, right=True)
    total = cum[-1] if V > 0 else torch.zeros((), dtype=torch.int64, device=dev)
    block_vexpert = torch.where(block_start < total, bv, torch.full_like(bv, -1)).to(torch.int32)
    return sorted_ids, block_vexpert
