"""Grouped fused kernel for routed-expert multi-LoRA: shrink and expand of every slice in one launch, one program
per block of pairs that share an (adapter slot, expert) (reference: moe_lora_fused_ref, the same semantics).

Why: moe_lora_fused (one program per pair) reads A[i, s, e] and B[s, e] once per (token, k) pair. At decode
batches, pairs of one slot often land on the same expert (64 tokens, 4 adapters, top-8 of 128: 512 pairs on
334 (slot, expert) groups in the sweep; 256 tokens: 2048 pairs on 505), so it reads the LoRA factors 1.5x
(batch 64) to 4x (batch 256) more than needed. Here the pairs are first sorted by virtual expert v = slot * E + e
(`grouped_align`: fused_moe_triton.moe_lora_align_one_program, one launch of one program, made once per layer
and shared by gate_up and down), and one program per (block of BLOCK_M pairs of one group, slice i, output
split j) computes
    h[M, R]  = X[rows] @ A[i, s, e, :r].T          (tl.dot, fp32 accumulation, pipelined loads over the input dim)
    hv       = h * scaling[i, s] (* router weight of each row)
    y[rows, tile] (+)= hv @ B[s, e, tile, :r].T    (each output tile of split j, j + SPLIT_N, ...)
so A and B are read once per group. hv is fp32; on 16-bit factors the expand splits it into a high and a low
16-bit part (two tensor-core dots; ~16 significant bits kept, against 8 for a plain cast), fp32 factors use an
IEEE dot.

Measured on the H200 (scripts/sweep_moe_lora_grouped.py, store mode, rank 16, 4 adapters): 42.7 against
71.9 µs per call for gate_up and 32.2 against 51.3 for down at 256 tokens (the alignment 23 µs a layer more), but
32.0 against 23.7 and 26.6 against 16.5 at 64 tokens, where the per-pair kernel's repeated reads mostly hit L2.
Hence GROUPED_MIN_PAIRS. An earlier grouped kernel,
removed, was 3-4x slower: fp32 FMA dots in the expand and a zero-fill for store mode. Two passes were tried too
(the shrink split over the input dim in chunks of 256/512 with deterministic partial sums, then one output tile per
program) so that no program streams a whole A. Over 24 configs it was slower than this kernel for gate_up in all 4 cases
(64/256 tokens x 4/8 adapters), faster only for down at 64 tokens (25.3 against 29.7 µs, 4 adapters; still above
the per-pair 16.5), within 1 µs at 256 tokens; removed (bench/results/sweep-moe-lora-grouped-s10-call1-*).

store=True writes instead of adding (a side-stream delta buffer needs no zero-fill). Pairs of tokens without an
adapter (slot -1) are in no group; in store mode cdiv(P, BLOCK_M) more programs write their rows' zeros. Pairs
on expert -1 (another rank's expert under expert parallelism) are left untouched in both modes, as in
moe_lora_fused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from moelora.kernels._triton import HAS_TRITON, lora_even_r, require_triton
from moelora.kernels.moe_lora.fused_triton import check_a_src, fused_split_n
from moelora.kernels.moe_lora.chain_triton import _a_strides, _b_strides

GROUPED_BLOCK_M = 16  # pairs per block: tl.dot's smallest M; decode groups hold 1-8 pairs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.lora.shrink_expand_triton import lora_b_tile

    @triton.jit
    def _moe_lora_grouped_kernel(
        x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr, sorted_ptr, bvex_ptr,
        D, S, E, K, P, NUM_BLOCKS,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sb_s, sb_e, sb_o, sb_r, syp, syo,
        X_PER_PAIR: tl.constexpr, HAS_W: tl.constexpr, STORE: tl.constexpr, SPLIT_HV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, PRECISION: tl.constexpr, EVEN_R: tl.constexpr = False,
        asrc_ptr=None, HAS_A_SRC: tl.constexpr = False, NS: tl.constexpr = 1,
        SHRINK_ONLY: tl.constexpr = False, sh_i=0, h_r=0,
    ):
        if NS > 1:  # every slice in one program (fuse_slices): x read once for all of them
            _grouped_slices_program(
                x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr, sorted_ptr,
                bvex_ptr, D, S, E, K, P, NUM_BLOCKS, sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sb_s, sb_e, sb_o, sb_r,
                syp, syo, X_PER_PAIR, HAS_W, STORE, SPLIT_HV, BLOCK_M, BLOCK_R, BLOCK_D, BLOCK_N, SPLIT_N, PRECISION,
                asrc_ptr, HAS_A_SRC, NS, SHRINK_ONLY, sh_i, h_r)
            return
        pid = tl.program_id(0)
        i = tl.program_id(1)
        pid_n = tl.program_id(2)
        o0 = 0  # (the shrink alone has no output splits nor offsets)
        width = 0
        if not SHRINK_ONLY:
            o0 = tl.load(off_ptr + i)
            width = tl.load(off_ptr + i + 1) - o0
            if pid_n * BLOCK_N >= width:  # a split past this slice's width (a narrower slice)
                return
        offs_m = tl.arange(0, BLOCK_M)
        if pid >= NUM_BLOCKS:  # store mode only: zeros for the rows of tokens without an adapter
            grouped_zero_rows(y_ptr, slots_ptr, ids_ptr, pid - NUM_BLOCKS, pid_n, o0, width, K, P, syp, syo,
                              BLOCK_M, BLOCK_N, SPLIT_N)
            return
        v = tl.load(bvex_ptr + pid)  # the block's virtual expert v = slot * E + e
        if v < 0:  # a block past the last group
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid * BLOCK_M + offs_m)
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if not STORE:
            if rank == 0:  # add mode: slices of rank 0 stay untouched
                return
        rows = pairs if X_PER_PAIR else pairs // K
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_d = tl.arange(0, BLOCK_D)
        # h = X[rows] @ A[i, s, e, :rank].T (store mode with rank 0: no iteration, h = 0, zeros written below)
        i_a = tl.load(asrc_ptr + i * S + slot) if HAS_A_SRC else i  # an equal copy of A (moe_lora_fused's a_src)
        a_base = a_ptr + i_a.to(tl.int64) * sa_i + slot.to(tl.int64) * sa_s + e * sa_e
        acc_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        d_end = tl.where(rank > 0, D, 0)
        for d0 in range(0, d_end, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < D
            at = tl.load(a_base + offs_r[None, :] * sa_r + dd[:, None] * sa_d, mask=mask_r[None, :] & mask_d[:, None],
                         other=0.0)  # [BLOCK_D, BLOCK_R]
            xt = tl.load(x_ptr + rows[:, None] * sxm + dd[None, :] * sxd, mask=mask_m[:, None] & mask_d[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_D]
            acc_h += tl.dot(xt.to(at.dtype), at, input_precision=PRECISION)
        if SHRINK_ONLY:  # h[i, pair, :h_r] = the unscaled shrink (0 past the rank), for an expand elsewhere
            tl.store(y_ptr + i * sh_i + pairs[:, None] * syp + offs_r[None, :] * syo, acc_h,
                     mask=mask_m[:, None] & (offs_r < h_r)[None, :])
            return
        hv = acc_h * tl.load(scale_ptr + i * S + slot)
        if HAS_W:
            hv = hv * tl.load(w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        grouped_expand_tiles(hv, b_ptr + slot.to(tl.int64) * sb_s + e * sb_e, y_ptr + pairs[:, None] * syp, mask_m,
                             offs_r, mask_r, o0, width, pid_n, sb_o, sb_r, syo, STORE, SPLIT_HV, BLOCK_N, SPLIT_N,
                             EVEN_R)

    @triton.jit
    def _grouped_slices_program(
        x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr, sorted_ptr, bvex_ptr,
        D, S, E, K, P, NUM_BLOCKS, sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sb_s, sb_e, sb_o, sb_r, syp, syo,
        X_PER_PAIR: tl.constexpr, HAS_W: tl.constexpr, STORE: tl.constexpr, SPLIT_HV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_N: tl.constexpr, PRECISION: tl.constexpr, asrc_ptr, HAS_A_SRC: tl.constexpr, NS: tl.constexpr,
        SHRINK_ONLY: tl.constexpr, sh_i, h_r,
    ):
        """One program per (group block, output split) for all NS slices: the NS A's stacked as the columns of one
        shrink (column c is rank c % BLOCK_R of slice c // BLOCK_R), so each x tile is loaded once; slice i's
        expand is the stacked h against B rows that are zero outside slice i (the same sums as NS programs)."""
        pid = tl.program_id(0)
        pid_n = tl.program_id(2)
        offs_m = tl.arange(0, BLOCK_M)
        if pid >= NUM_BLOCKS:  # store mode only: zeros for the rows of tokens without an adapter
            for i in tl.static_range(NS):
                o0 = tl.load(off_ptr + i)
                grouped_zero_rows(y_ptr, slots_ptr, ids_ptr, pid - NUM_BLOCKS, pid_n, o0, tl.load(off_ptr + i + 1) - o0,
                                  K, P, syp, syo, BLOCK_M, BLOCK_N, SPLIT_N)
            return
        v = tl.load(bvex_ptr + pid)
        if v < 0:
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid * BLOCK_M + offs_m)
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rows = pairs if X_PER_PAIR else pairs // K
        offs_c = tl.arange(0, NS * BLOCK_R)
        ci = offs_c // BLOCK_R  # the slice of stacked column c
        cr = offs_c % BLOCK_R  # its rank index
        rank_c = tl.load(ranks_ptr + ci * S + slot)
        mask_c = cr < rank_c
        i_a = tl.load(asrc_ptr + ci * S + slot) if HAS_A_SRC else ci
        a_cols = a_ptr + i_a.to(tl.int64) * sa_i + slot.to(tl.int64) * sa_s + e * sa_e + cr * sa_r  # [NS * BLOCK_R]
        offs_d = tl.arange(0, BLOCK_D)
        acc_h = tl.zeros((BLOCK_M, NS * BLOCK_R), dtype=tl.float32)
        d_end = tl.where(tl.max(rank_c, 0) > 0, D, 0)
        for d0 in range(0, d_end, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < D
            at = tl.load(a_cols[None, :] + dd[:, None] * sa_d, mask=mask_c[None, :] & mask_d[:, None],
                         other=0.0)  # [BLOCK_D, NS * BLOCK_R]
            xt = tl.load(x_ptr + rows[:, None] * sxm + dd[None, :] * sxd, mask=mask_m[:, None] & mask_d[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_D]
            acc_h += tl.dot(xt.to(at.dtype), at, input_precision=PRECISION)
        if SHRINK_ONLY:  # column c to h[c // BLOCK_R, pair, c % BLOCK_R]
            tl.store(y_ptr + ci[None, :] * sh_i + pairs[:, None] * syp + cr[None, :] * syo, acc_h,
                     mask=mask_m[:, None] & (cr < h_r)[None, :])
            return
        hv = acc_h * tl.load(scale_ptr + ci * S + slot)[None, :]
        if HAS_W:
            hv = hv * tl.load(w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        b_base = b_ptr + slot.to(tl.int64) * sb_s + e * sb_e
        for i in tl.static_range(NS):
            o0 = tl.load(off_ptr + i)
            width = tl.load(off_ptr + i + 1) - o0
            rank_i = tl.load(ranks_ptr + i * S + slot)
            if STORE:  # store mode writes every slice (zeros where its rank is 0)
                rank_i = tl.maximum(rank_i, 1)
            if rank_i > 0:  # add mode: slices of rank 0 stay untouched
                grouped_expand_tiles(hv, b_base, y_ptr + pairs[:, None] * syp, mask_m, cr, mask_c & (ci == i), o0,
                                     width, pid_n, sb_o, sb_r, syo, STORE, SPLIT_HV, BLOCK_N, SPLIT_N, False)

    @triton.jit
    def grouped_zero_rows(y_ptr, slots_ptr, ids_ptr, zb, pid_n, o0, width, K, P, syp, syo,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr):
        """Store mode's zero program zb: y[p, o0 + tiles of split pid_n] = 0 for the pairs p of rows zb * BLOCK_M ...
        that belong to tokens without an adapter (slot -1) and sit on a local expert (e >= 0)."""
        pp = zb * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = pp < P
        sl = tl.load(slots_ptr + pp // K, mask=valid, other=0)
        ex = tl.load(ids_ptr + pp, mask=valid, other=-1)
        zero_rows = valid & (sl < 0) & (ex >= 0)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
        for n0 in range(pid_n * BLOCK_N, width, BLOCK_N * SPLIT_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + pp.to(tl.int64)[:, None] * syp + (o0 + offs_n)[None, :] * syo, zeros,
                     mask=zero_rows[:, None] & (offs_n < width)[None, :])

    @triton.jit
    def grouped_expand_tiles(hv, b_base, y_rows, mask_m, offs_r, mask_r, o0, width, pid_n, sb_o, sb_r, syo,
                             STORE: tl.constexpr, SPLIT_HV: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
                             EVEN_R: tl.constexpr = False):
        """The expand of one group block: y_rows[:, o0 + tile] (+)= hv @ B[tile, :r].T for the output tiles pid_n,
        pid_n + SPLIT_N, ... of the slice's width. hv: [BLOCK_M, BLOCK_R] fp32 (scaling folded in) · b_base: B[s, e]
        · y_rows: [BLOCK_M, 1] row pointers. 16-bit B (SPLIT_HV): hv = hi + lo, each rounded to B's dtype, two
        tensor-core dots (~16 significant bits of hv kept); fp32 B: an IEEE dot."""
        for n0 in range(pid_n * BLOCK_N, width, BLOCK_N * SPLIT_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < width
            bt = lora_b_tile(b_base + (o0 + offs_n[None, :]) * sb_o + offs_r[:, None] * sb_r, mask_r, mask_n,
                             EVEN_R)  # [BLOCK_R, BLOCK_N]
            if SPLIT_HV:
                hi = hv.to(bt.dtype)
                lo = (hv - hi.to(tl.float32)).to(bt.dtype)
                delta = tl.dot(hi, bt) + tl.dot(lo, bt)
            else:
                delta = tl.dot(hv, bt.to(tl.float32), input_precision="ieee")
            ptrs = y_rows + (o0 + offs_n)[None, :] * syo
            mask = mask_m[:, None] & mask_n[None, :]
            if STORE:
                tl.store(ptrs, delta.to(y_rows.dtype.element_ty), mask=mask)
            else:
                y = tl.load(ptrs, mask=mask, other=0.0)
                tl.store(ptrs, (y.to(tl.float32) + delta).to(y_rows.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GroupedConfig:
    """Launch parameters of _moe_lora_grouped_kernel (scripts/sweep_moe_lora_grouped.py sweeps them)."""

    block_d: int = 128
    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 4  # the least total over 64/256 tokens x 4/8 adapters x gate_up/down (H200 sweep)


def parse_grouped_config(raw: str, name: str = "MOELORA_GROUPED_CONFIG") -> GroupedConfig:
    """'block_d,block_n,num_warps,num_stages' (e.g. 256,128,4,3; or with x between: 256x128x4x3) as a GroupedConfig."""
    try:
        bd, bn, w, st = (int(v) for v in raw.replace("x", ",").split(","))
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected four integers block_d,block_n,num_warps,num_stages")
    return GroupedConfig(bd, bn, w, st)


def _env_config() -> GroupedConfig:
    """MOELORA_GROUPED_CONFIG=block_d,block_n,num_warps,num_stages (e.g. 256,128,4,3), else the defaults."""
    raw = os.environ.get("MOELORA_GROUPED_CONFIG", "")
    return parse_grouped_config(raw) if raw else GroupedConfig()


_CONFIG = [_env_config()]


def set_grouped_config(cfg: GroupedConfig | None) -> None:
    """Replace the launch parameters (None: the defaults). CUDA graphs keep the kernels they captured."""
    _CONFIG[0] = cfg or GroupedConfig()


def grouped_config() -> GroupedConfig:
    return _CONFIG[0]


def grouped_ok(num_pairs: int, num_experts: int, max_loras: int) -> bool:
    """Whether the one-program alignment takes this batch (P <= 2048 pairs, max_loras * E < 8192 groups)."""
    from moelora.kernels.moe.experts_triton import ALIGN_ONE_PROGRAM_MAX_PAIRS, LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS

    return 0 < num_pairs <= ALIGN_ONE_PROGRAM_MAX_PAIRS and num_experts * max_loras < LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS


def grouped_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                  max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (slot, expert) grouping moe_lora_grouped reads: moe_lora.moe_lora_align's groups and order, blocks of
    GROUPED_BLOCK_M, in one launch (fused_moe_triton.moe_lora_align_one_program). One per layer: gate_up and
    down share it. topk_ids: [T, K] · token_slots: [T] · returns (sorted_pair_ids [P_max] int32, block_vexpert)."""
    from moelora.kernels.moe.experts_triton import moe_lora_align_one_program

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
    config: GroupedConfig | None = None,
    a_src: torch.Tensor | None = None,
    block_m: int = GROUPED_BLOCK_M,
    fuse_slices: bool = False,
) -> None:
    """moe_lora_fused's semantics (shrink + expand of every slice, one launch), with A and B read once per
    (slot, expert) group instead of once per pair:
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            row = x[p] if x_per_pair else x[t];  w = pair_weights[p] if given else 1
            for i: r = ranks[i, s] if s >= 0 else 0
                delta = w * scaling[i, s] * (row @ a[i, s, e (0 if shared), :r].T) @ b_cat[s, e (0 if shared), o_i, :r].T
                if r > 0:     y[p, o_i] = y[p, o_i] + delta      (store: y[p, o_i] = delta)
                else:         untouched                          (store: y[p, o_i] = 0)
        pairs with e = -1 stay untouched in both modes
    x: [T, D] or [T*K, D] · a: [n, S, E|1, R, D] · b_cat: [S, E|1, O, R] · slice_offsets: [n+1] int32
    ranks: [n, S] int32 · scaling: [n, S] fp32 · topk_ids: [T, K] int · token_slots: [T] int32
    num_experts: E of the model (virtual expert = slot * E + e) · y: [T*K, O] updated in place
    pair_weights: [T*K] or None · store: write the delta (y may be uninitialised)
    align: grouped_align(topk_ids, token_slots, num_experts, S) (made here when None; pass it to share one
    per layer) · split_n: output splits per (block, slice), None = from the launch size · config: launch
    parameters (None: grouped_config()). Needs grouped_ok(T * K, num_experts, S) unless align is given.
    block_m: pairs per block, the alignment's (GROUPED_BLOCK_M; prefill_align's PREFILL_BLOCK_M at prefill).
    a_src: [n, S] int32 or None: as moe_lora_fused's (slice i of slot s reads the equal A copy of slice a_src[i, s])
    fuse_slices: one program a (block, output split) for all n slices, their A's stacked into one shrink (x read
    once, not n times; the same sums); otherwise one program a (block, slice, output split).
    h and the delta are fp32, the delta is rounded once to y's dtype.
    """
    require_triton()
    n, S, _, R, D = a.shape
    O = b_cat.shape[2]
    T, K = topk_ids.shape
    P = T * K
    if P == 0:
        return
    if align is None and not grouped_ok(P, num_experts, S):
        raise ValueError(f"moe_lora_grouped: {P} pairs over {S} x {num_experts} (slot, expert) groups is past "
                         "the one-program alignment; pass align=prefill_align(...) or use moe_lora_fused")
    check_a_src(a_src, n, S, "moe_lora_grouped")
    sorted_ids, bvex = align if align is not None else grouped_align(topk_ids, token_slots, num_experts, S)
    if sorted_ids.shape[0] != bvex.shape[0] * block_m:
        raise ValueError(f"moe_lora_grouped: align holds {sorted_ids.shape[0]} pair ids in {bvex.shape[0]} blocks; "
                         f"expected blocks of {block_m} (grouped_align)")
    ns = n if fuse_slices and n > 1 and n & (n - 1) == 0 else 1  # slices a program (a power of 2: tl.arange)
    cfg = config or (grouped_config() if block_m == GROUPED_BLOCK_M else
                     PREFILL_FUSED_CONFIG if ns > 1 else grouped_prefill_config())
    nb = bvex.shape[0]
    max_width = triton.cdiv(O, n)  # a guess (equal slices) for SPLIT_N only
    block_r = max(16, triton.next_power_of_2(R))
    block_d = min(cfg.block_d, max(16, triton.next_power_of_2(D)))
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(max_width)))
    groups = min(P, S * num_experts)  # an upper bound on the blocks that do work (fixed per batch size)
    split = fused_split_n(groups * (n // ns), max_width, block_n, split_n)  # the per-pair kernel's rule and target
    zero_blocks = triton.cdiv(P, block_m) if store else 0
    w = pair_weights if pair_weights is not None else scaling
    f32 = b_cat.dtype == torch.float32
    _moe_lora_grouped_kernel[(nb + zero_blocks, n // ns, split)](
        x, a, b_cat, y, slice_offsets, ranks, scaling, topk_ids.reshape(-1), token_slots, w, sorted_ids, bvex,
        D, S, num_experts, K, P, nb,
        x.stride(0), x.stride(1), *_a_strides(a), *_b_strides(b_cat), y.stride(0), y.stride(1),
        X_PER_PAIR=x_per_pair, HAS_W=pair_weights is not None, STORE=store, SPLIT_HV=not f32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_N=split,
        PRECISION="ieee" if f32 else None, EVEN_R=lora_even_r() and R == block_r, NS=ns,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"asrc_ptr": a_src, "HAS_A_SRC": True} if a_src is not None else {}),
    )


def moe_lora_grouped_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    num_experts: int,
    h: torch.Tensor,
    x_per_pair: bool,
    align: tuple[torch.Tensor, torch.Tensor],
    block_m: int,
    a_src: torch.Tensor | None = None,
    fuse_slices: bool = True,
    config: GroupedConfig | None = None,
) -> None:
    """The shrink half of moe_lora_grouped, for an expand in the expert GEMM's epilogue (fp8_expert_gemm(lora=)):
        for p with s = token_slots[p // K] >= 0 and e = topk_ids.flatten()[p] >= 0, row = x[p] or x[p // K]:
            h[i, p, :] = row @ a[i', s, e (0 if shared), :].T      (fp32; i' = a_src[i, s] if given else i;
                                                                   0 past the slot's rank: A is zero there)
        other pairs' rows of h are left as they were (the epilogue reads no h for a pair of slot -1)
    No scaling, no router weight (the epilogue scales; the combine weights the pair's whole output).
    x: [T, D] or [T*K, D] · a: [n, S, E|1, R, D] · ranks: [n, S] int32 · topk_ids: [T, K] · token_slots: [T] int32
    h: [n, T*K, R] fp32 (rows contiguous along R) · align: prefill_align(...) in blocks of block_m
    fuse_slices: every slice in one program (x read once); config: launch parameters (None: the prefill ones)."""
    require_triton()
    n, S, _, R, D = a.shape
    T, K = topk_ids.shape
    P = T * K
    if tuple(h.shape) != (n, P, R) or h.dtype != torch.float32 or h.stride(2) != 1:
        raise ValueError(f"moe_lora_grouped_shrink: h must be a [{n}, {P}, {R}] fp32 tensor with contiguous rows "
                         f"(slices, pairs, max_lora_rank), found {tuple(h.shape)} {h.dtype}")
    if P == 0:
        return
    check_a_src(a_src, n, S, "moe_lora_grouped_shrink")
    sorted_ids, bvex = align
    if sorted_ids.shape[0] != bvex.shape[0] * block_m:
        raise ValueError(f"moe_lora_grouped_shrink: align holds {sorted_ids.shape[0]} pair ids in {bvex.shape[0]} "
                         f"blocks; expected blocks of {block_m}")
    ns = n if fuse_slices and n > 1 and n & (n - 1) == 0 else 1
    cfg = config or grouped_prefill_config()  # (no expand: the output tile does not matter)
    block_r = max(16, triton.next_power_of_2(R))
    block_d = min(cfg.block_d, max(16, triton.next_power_of_2(D)))
    f32 = a.dtype == torch.float32
    nb = bvex.shape[0]
    _moe_lora_grouped_kernel[(nb, n // ns, 1)](
        x, a, a, h, ranks, ranks, ranks, topk_ids.reshape(-1), token_slots, ranks, sorted_ids, bvex,
        D, S, num_experts, K, P, nb,
        x.stride(0), x.stride(1), *_a_strides(a), 0, 0, 0, 0, h.stride(1), h.stride(2),
        X_PER_PAIR=x_per_pair, HAS_W=False, STORE=True, SPLIT_HV=not f32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=16, SPLIT_N=1,
        PRECISION="ieee" if f32 else None, NS=ns, SHRINK_ONLY=True, sh_i=h.stride(0), h_r=R,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"asrc_ptr": a_src, "HAS_A_SRC": True} if a_src is not None else {}),
    )


