"""The grouped routed-expert LoRA kernel: shrink and expand of every slice in one launch, one program per block of
pairs that share an (adapter slot, expert), so A and B are read once a group instead of once a pair (reference:
fused_triton.moe_lora_fused_ref, the same semantics). The pairs are first sorted by virtual expert slot * E + e
(grouped_align at decode, one program, blocks of GROUPED_BLOCK_M; prefill_align at prefill, blocks of
PREFILL_BLOCK_M; one alignment a layer, shared by gate_up and down); a program per (block, slice i, output split)
computes h = X[rows] @ A[i, s, e, :r].T (tl.dot, fp32), hv = h * scaling (* router weight), y[rows, tile] (+)= hv @
B[s, e, tile, :r].T. On 16-bit factors the expand splits hv into a high and a low 16-bit part (two tensor-core dots,
~16 significant bits kept); fp32 factors use an IEEE dot.

store=True writes instead of adding (a delta buffer needs no zero-fill): cdiv(P, BLOCK_M) more programs write the
zeros of pairs of tokens without an adapter (in no group). Pairs on expert -1 (another rank's expert under expert
parallelism) are left untouched in both modes. moe_lora_grouped_shrink: the shrink alone (h per pair, every slice in
one program), for the FP8 expert GEMM's LoRA epilogue at prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton
from moelora.kernels.moe import align_triton
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.chain import moe_lora_align
from moelora.kernels.moe_lora.chain_triton import a_strides, b_strides, moe_lora_align_fast
from moelora.kernels.moe_lora.fused_triton import check_a_src, fused_split_n

GROUPED_BLOCK_M = 16  # pairs per block at decode: tl.dot's smallest M; decode groups hold 1-8 pairs
PREFILL_BLOCK_M = 64  # pairs per block above DECODE_MAX_PAIRS (prefill chunks: groups of hundreds of pairs)
# max_loras x E up to this: what was measured (8 slots x 128 experts); the one-program alignment's histogram and
# scan grow with it (up to 8,191 groups it runs, but its cost there is unmeasured), so above it: the per-pair kernel
GROUPED_MAX_GROUPS = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.lora.tiles_triton import lora_b_tile

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
        if NS > 1:  # the shrink alone with every slice in one program (moe_lora_grouped_shrink): x read once
            _grouped_slices_shrink(x_ptr, a_ptr, y_ptr, ranks_ptr, sorted_ptr, bvex_ptr, S, E, K, P, D, sxm, sxd, sa_i,
                                   sa_s, sa_e, sa_r, sa_d, syp, syo, X_PER_PAIR, BLOCK_M, BLOCK_R, BLOCK_D, PRECISION,
                                   asrc_ptr, HAS_A_SRC, NS, sh_i, h_r)
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
    def _grouped_slices_shrink(
        x_ptr, a_ptr, h_ptr, ranks_ptr, sorted_ptr, bvex_ptr, S, E, K, P, D, sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d,
        shp, shr, X_PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr, asrc_ptr, HAS_A_SRC: tl.constexpr, NS: tl.constexpr, sh_i, h_r,
    ):
        """One program per group block for all NS slices: the NS A's stacked as the columns of one shrink (column c
        is rank c % BLOCK_R of slice c // BLOCK_R), so each x tile is loaded once; column c to h[c // BLOCK_R, pair,
        c % BLOCK_R] (the same sums as NS programs)."""
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
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
        tl.store(h_ptr + ci[None, :] * sh_i + pairs[:, None] * shp + cr[None, :] * shr, acc_h,
                 mask=mask_m[:, None] & (cr < h_r)[None, :])

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
    num_stages: int = 4


GROUPED_CONFIG = GroupedConfig()  # decode: the least total over 64/256 tokens x 4/8 adapters x gate_up/down (H200)
# prefill: 128-deep input steps, 128-wide output tiles, 4 warps (8,192 tokens: gate_up 306 / down 235 µs, 8 warps
# 491 / 365), 3 stages
PREFILL_CONFIG = GroupedConfig(block_d=128, block_n=128, num_warps=4, num_stages=3)


def fit_shared_memory(block_r: int, config: "GroupedConfig") -> int:
    """num_stages of a launch whose rank tile is block_r: at most 2 past 64 (GROUPED_CONFIG's 4 stages of [256, 128]
    B tiles need 270 KB of shared memory at rank 128, 139 KB at 2; an H100 has 227 KB. PREFILL_CONFIG's 3 take 147)."""
    return min(config.num_stages, 2) if block_r > 64 and config.block_n > 128 else config.num_stages


def grouped_ok(num_pairs: int, num_experts: int, max_loras: int) -> bool:
    """Whether the one-program alignment takes this batch (P <= 2048 pairs, max_loras * E < 8192 groups)."""
    return (0 < num_pairs <= align_triton.ALIGN_ONE_PROGRAM_MAX_PAIRS
            and num_experts * max_loras < align_triton.LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS)


def grouped_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                  buffers: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (slot, expert) grouping moe_lora_grouped reads at decode: chain.moe_lora_align's groups and order, blocks
    of GROUPED_BLOCK_M, in one launch (align_triton.moe_lora_align_one_program). Needs grouped_ok.
    topk_ids: [T, K] · token_slots: [T] · buffers: align_triton.lora_align_buffers' (None: made here) · returns
    (sorted_pair_ids [P_max] int32, block_vexpert int32)."""
    return align_triton.moe_lora_align_one_program(topk_ids, token_slots, num_experts, max_loras, GROUPED_BLOCK_M,
                                                   buffers)


def prefill_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                  max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (slot, expert) grouping at prefill sizes in blocks of PREFILL_BLOCK_M: moe_lora_align_fast on a GPU,
    moe_lora_align (the reference, sorted) elsewhere; the same groups, padding and block_vexpert."""
    align = moe_lora_align_fast if topk_ids.is_cuda else moe_lora_align
    return align(topk_ids, token_slots, num_experts, max_loras, PREFILL_BLOCK_M)


def moe_lora_grouped(x: torch.Tensor, lora: ProjLoRA, routing: Routing, y: torch.Tensor, *, x_per_pair: bool,
                     pair_weights: torch.Tensor | None = None, store: bool = False,
                     align: tuple[torch.Tensor, torch.Tensor] | None = None, block_m: int = GROUPED_BLOCK_M,
                     config: GroupedConfig | None = None, split_n: int | None = None) -> None:
    """moe_lora_fused's semantics and signature (shrink + expand of every slice, one launch), with A and B read once
    per (slot, expert) group instead of once per pair:
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            row = x[p] if x_per_pair else x[t];  w = pair_weights[p] if given else 1
            for i: r = ranks[i, s] if s >= 0 else 0
                delta = w * scaling[i, s] * (row @ a[i, s, e (0 if shared), :r].T) @ b_cat[s, e (0 if shared), o_i, :r].T
                if r > 0:     y[p, o_i] = y[p, o_i] + delta      (store: y[p, o_i] = delta)
                else:         untouched                          (store: y[p, o_i] = 0)
        pairs with e = -1 stay untouched in both modes
    x: [T, D] or [T*K, D] · y: [T*K, O] updated in place · pair_weights: [T*K] or None · store: write the delta (y
    may be uninitialised) · align: the grouping in blocks of block_m (grouped_align's at GROUPED_BLOCK_M, made here
    when None: needs grouped_ok; prefill_align's at PREFILL_BLOCK_M); pass it to share one per layer · config:
    launch parameters (None: GROUPED_CONFIG at decode blocks, PREFILL_CONFIG otherwise) · split_n: output splits per
    (block, slice), None = from the launch size. h and the delta are fp32, the delta rounded once to y's dtype.
    """
    require_triton()
    a, b_cat, ranks, scaling = lora.a, lora.b, lora.ranks, lora.scaling
    topk_ids, token_slots, num_experts = routing.topk_ids, routing.token_slots, routing.num_experts
    n, S, _, R, D = a.shape
    O = b_cat.shape[2]
    T, K = topk_ids.shape
    P = T * K
    if P == 0:
        return
    if align is None and not grouped_ok(P, num_experts, S):
        raise ValueError(f"moe_lora_grouped: {P} pairs over {S} x {num_experts} (slot, expert) groups is past "
                         "the one-program alignment; pass align=prefill_align(...) or use moe_lora_fused")
    check_a_src(lora.a_src, n, S, "moe_lora_grouped")
    sorted_ids, bvex = align if align is not None else grouped_align(topk_ids, token_slots, num_experts, S)
    if sorted_ids.shape[0] != bvex.shape[0] * block_m:
        raise ValueError(f"moe_lora_grouped: align holds {sorted_ids.shape[0]} pair ids in {bvex.shape[0]} blocks; "
                         f"expected blocks of {block_m} (grouped_align)")
    cfg = config or (GROUPED_CONFIG if block_m == GROUPED_BLOCK_M else PREFILL_CONFIG)
    nb = bvex.shape[0]
    max_width = triton.cdiv(O, n)  # a guess (equal slices) for SPLIT_N only
    block_r = max(16, triton.next_power_of_2(R))
    block_d = min(cfg.block_d, max(16, triton.next_power_of_2(D)))
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(max_width)))
    groups = min(P, S * num_experts)  # an upper bound on the blocks that do work (fixed per batch size)
    split = fused_split_n(groups * n, max_width, block_n, split_n)  # the per-pair kernel's rule and target
    zero_blocks = triton.cdiv(P, block_m) if store else 0
    w = pair_weights if pair_weights is not None else scaling
    f32 = b_cat.dtype == torch.float32
    _moe_lora_grouped_kernel[(nb + zero_blocks, n, split)](
        x, a, b_cat, y, lora.offsets, ranks, scaling, topk_ids.reshape(-1), token_slots, w, sorted_ids, bvex,
        D, S, num_experts, K, P, nb,
        x.stride(0), x.stride(1), *a_strides(a), *b_strides(b_cat), y.stride(0), y.stride(1),
        X_PER_PAIR=x_per_pair, HAS_W=pair_weights is not None, STORE=store, SPLIT_HV=not f32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_N=split,
        PRECISION="ieee" if f32 else None, EVEN_R=R == block_r,
        num_warps=cfg.num_warps, num_stages=fit_shared_memory(block_r, cfg),
        **({"asrc_ptr": lora.a_src, "HAS_A_SRC": True} if lora.a_src is not None else {}),
    )


