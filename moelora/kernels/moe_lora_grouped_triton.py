"""Grouped decode kernel for routed-expert multi-LoRA: the (token, k) pairs grouped by virtual expert
(slot, expert), shrink and expand of each group in one program (reference: moe_lora_fused_ref, the same
semantics as moe_lora_fused).

Why: moe_lora_fused (one program per pair) reads A[slot, expert] and B[slot, expert] once per pair. From
~32 tokens most (slot, expert) groups hold several pairs (batch 256, top-8, 4 adapters: 2,048 pairs on at
most 512 groups), so those reads repeat: at batch 256 the per-pair kernel streamed ~4x the LoRA bytes. Here
one program per (block of BLOCK_M pairs of one group, slice i, output split j) reads its A once (h = X A^T
with tl.dot, fp32 accumulation), then walks the output tiles j, j + SPLIT_N, ... of slice i:
y[p, tile] (+)= w[p] * scaling * h[p] @ B[s, e, tile, :r].T (fp32 products, as moe_lora_fused).

Off by default (set_grouped_lora / MOELORA_GROUPED_LORA=1): measured slower than the per-pair kernel on the
H200 (see set_grouped_lora). Kept, tested, for tuning.

The alignment is moe_lora_align's (stable, padded to BLOCK_M), made in one launch by
fused_moe_triton.moe_lora_align_one_program and shared by gate_up and down of a layer (`align`).
"""

from __future__ import annotations

import torch

from functools import partial
from typing import Callable

from moelora.kernels._triton import HAS_TRITON, dot_precision, grouped_lora, require_triton
from moelora.kernels.moe_lora_triton import _a_strides, _b_strides