# below this many (token, k) pairs few pairs share a (slot, expert) group: the per-pair kernel (MOELORA_GROUPED_MIN_PAIRS)
GROUPED_MIN_PAIRS = int(os.environ.get("MOELORA_GROUPED_MIN_PAIRS", "2048"))
# max_loras x E up to this: what was measured (8 slots x 128 experts); the one-program alignment's histogram and
# scan grow with it (up to 8,191 groups it runs, but its cost there is unmeasured), so above it: the per-pair kernel
GROUPED_MAX_GROUPS = 1024


def grouped_for(fused: Callable, topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                max_loras: int) -> Callable | None:
    """For fused_moe_pairs: moe_lora_grouped in moe_lora_fused's signature, bound to one alignment per layer (made
    on the first call, on whatever stream that call runs: the side stream when overlapping; the down projection's
    call reuses it), when it applies: `fused` is the Triton per-pair kernel (not its reference) and
    GROUPED_MIN_PAIRS <= P with grouped_ok, and max_loras * E <= GROUPED_MAX_GROUPS. Otherwise None (keep the
    per-pair kernel).
    (Grouping by the base expert GEMM's own alignment instead, one program per (expert block, slot in it), saves
    the alignment launch but was slower than this in all 12 cases swept on the H200.)"""
    from moelora.kernels.moe_lora.fused_triton import moe_lora_fused

    P = topk_ids.numel()
    if fused is not moe_lora_fused or P < GROUPED_MIN_PAIRS or not grouped_ok(P, num_experts, max_loras):
        return None
    if num_experts * max_loras > GROUPED_MAX_GROUPS:
        return None
    return _on_one_alignment(grouped_align, GROUPED_BLOCK_M)