def moe_lora_grouped_shrink(x: torch.Tensor, lora: ProjLoRA, routing: Routing, h: torch.Tensor, *, x_per_pair: bool,
                            align: tuple[torch.Tensor, torch.Tensor], block_m: int = PREFILL_BLOCK_M,
                            fuse_slices: bool = True, config: GroupedConfig = PREFILL_CONFIG) -> None:
    """The shrink half of moe_lora_grouped, for an expand in the expert GEMM's epilogue (fp8_expert_gemm(lora=)):
        for p with s = token_slots[p // K] >= 0 and e = topk_ids.flatten()[p] >= 0, row = x[p] or x[p // K]:
            h[i, p, :] = row @ a[i', s, e (0 if shared), :].T      (fp32; i' = a_src[i, s] if given else i;
                                                                   0 past the slot's rank: A is zero there)
        other pairs' rows of h are left as they were (the epilogue reads no h for a pair of slot -1)
    No scaling, no router weight (the epilogue scales; the combine weights the pair's whole output); lora.b unused.
    x: [T, D] or [T*K, D] · h: [n, T*K, R] fp32 (rows contiguous along R) · align: prefill_align(...) in blocks of
    block_m · fuse_slices: every slice in one program (x read once) · config: launch parameters (its input tile,
    warps and stages; no output tile: there is no expand)."""
    require_triton()
    a, ranks = lora.a, lora.ranks
    topk_ids, token_slots, num_experts = routing.topk_ids, routing.token_slots, routing.num_experts
    n, S, _, R, D = a.shape
    T, K = topk_ids.shape
    P = T * K
    if tuple(h.shape) != (n, P, R) or h.dtype != torch.float32 or h.stride(2) != 1:
        raise ValueError(f"moe_lora_grouped_shrink: h must be a [{n}, {P}, {R}] fp32 tensor with contiguous rows "
                         f"(slices, pairs, max_lora_rank), found {tuple(h.shape)} {h.dtype}")
    if P == 0:
        return
    check_a_src(lora.a_src, n, S, "moe_lora_grouped_shrink")
    sorted_ids, bvex = align
    if sorted_ids.shape[0] != bvex.shape[0] * block_m:
        raise ValueError(f"moe_lora_grouped_shrink: align holds {sorted_ids.shape[0]} pair ids in {bvex.shape[0]} "
                         f"blocks; expected blocks of {block_m}")
    ns = n if fuse_slices and n > 1 and n & (n - 1) == 0 else 1  # slices a program (a power of 2: tl.arange)
    block_r = max(16, triton.next_power_of_2(R))
    block_d = min(config.block_d, max(16, triton.next_power_of_2(D)))
    f32 = a.dtype == torch.float32
    nb = bvex.shape[0]
    _moe_lora_grouped_kernel[(nb, n // ns, 1)](
        x, a, a, h, ranks, ranks, ranks, topk_ids.reshape(-1), token_slots, ranks, sorted_ids, bvex,
        D, S, num_experts, K, P, nb,
        x.stride(0), x.stride(1), *a_strides(a), 0, 0, 0, 0, h.stride(1), h.stride(2),
        X_PER_PAIR=x_per_pair, HAS_W=False, STORE=True, SPLIT_HV=not f32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=16, SPLIT_N=1,
        PRECISION="ieee" if f32 else None, NS=ns, SHRINK_ONLY=True, sh_i=h.stride(0), h_r=R,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({"asrc_ptr": lora.a_src, "HAS_A_SRC": True} if lora.a_src is not None else {}),
    )
