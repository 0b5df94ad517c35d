"""The per-pair fused routed-expert LoRA kernel (decode): shrink and expand of every slice in one launch (reference:
moe_lora_fused_ref, composed of chain.py's references).

One program per (slice i, pair p, output split j) (the slices of a pair side by side in the grid, so the gate and up
programs of a pair read a shared A from L2) computes h = x_row @ A[i, s, e, :r].T in fp32 registers (the whole input
dim, no split-K, no atomics, no h buffer), then walks the output tiles j, j + SPLIT_N, ... of slice i:
y[p, tile] += w * scaling * h @ B[s, e, tile, :r].T. From ~32 tokens P * n programs fill the GPU and SPLIT_N = 1 (A
read once per pair); at 1-16 tokens SPLIT_N > 1 spreads the output tiles over more programs, each re-reading the same
A row block (from L2 after the first). SPLIT_N, the warps per program and the loops' pipelining come from the launch
size alone (CUDA-graph safe) and can be forced (split_n, num_warps, stages: sweeps and tests).

store=True writes instead of adding: y[p, o_i] = the delta (0 for pairs of slot -1 and for slices of rank 0), so a
side-stream delta buffer needs no zero-fill. Earlier forms that lost are in docs/performance-history.md and
docs/experiments.md.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, pdl_args, require_triton
from moelora.kernels.moe.act_triton import silu_and_mul_ref
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.chain import moe_lora_expand_ref, moe_lora_shrink_ref
from moelora.kernels.moe_lora.chain_triton import a_strides, b_strides

FUSED_TARGET_PROGRAMS = 264  # SPLIT_N aims at this many programs: 2 per SM of an H200 (132 SMs)
PIPELINED_STAGES = 3  # both loops' depth for 4-warp launches (>= 512 (pair, slice) programs: 14% / 23% less time)


def fused_stages(num_warps: int) -> tuple[int, int]:
    """(shrink, expand) loop depths: PIPELINED_STAGES for 4-warp launches (from 64 tokens at top-8), 1 below (few
    programs with more warps: not measured pipelined)."""
    depth = PIPELINED_STAGES if num_warps == 4 else 1
    return depth, depth


if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    @triton.jit
    def _moe_lora_fused_kernel(
        x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr,
        D, S, K,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sb_s, sb_e, sb_o, sb_r, syp, syo,
        X_PER_PAIR: tl.constexpr, HAS_W: tl.constexpr, STORE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
        D_STAGES: tl.constexpr = 1, E_STAGES: tl.constexpr = 1, EVEN_R: tl.constexpr = False,
        asrc_ptr=None, HAS_A_SRC: tl.constexpr = False, SLICE_FIRST: tl.constexpr = False,
        xd_ptr=None, sxdm=0, sxdn=0, ACT_IN: tl.constexpr = False, HAS_XD: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        if SLICE_FIRST:  # grid (n, P, SPLIT_N): the slices of one pair side by side
            p = tl.program_id(1)
            i = tl.program_id(0)
        else:  # grid (P, n, SPLIT_N)
            p = tl.program_id(0)
            i = tl.program_id(1)
        pid_n = tl.program_id(2)
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        t = p // K
        slot = tl.load(slots_ptr + t)
        slot_c = tl.maximum(slot, 0)
        rank = tl.load(ranks_ptr + i * S + slot_c)
        rank = tl.where(slot >= 0, rank, 0)
        e = tl.load(ids_ptr + p).to(tl.int64)
        # a split past this slice's width (a narrower slice), or another rank's expert (expert parallelism:
        # nothing written, its row is never read); add mode: rows of slot -1 and slices of rank 0 stay untouched
        run = e >= 0
        if not STORE:
            run = run & (rank > 0)
        run = run & (pid_n * BLOCK_N < width)
        if run:
            row = p if X_PER_PAIR else t
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            offs_d = tl.arange(0, BLOCK_D)
            # h = x_row @ A[i, s, e, :rank].T, fp32, the whole input dim in this program (store mode with rank 0:
            # no iteration, h = 0, the tiles below are written with zeros)
            # HAS_A_SRC: read A from slice a_src[i, s], which holds the same values (an adapter whose gate and up
            # share A, as PEFT's target_parameters on fused experts: the up programs read the gate's copy, which
            # the gate programs of the same pair read too — from L2 — instead of a second copy from HBM)
            i_a = tl.load(asrc_ptr + i * S + slot_c) if HAS_A_SRC else i
            a_base = a_ptr + i_a.to(tl.int64) * sa_i + slot_c.to(tl.int64) * sa_s + e * sa_e
            acc_h = tl.zeros((BLOCK_R,), dtype=tl.float32)
            d_end = tl.where(rank > 0, D, 0)
            for d0 in tl.range(0, d_end, BLOCK_D, num_stages=D_STAGES):  # D_STAGES > 1: A and x tiles prefetched
                dd = d0 + offs_d
                mask_d = dd < D
                if ACT_IN:  # x is gate_up's output [P, 2D] (+ its delta): silu(g) * u as silu_and_mul stores it
                    xv = _act_tile(x_ptr + row.to(tl.int64) * sxm, xd_ptr + row.to(tl.int64) * sxdm, dd, mask_d, D,
                                   sxd, sxdn, HAS_XD)
                else:
                    xv = tl.load(x_ptr + row.to(tl.int64) * sxm + dd * sxd, mask=mask_d, other=0.0).to(tl.float32)
                at = tl.load(a_base + offs_r[:, None] * sa_r + dd[None, :] * sa_d,
                             mask=mask_r[:, None] & mask_d[None, :], other=0.0)
                acc_h += tl.sum(at.to(tl.float32) * xv[None, :], axis=1)
            w_p = tl.load(w_ptr + p).to(tl.float32) if HAS_W else 1.0
            b_base = b_ptr + slot_c.to(tl.int64) * sb_s + e * sb_e
            y_row = y_ptr + p.to(tl.int64) * syp
            hv = acc_h * (tl.load(scale_ptr + i * S + slot_c) * w_p)  # [BLOCK_R], scaling (and router weight) once
            _fused_expand(hv, b_base, y_row, o0, width, rank, mask_r, offs_r, pid_n, sb_o, sb_r, syo,
                          STORE, BLOCK_N, SPLIT_N, E_STAGES, EVEN_R)

    @triton.jit
    def _act_tile(gu_row, d_row, dd, mask_d, D, s_gn, s_dn, HAS_XD: tl.constexpr):
        """fp32 [BLOCK_D] of silu(g) * u at columns dd of one row of gate_up's output (g at dd, u at D + dd), its
        delta added first and rounded once to its dtype (HAS_XD), the product rounded to its dtype: the numbers
        act_triton._silu_and_mul_kernel writes, by the same operations."""
        g = tl.load(gu_row + dd * s_gn, mask=mask_d, other=0.0)
        u = tl.load(gu_row + (dd + D) * s_gn, mask=mask_d, other=0.0)
        if HAS_XD:
            g = (g.to(tl.float32) + tl.load(d_row + dd * s_dn, mask=mask_d, other=0.0)).to(g.dtype)
            u = (u.to(tl.float32) + tl.load(d_row + (dd + D) * s_dn, mask=mask_d, other=0.0)).to(u.dtype)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(gu_row.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _fused_expand(hv, b_base, y_row, o0, width, rank, mask_r, offs_r, pid_n, sb_o, sb_r, syo,
                      STORE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, E_STAGES: tl.constexpr,
                      EVEN_R: tl.constexpr):
        """y_row[o0 + n] (+)= sum_r B[o0 + n, r] * hv[r] over the output tiles pid_n, pid_n + SPLIT_N, ... of one
        slice (columns o0 : o0 + width); B rows read at b_base + row * sb_o."""
        for n0 in tl.range(pid_n * BLOCK_N, width, BLOCK_N * SPLIT_N, num_stages=E_STAGES):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < width
            b_ptrs = b_base + (o0 + offs_n[:, None]) * sb_o + offs_r[None, :] * sb_r
            if EVEN_R:  # rows of BLOCK_R values (the buffer's rank R): masked by row only, so the load is
                # vectorized and can be pipelined (cp.async takes >= 4 bytes), the entries past this slot's rank
                # zeroed after it (only with E_STAGES > 1: unpipelined, this form was slower). Rank 0 (rows without
                # an adapter, attention-only adapters) loads nothing: store mode writes the zeros
                live_n = offs_n < tl.where(rank > 0, width, 0)
                bt = tl.where(mask_r[None, :], tl.load(b_ptrs, mask=live_n[:, None], other=0.0), 0.0)
            else:
                bt = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            delta = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N]
            ptrs = y_row + (o0 + offs_n) * syo
            if STORE:
                tl.store(ptrs, delta.to(y_row.dtype.element_ty), mask=mask_n)
            else:
                y = tl.load(ptrs, mask=mask_n, other=0.0)
                tl.store(ptrs, (y.to(tl.float32) + delta).to(y_row.dtype.element_ty), mask=mask_n)

def fused_num_warps(programs: int) -> int:
    """Warps per program from the number of (pair, slice) programs: few programs (1-16 tokens) get more warps
    and bigger tiles, so each program has more bytes in flight per loop iteration and fewer dependent
    iterations over the input dim (a 4-warp program streaming 64 KiB of A in 8 KiB steps is latency-bound)."""
    return 4 if programs >= 512 else (8 if programs >= 128 else 16)


def fused_blocks(R: int, D: int, max_width: int, num_warps: int = 4) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, BLOCK_N): rank tile = the whole padded rank; input / output tiles of 1024 * num_warps
    elements (32 fp32 values per thread) with rows of >= 64 bytes (2x wider tiles lost in every configuration
    swept)."""
    block_r = max(16, triton.next_power_of_2(R))
    tile = max(32, min(256 * num_warps, 1024 * num_warps // block_r))
    block_d = min(tile, max(16, triton.next_power_of_2(D)))
    block_n = min(tile, max(16, triton.next_power_of_2(max_width)))
    return block_r, block_d, block_n


def fused_split_n(programs: int, max_width: int, block_n: int, split_n: int | None = None) -> int:
    """Output splits per (row, slice): enough programs for FUSED_TARGET_PROGRAMS, at most one per tile."""
    tiles = triton.cdiv(max_width, block_n)
    if split_n is not None:
        return max(1, min(int(split_n), tiles))
    return max(1, min(tiles, triton.cdiv(FUSED_TARGET_PROGRAMS, max(1, programs))))


def moe_lora_fused(
    x: torch.Tensor,
    lora: ProjLoRA,
    routing: Routing,
    y: torch.Tensor,
    *,
    x_per_pair: bool,
    pair_weights: torch.Tensor | None = None,
    store: bool = False,
    act_in: bool = False,
    act_delta: torch.Tensor | None = None,
    split_n: int | None = None,
    num_warps: int | None = None,
    stages: tuple[int, int] | None = None,
) -> None:
    """Shrink + expand in one launch, for decode-sized P (h never leaves registers).
    Semantics (a, b_cat, ranks, scaling of lora; slice i owns columns o_i = offsets[i]:offsets[i+1]):
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            row = x[p] if x_per_pair else x[t];  w = pair_weights[p] if given else 1
            for i: r = ranks[i, s] if s >= 0 else 0
                delta = w * scaling[i, s] * (row @ a[i, s, e (0 if shared), :r].T) @ b_cat[s, e (0 if shared), o_i, :r].T
                if r > 0:     y[p, o_i] = y[p, o_i] + delta      (store: y[p, o_i] = delta)
                else:         untouched                          (store: y[p, o_i] = 0)
        a pair with e = -1 (another rank's expert under expert parallelism) leaves y[p] untouched in both
        modes (its row is never read: the base path left it out too)
    x: [T, D] or [T*K, D] · y: [T*K, O] updated in place · pair_weights: [T*K] or None · store: write the delta (y
    may be an uninitialised buffer) · act_in: x is gate_up's output [T*K, 2D] (x_per_pair) and each row read is its
    activation, silu(x[p, :D]) * x[p, D:] in fp32 rounded once to x's dtype, with act_delta [T*K, 2D] (fp32 or x's
    dtype; None: none) added to x and rounded to x's dtype first: the numbers act_triton.silu_and_mul(x,
    delta=act_delta) writes, so the down projection's LoRA need not wait for that kernel (moe_lora.early_down).
    split_n (output splits per (pair, slice)), num_warps, stages ((shrink, expand) loop depths): None = from the
    launch size. h is fp32, the delta is added in fp32 and rounded once to y's dtype.
    """
    require_triton()
    a, b_cat = lora.a, lora.b
    T, K = routing.topk_ids.shape
    P = T * K
    act_kw = check_act_in(x, act_in, act_delta, x_per_pair, P, a.shape[4], "moe_lora_fused")
    if P == 0:
        return
    warps, (block_r, block_d, block_n), split = fused_launch(a, b_cat, P, split_n, num_warps)
    d_stages, e_stages = stages or fused_stages(warps)
    w = pair_weights if pair_weights is not None else lora.scaling
    n, S, D = a.shape[0], a.shape[1], a.shape[4]
    check_a_src(lora.a_src, n, S, "moe_lora_fused")
    slice_first = n > 1  # grid (slice, pair, split): the slices of a pair side by side
    _moe_lora_fused_kernel[(n, P, split) if slice_first else (P, n, split)](
        x, a, b_cat, y, lora.offsets, lora.ranks, lora.scaling, routing.topk_ids.reshape(-1), routing.token_slots, w,
        D, S, K, x.stride(0), x.stride(1), *a_strides(a), *b_strides(b_cat), y.stride(0), y.stride(1),
        X_PER_PAIR=x_per_pair, HAS_W=pair_weights is not None, STORE=store,
        BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_N=split, D_STAGES=d_stages, E_STAGES=e_stages,
        EVEN_R=e_stages > 1 and a.shape[3] == block_r, num_warps=warps,
        **({"asrc_ptr": lora.a_src, "HAS_A_SRC": True} if lora.a_src is not None else {}),
        **({"SLICE_FIRST": True} if slice_first else {}),
        **act_kw, **pdl_args(x.device),
    )


def check_act_in(x: torch.Tensor, act_in: bool, act_delta: torch.Tensor | None, x_per_pair: bool, P: int, D: int,
                 who: str) -> dict:
    """The kernel's act_in arguments ({} without act_in) after checking x [P, 2D] per pair and act_delta [P, 2D]
    (fp32 or x's dtype) or None; a ValueError that names the tensor, the expected and the found shape otherwise."""
    if not act_in:
        if act_delta is not None:
            raise ValueError(f"{who}: act_delta is read only with act_in=True")
        return {}
    if not x_per_pair or tuple(x.shape) != (P, 2 * D):
        raise ValueError(f"{who}: act_in needs gate_up's output per pair, x [{P}, {2 * D}] (x_per_pair=True), found "
                         f"{tuple(x.shape)} (x_per_pair={x_per_pair})")
    if act_delta is not None and (tuple(act_delta.shape) != (P, 2 * D)
                                  or act_delta.dtype not in (torch.float32, x.dtype)):
        raise ValueError(f"{who}: act_delta must be fp32 or {x.dtype} [{P}, {2 * D}], found {act_delta.dtype} "
                         f"{tuple(act_delta.shape)}")
    xd = x if act_delta is None else act_delta
    return {"xd_ptr": xd, "sxdm": xd.stride(0), "sxdn": xd.stride(1), "ACT_IN": True, "HAS_XD": act_delta is not None}


def check_a_src(a_src: torch.Tensor | None, n: int, S: int, who: str) -> None:
    """a_src must be None or a contiguous int32 [n, S] (the slice each (slice, slot) reads A from)."""
    if a_src is not None and (tuple(a_src.shape) != (n, S) or a_src.dtype != torch.int32 or not a_src.is_contiguous()):
        raise ValueError(f"{who}: a_src must be a contiguous int32 [{n}, {S}] (the slice each (slice, slot) reads A "
                         f"from), found {a_src.dtype} {tuple(a_src.shape)}")


def fused_launch(a: torch.Tensor, b_cat: torch.Tensor, P: int, split_n: int | None = None,
                 num_warps: int | None = None) -> tuple[int, tuple[int, int, int], int]:
    """(num_warps, (BLOCK_R, BLOCK_D, BLOCK_N), SPLIT_N) of moe_lora_fused's programs for P pairs: fixed by the
    launch size alone (CUDA-graph safe). a: [n, S, E|1, R, D] · b_cat: [S, E|1, O, R]."""
    n, _, _, R, D = a.shape
    max_width = triton.cdiv(b_cat.shape[2], n)  # a guess (equal slices) for SPLIT_N only: programs loop over tiles
    warps = num_warps if num_warps is not None else fused_num_warps(P * n)
    blocks = fused_blocks(R, D, max_width, warps)
    return warps, blocks, fused_split_n(P * n, max_width, blocks[2], split_n)




def moe_lora_fused_ref(
    x: torch.Tensor,
    lora: ProjLoRA,
    routing: Routing,
    y: torch.Tensor,
    *,
    x_per_pair: bool,
    pair_weights: torch.Tensor | None = None,
    store: bool = False,
    act_in: bool = False,
    act_delta: torch.Tensor | None = None,
    split_n: int | None = None,
    num_warps: int | None = None,
    stages: tuple[int, int] | None = None,
) -> None:
    """Reference of moe_lora_fused (same semantics, shapes and signature): moe_lora_shrink_ref into a zeroed fp32 h,
    then moe_lora_expand_ref into y (store: into a zeroed fp32 delta, then copied to y). split_n, num_warps, stages
    and a_src are ignored (a_src only names an equal copy of A). act_in: x becomes silu_and_mul_ref of x (+
    act_delta, rounded once to x's dtype) first."""
    check_act_in(x, act_in, act_delta, x_per_pair, routing.num_pairs, lora.a.shape[4], "moe_lora_fused_ref")
    check_a_src(lora.a_src, lora.a.shape[0], lora.a.shape[1], "moe_lora_fused_ref")
    if act_in:
        x = silu_and_mul_ref(x if act_delta is None else (x.float() + act_delta.float()).to(x.dtype))
    n, R = lora.a.shape[0], lora.a.shape[3]
    h = torch.zeros(routing.num_pairs, n, R, dtype=torch.float32, device=x.device)  # [P, n, R]
    moe_lora_shrink_ref(x, lora, routing, h, x_per_pair=x_per_pair)
    if not store:
        moe_lora_expand_ref(h, lora, routing, y, pair_weights=pair_weights)
        return
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [P, O]
    moe_lora_expand_ref(h, lora, routing, delta, pair_weights=pair_weights)
    y.copy_(delta)