def _on_one_alignment(align_fn: Callable, block_m: int, fuse_slices: bool = False) -> Callable:
    """moe_lora_grouped in moe_lora_fused's signature, bound to one alignment (align_fn(ids, slots, E, max_loras),
    blocks of block_m) made on the first call, on whatever stream that call runs; later calls (the down projection's)
    reuse it. fuse_slices: moe_lora_grouped's (every slice in one program)."""
    box: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grouped(x, a, b_cat, slice_offsets, ranks, scaling, ids, slots, E, y, x_per_pair, pair_weights=None,
                store=False, a_src=None):
        if not box:
            box.append(align_fn(ids, slots, E, a.shape[1]))
        moe_lora_grouped(x, a, b_cat, slice_offsets, ranks, scaling, ids, slots, E, y, x_per_pair, pair_weights,
                         store=store, align=box[0], a_src=a_src, block_m=block_m, fuse_slices=fuse_slices)

    return grouped


# set_grouped_prefill / MOELORA_GROUPED_PREFILL (on by default, 0 turns it off): the grouped kernel at
# prefill sizes too (more than GEMV_MAX_PAIRS pairs), where fused_moe_pairs otherwise runs moe_lora_shrink /
# moe_lora_expand (tiled, 32 pairs a block) into a zero-filled delta that the expand reads and writes back: at a
# prefill chunk of 8,192 tokens ~1.9 GB of delta traffic a layer beside the two kernels. Here one launch a projection
# writes the delta once (store mode), with A and B read once a block of PREFILL_BLOCK_M pairs of one (slot, expert)
# group, on prefill_align's grouping (moe_lora_align_fast: a counting pass and a scatter, no sort).
# Measured (H200, fp8, Qwen3-30B-A3B, 16 x 2,048 tokens, 4 adapters, one process:
# scripts/profile_prefill.py): 36,195 -> 38,516 tok/s (+6.4%; 68.4% -> 72.8% of the no-adapter prefill); the
# routed LoRA's kernels and fills 257 -> 154 ms a prefill (tiled expand 173 + shrink 27 + zero-fills ~57).
PREFILL_BLOCK_M = 64
_PREFILL = [os.environ.get("MOELORA_GROUPED_PREFILL", "1") != "0"]
if os.environ.get("MOELORA_GROUPED_PREFILL", "1") not in ("", "0", "1"):
    raise ValueError(f"MOELORA_GROUPED_PREFILL must be 0 or 1, got {os.environ['MOELORA_GROUPED_PREFILL']!r}")