GROUPED_MIN_PAIRS = 256  # below (1-31 tokens at top-8) few pairs share a group: the per-pair kernel, split wider
GROUPED_BLOCK_M = 16  # pairs per program (tl.dot's smallest M); groups hold ~1-8 pairs at decode sizes
GROUPED_TARGET_PROGRAMS = 528  # SPLIT_N aims at this many programs (4 per SM of an H200)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_lora_grouped_kernel(
        x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, sorted_ptr, bvex_ptr, w_ptr,
        D, S, E, K, P,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sb_s, sb_e, sb_o, sb_r, syp, syo,
        X_PER_PAIR: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        blk = tl.program_id(0)
        i = tl.program_id(1)
        pid_n = tl.program_id(2)
        v = tl.load(bvex_ptr + blk)
        if v < 0:  # past the last group
            return
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:  # a split past this slice's width (a narrower slice)
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + offs_m)
        valid = pairs < P
        pairs = tl.where(valid, pairs, 0).to(tl.int64)
        rows = pairs if X_PER_PAIR else pairs // K
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_d = tl.arange(0, BLOCK_D)
        a_base = a_ptr + i.to(tl.int64) * sa_i + slot.to(tl.int64) * sa_s + e * sa_e
        acc_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < D
            xt = tl.load(x_ptr + rows[:, None] * sxm + dd[None, :] * sxd, mask=valid[:, None] & mask_d[None, :],
                         other=0.0)
            at = tl.load(a_base + offs_r[None, :] * sa_r + dd[:, None] * sa_d, mask=mask_r[None, :] & mask_d[:, None],
                         other=0.0)
            acc_h += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)  # [BLOCK_M, BLOCK_R]
        scale = tl.load(scale_ptr + i * S + slot)
        if HAS_W:
            row_scale = scale * tl.load(w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        else:
            row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + scale
        hv = acc_h * row_scale[:, None]  # scaling (and router weight) folded in once
        b_base = b_ptr + slot.to(tl.int64) * sb_s + e * sb_e
        for n0 in range(pid_n * BLOCK_N, width, BLOCK_N * SPLIT_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < width
            bt = tl.load(b_base + (o0 + offs_n[None, :]) * sb_o + offs_r[:, None] * sb_r,
                         mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            mask = valid[:, None] & mask_n[None, :]
            # fp32 products, as moe_lora_fused. The select keeps Triton from folding the add below into the
            # dot's accumulator (dot(a, b, acc=y) rounds differently): add mode into y and store mode into a
            # zeroed delta then added by the consumer must give the same bits (test_overlap_equals_serial)
            delta = tl.where(mask, tl.dot(hv, bt.to(tl.float32), input_precision="ieee"), 0.0)
            ptrs = y_ptr + pairs[:, None] * syp + (o0 + offs_n[None, :]) * syo
            y = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def grouped_split_n(num_pairs: int, groups: int, n: int, max_width: int, block_n: int) -> int:
    """Output splits per (block, slice): enough programs for GROUPED_TARGET_PROGRAMS when few groups are
    expected (at most min(P, groups) blocks hold pairs), at most one per output tile."""
    tiles = triton.cdiv(max_width, block_n)
    expected = max(1, min(num_pairs, groups) * n)
    return max(1, min(tiles, triton.cdiv(GROUPED_TARGET_PROGRAMS, expected)))


def moe_lora_grouped_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int):
    """The alignment moe_lora_grouped reads (one launch; moe_lora_align's groups, padded to GROUPED_BLOCK_M)."""
    from moelora.kernels.fused_moe_triton import moe_lora_align_one_program

    return moe_lora_align_one_program(topk_ids, token_slots, num_experts, max_loras, GROUPED_BLOCK_M)


def moe_lora_grouped(
    x: torch.Tensor,
    a: torch.Tensor,
    b_cat: torch.Tensor,
    slice_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    num_experts: int,
    y: torch.Tensor,
    x_per_pair: bool,
    pair_weights: torch.Tensor | None = None,
    store: bool = False,
    align: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_n: int | None = None,
    block_d: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> None:
    """moe_lora_fused's semantics (kernels/moe_lora_fused_triton.py), one program per block of pairs of one
    (slot, expert) group. Semantics (slice i owns columns o_i = slice_offsets[i]:slice_offsets[i+1]):
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            row = x[p] if x_per_pair else x[t];  w = pair_weights[p] if given else 1
            for i: r = ranks[i, s] if s >= 0 and e >= 0 else 0
                delta = w * scaling[i, s] * (row @ a[i, s, e (0 if shared), :r].T) @ b_cat[s, e (0 if shared), o_i, :r].T
                if r > 0:     y[p, o_i] = y[p, o_i] + delta      (store: y[p, o_i] = delta)
                else:         untouched                          (store: y[p, o_i] = 0)
    store: y is zero-filled here first (one fill launch), then added to.
    x: [T, D] or [T*K, D] · a: [n, S, E|1, R, D] · b_cat: [S, E|1, O, R] · slice_offsets: [n+1] int32
    ranks: [n, S] int32 · scaling: [n, S] fp32 · topk_ids: [T, K] int · token_slots: [T] int32
    num_experts: E of the model (virtual expert = slot * E + e) · y: [T*K, O] · pair_weights: [T*K] or None
    align: moe_lora_grouped_align(topk_ids, token_slots, num_experts, S), made here when None
    h is fp32 (tl.dot, fp32 accumulation), the delta fp32 products, added in fp32 and rounded once to y's dtype.
    split_n, block_d, num_warps, num_stages: launch overrides for tuning (scripts/bench_lora_fused.py --sweep);
    None = the defaults (grouped_split_n, 128-wide input tiles, Triton's stages).
    """
    require_triton()
    n, S, _, R, D = a.shape
    O = b_cat.shape[2]
    T, K = topk_ids.shape
    P = T * K
    if store:
        y.zero_()
    if P == 0:
        return
    sorted_ids, bvex = align if align is not None else moe_lora_grouped_align(topk_ids, token_slots, num_experts, S)
    if sorted_ids.shape[0] != bvex.shape[0] * GROUPED_BLOCK_M:
        raise ValueError(f"moe_lora_grouped: align holds {sorted_ids.shape[0]} pair ids in {bvex.shape[0]} blocks; "
                         f"expected blocks of {GROUPED_BLOCK_M} (moe_lora_grouped_align)")
    block_r = max(16, triton.next_power_of_2(R))
    block_d = min(block_d or 128, max(16, triton.next_power_of_2(D)))
    max_width = triton.cdiv(O, n)
    block_n = 128 if max_width >= 128 else max(16, triton.next_power_of_2(max_width))
    tiles = triton.cdiv(max_width, block_n)
    split = grouped_split_n(P, S * num_experts, n, max_width, block_n) if split_n is None else max(1, min(split_n, tiles))
    extra = {} if num_stages is None else {"num_stages": num_stages}
    w = pair_weights if pair_weights is not None else scaling
    _moe_lora_grouped_kernel[(bvex.shape[0], n, split)](
        x, a, b_cat, y, slice_offsets, ranks, scaling, sorted_ids, bvex, w, D, S, num_experts, K, P,
        x.stride(0), x.stride(1), *_a_strides(a), *_b_strides(b_cat), y.stride(0), y.stride(1),
        X_PER_PAIR=x_per_pair, HAS_W=pair_weights is not None, BLOCK_M=GROUPED_BLOCK_M, BLOCK_R=block_r,
        BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_N=split, PRECISION=dot_precision(x.dtype), num_warps=num_warps,
        **extra,
    )


def grouped_for(shrink: Callable, topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                max_loras: int) -> Callable | None:
    """For fused_moe_pairs: moe_lora_grouped bound to this layer's alignment (made here, once for gate_up and
    down) when the grouped kernel applies — set_grouped_lora on, the Triton shrink, GROUPED_MIN_PAIRS <= P <=
    the one-program alignment's limits — else None (the per-pair fused op)."""
    from moelora.kernels import moe_lora_triton
    from moelora.kernels.fused_moe_triton import ALIGN_ONE_PROGRAM_MAX_PAIRS, LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS

    P = topk_ids.numel()
    if not (grouped_lora() and HAS_TRITON and shrink is moe_lora_triton.moe_lora_shrink):
        return None
    if P < GROUPED_MIN_PAIRS or P > ALIGN_ONE_PROGRAM_MAX_PAIRS or max_loras * num_experts >= LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS:
        return None
    return partial(moe_lora_grouped, align=moe_lora_grouped_align(topk_ids, token_slots, num_experts, max_loras))