# 128-deep input steps, 128-wide output tiles, 4 warps, 3 stages (MOELORA_GROUPED_PREFILL_CONFIG overrides). It first
# took 8 warps (the sm_90 compile: 208-210 registers, no spills; 4 warps spill ~40-250 bytes); a sweep at
# a chunk of 8,192 tokens (scripts/sweep_grouped_prefill.py, H200, 4 adapters, rank 16) measured 4 warps faster
# anyway: gate_up 491 -> 306 us, down 365 -> 235 (64-wide tiles: 301 / 241).
PREFILL_CONFIG = GroupedConfig(block_d=128, block_n=128, num_warps=4, num_stages=3)
_env_pc = os.environ.get("MOELORA_GROUPED_PREFILL_CONFIG", "")
_PREFILL_CONFIG = [parse_grouped_config(_env_pc, "MOELORA_GROUPED_PREFILL_CONFIG") if _env_pc else PREFILL_CONFIG]


def set_grouped_prefill(enabled: bool) -> None:
    """The grouped routed-expert LoRA kernel at prefill sizes (MOELORA_GROUPED_PREFILL; above): on by default
    (+6.4% prefill tokens/s with 4 adapters on the H200). The same sums up to fp32 order (h in fp32, the
    delta rounded once)."""
    _PREFILL[0] = bool(enabled)


def grouped_prefill() -> bool:
    return _PREFILL[0]


# set_grouped_prefill_fuse_slices / MOELORA_GROUPED_PREFILL_FUSE_SLICES (off until measured end to end): at prefill,
# gate_up's two slices in one program a block (their A's stacked into one 32-wide shrink), so the gathered x rows
# are read once, not twice (at a chunk of 8,192 tokens: 65,536 pairs x 4 KiB = 268 MB a slice)
# its launch: 64-wide output tiles, 4 warps (the sweep: 296 us for gate_up at 8,192 tokens, 481 at 8 warps; at 128-wide
# tiles and 8 warps the sm_90 compile spills)
PREFILL_FUSED_CONFIG = GroupedConfig(block_d=128, block_n=64, num_warps=4, num_stages=3)
_PREFILL_FUSE = [os.environ.get("MOELORA_GROUPED_PREFILL_FUSE_SLICES", "0") == "1"]
if os.environ.get("MOELORA_GROUPED_PREFILL_FUSE_SLICES", "0") not in ("", "0", "1"):
    raise ValueError("MOELORA_GROUPED_PREFILL_FUSE_SLICES must be 0 or 1, got "
                     f"{os.environ['MOELORA_GROUPED_PREFILL_FUSE_SLICES']!r}")


def set_grouped_prefill_fuse_slices(enabled: bool) -> None:
    """The grouped kernel at prefill with every slice of a projection in one program (MOELORA_GROUPED_PREFILL_FUSE_SLICES;
    above): the same sums, x read once."""
    _PREFILL_FUSE[0] = bool(enabled)


def grouped_prefill_fuse_slices() -> bool:
    return _PREFILL_FUSE[0]


# set_prefill_lora_epilogue / MOELORA_PREFILL_LORA_EPILOGUE (on by default, mode 3): at prefill on FP8 expert
# stacks, no delta buffers: moe_lora_grouped_shrink writes each pair's h [n, P, R] (x read once for both gate_up
# slices), and the expert GEMM adds the expand in its epilogue (fp8_expert_gemm(lora=)), rounded once with the base
# output; the activation and the combine read no delta. At a chunk of 8,192 tokens this drops the delta's
# writes and reads (gate_up [P, 1536] + down [P, 2048] bf16: ~0.9 GB a layer). Values: 0 off; 1 the expand
# after the K steps, a loop over all max_loras slots (each skipped unless a row of the tile has it); 2 the same over
# the batch's slot groups, unrolled (their B loads in flight together; the sm_90 compile spills 144-208 bytes at
# 128 x 128 tiles, 8 warps); 3 the per-row slot, rank and scaling loaded before the K steps and the groups' B
# stacked into one dot (fp8 mode 3's form; 242-246 registers, no spills).
# Measured (H200, fp8, 16 x 2,048 tokens, 4 adapters, one process, the form with all slots in a loop): 35,204 ->
# 43,965 tok/s (+24.9%; 68.2% -> 83.2% of the no-adapter prefill). Then against the grouped kernel's delta path at its
# 4-warp launch: off 78.4%, mode 1 82.5%, 2 78.9%, 3 83.9% kept (one process); 1 84.6%, 3 85.9% (the next): mode 3
# is the default. (On plain bf16 stacks the same epilogue in the bf16 expert GEMM lost and was removed:
# docs/experiments.md.)
PREFILL_EPILOGUE_MODES = ("0", "1", "2", "3")
_env_epi = os.environ.get("MOELORA_PREFILL_LORA_EPILOGUE", "3") or "3"
if _env_epi not in PREFILL_EPILOGUE_MODES:
    raise ValueError(f"MOELORA_PREFILL_LORA_EPILOGUE must be one of {', '.join(PREFILL_EPILOGUE_MODES)}, got "
                     f"{_env_epi!r}")
_PREFILL_EPILOGUE = [int(_env_epi)]


def set_prefill_lora_epilogue(mode: int | bool) -> None:
    """The routed-expert LoRA at prefill on FP8 experts as a shrink plus the expert GEMM's epilogue
    (MOELORA_PREFILL_LORA_EPILOGUE; above): 0 / False off, 1 / True the expand after the K steps over all slots
    (+24.9% FP8 prefill with 4 adapters on the H200), 2 over the batch's slot groups, 3 (the default, ~1% above 1)
    its metadata prefetched. Needs set_grouped_prefill on. The delta is added in fp32 before the GEMM output's one
    rounding (not rounded on its own first)."""
    mode = int(mode)
    if str(mode) not in PREFILL_EPILOGUE_MODES:
        raise ValueError(f"set_prefill_lora_epilogue: mode must be one of {PREFILL_EPILOGUE_MODES}, got {mode}")
    _PREFILL_EPILOGUE[0] = mode


def prefill_lora_epilogue() -> int:
    return _PREFILL_EPILOGUE[0]


def prefill_lora_epilogue_for(w) -> bool:
    """Whether set_prefill_lora_epilogue's path serves expert stack w: its GEMM adds a LoRA expand in its epilogue
    (fused_moe_triton.lora_epilogue_ok: FP8 stacks)."""
    from moelora.kernels.moe.experts_triton import lora_epilogue_ok

    return lora_epilogue_ok(w)


def set_grouped_prefill_config(cfg: GroupedConfig | None) -> None:
    """The prefill launch's parameters (None: PREFILL_CONFIG, 128-deep input steps, 128-wide output tiles, 4 warps,
    3 stages)."""
    _PREFILL_CONFIG[0] = cfg or PREFILL_CONFIG


def grouped_prefill_config() -> GroupedConfig:
    return _PREFILL_CONFIG[0]


def prefill_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                  max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (slot, expert) grouping at prefill sizes in blocks of PREFILL_BLOCK_M: moe_lora_align_fast on a GPU,
    moe_lora_align (the reference, sorted) elsewhere; the same groups, padding and block_vexpert."""
    from moelora.kernels.moe_lora.chain import moe_lora_align
    from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast

    align = moe_lora_align_fast if topk_ids.is_cuda else moe_lora_align
    return align(topk_ids, token_slots, num_experts, max_loras, PREFILL_BLOCK_M)


def grouped_prefill_for(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                        max_loras: int) -> Callable:
    """For fused_moe_pairs at prefill sizes (set_grouped_prefill): moe_lora_grouped in moe_lora_fused's signature
    on one prefill_align grouping per layer (made on the first call; the down projection's reuses it)."""
    return _on_one_alignment(prefill_align, PREFILL_BLOCK_M, grouped_prefill_fuse_slices())
