"""Fused decode kernel for dense multi-LoRA: shrink and expand of every slice in one launch
(reference: lora_fused_decode_ref below, composed of lora.py's references).

The unfused path (lora_triton.py) is three launches (zero h, shrink with split-K atomics, expand) and
at decode sizes costs ~17-20 us for a 4096-wide layer whose byte floor is ~1 us. Here one program per
(row block of a slot group, output split, slice) computes h = x[rows] @ A[i, s, :r].T for its block of
up to BLOCK_M tokens of one slot with tl.dot over the whole input dim (fp32, in registers; the tokens of
a slot share A, so A is read once per row block, not per token), then walks the output tiles
j, j + SPLIT_N, ... of slice i: y[rows, tile] += scaling * h @ B[s, tile, :r].T.

Grid: (cdiv(T, BLOCK_M) * SPLIT_N, n, L [+1 in store mode]); the slot groups come from SlotGroups
(fixed size max_loras: the launch depends on T only, CUDA-graph safe); a program whose group is unused,
whose row block lies past its group's count or whose split lies past its slice's width exits at once.
SPLIT_N > 1 (small T) re-reads A per split (from L2 after the first) to put more programs on the GPU.

store=True writes instead of adding: y[t, o_i] = the delta (0 for tokens of slot -1, via one extra group
over the base tokens at the end of sorted_token_ids, and for slices of rank 0).
The expand rounds h to the factors' dtype before tl.dot, as lora_triton.py's expand does.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, require_triton
from moelora.kernels.groups import SlotGroups
from moelora.kernels.lora import lora_expand_ref, lora_shrink_ref

FUSED_DENSE_MAX_TOKENS = 256  # apply_dense_lora takes the fused kernel up to this many tokens (switch on)
FUSED_TARGET_PROGRAMS = 264  # SPLIT_N aims at this many programs: 2 per SM of an H200 (132 SMs)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _lora_fused_decode_kernel(
        x_ptr, a_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr,
        H, S, T, L,
        sxm, sxk, sa_i, sa_s, sa_r, sa_k, sb_s, sb_o, sb_r, sym, syo,
        STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_L: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_mn = tl.program_id(0)
        i = tl.program_id(1)
        group = tl.program_id(2)
        pid_m = pid_mn // SPLIT_N
        pid_n = pid_mn % SPLIT_N
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:
            return
        if STORE:  # group L: the base tokens (slot -1), stored after every group's tokens
            is_base = group >= L
            g = tl.minimum(group, L - 1)
            offs_l = tl.arange(0, BLOCK_L)
            base_start = tl.sum(tl.load(count_ptr + offs_l, mask=offs_l < L, other=0))
            slot = tl.where(is_base, -1, tl.load(active_ptr + g))
            start = tl.where(is_base, base_start, tl.load(start_ptr + g))
            count = tl.where(is_base, T - base_start, tl.load(count_ptr + g))
        else:
            slot = tl.load(active_ptr + group)
            if slot < 0:
                return
            start = tl.load(start_ptr + group)
            count = tl.load(count_ptr + group)
        if pid_m * BLOCK_M >= count:
            return
        slot_c = tl.maximum(slot, 0)
        rank = tl.load(ranks_ptr + i * S + slot_c)
        rank = tl.where(slot >= 0, rank, 0)
        if not STORE:
            if rank == 0:
                return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + i.to(tl.int64) * sa_i + slot_c.to(tl.int64) * sa_s
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_end = tl.where(rank > 0, H, 0)  # store mode, rank 0: h = 0, zeros written below
        for k0 in range(0, k_end, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < H
            xt = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_base + offs_r[None, :] * sa_r + kk[:, None] * sa_k, mask=mask_r[None, :] & mask_k[:, None],
                         other=0.0)
            h += tl.dot(xt, at, input_precision=PRECISION)
        scale = tl.load(scale_ptr + i * S + slot_c)
        hb = h.to(b_ptr.dtype.element_ty)
        b_base = b_ptr + slot_c.to(tl.int64) * sb_s
        for n0 in range(pid_n * BLOCK_N, width, BLOCK_N * SPLIT_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < width
            bt = tl.load(b_base + (o0 + offs_n[None, :]) * sb_o + offs_r[:, None] * sb_r,
                         mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            delta = tl.dot(hb, bt, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
            ptrs = y_ptr + rows[:, None] * sym + (o0 + offs_n[None, :]) * syo
            mask = mask_m[:, None] & mask_n[None, :]
            if STORE:
                tl.store(ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)
            else:
                y = tl.load(ptrs, mask=mask, other=0.0)
                tl.store(ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def fused_dense_blocks(T: int, R: int, H: int, max_width: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, BLOCK_N): rows per block as lora_triton's (16/32/64 by T), the whole padded
    rank; input/output tiles of 128 while BLOCK_M * BLOCK_R <= 1024 (else 64), input tiles of 256 at BLOCK_M 16
    and rank <= 32. sm_90, 4 warps: 64-178 registers at BLOCK_M 16-32, 166-245 at BLOCK_M 64 (wgmma), no spills
    (scripts/compile_check_lora_fused.py)."""
    block_m = 16 if T <= 16 else (32 if T <= 64 else 64)
    block_r = max(16, triton.next_power_of_2(R))
    tile = 128 if block_m <= 32 and block_m * block_r <= 1024 else 64
    k_tile = 256 if block_m == 16 and block_r <= 32 else tile  # few tokens: fewer dependent steps over H
    block_k = min(k_tile, max(16, triton.next_power_of_2(H)))
    block_n = min(tile, max(16, triton.next_power_of_2(max_width)))
    return block_m, block_r, block_k, block_n


def lora_fused_decode(
    x: torch.Tensor,
    a: torch.Tensor,
    b_cat: torch.Tensor,
    slice_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    groups: SlotGroups,
    y: torch.Tensor,
    store: bool = False,
    max_width: int | None = None,
    split_n: int | None = None,
    num_warps: int = 4,
) -> None:
    """lora_shrink + lora_expand of all slices in one launch (h never leaves registers).
    Semantics (slice i owns columns o_i = slice_offsets[i] : slice_offsets[i+1] of y and rows o_i of b_cat):
        for i in range(n): for t in range(T):
            s = token_slots[t]; r = ranks[i, s] if s >= 0 else 0
            delta = scaling[i, s] * (x[t] @ a[i, s, :r].T) @ b_cat[s, o_i, :r].T
            if r > 0: y[t, o_i] += delta       (store: y[t, o_i] = delta)
            else:     untouched                (store: y[t, o_i] = 0)
    x: [T, H] · a: [n, S, R, H] · b_cat: [S, O, R] · slice_offsets: [n+1] int32 · ranks: [n, S] int32
    scaling: [n, S] fp32 · groups: tokens grouped by slot · y: [T, O] updated in place
    store: write the delta (y may be uninitialised) · max_width: the widest slice (host int; default O // n),
    used only to size SPLIT_N · split_n: output splits per row block and slice (None: from the launch size)
    num_warps: per program (bench sweeps)
    """
    require_triton()
    n, S, R, H = a.shape
    O = b_cat.shape[1]
    T = x.shape[0]
    if T == 0:
        return
    L = groups.active_slots.shape[0]
    width = max_width if max_width is not None else triton.cdiv(O, n)
    bm, block_r, block_k, block_n = fused_dense_blocks(T, R, H, width)
    # programs doing work: about one row block per slot present plus T / BLOCK_M, per slice
    busy = (min(T, L) + T // bm) * n
    tiles = triton.cdiv(width, block_n)
    split = max(1, min(tiles, int(split_n) if split_n is not None else triton.cdiv(FUSED_TARGET_PROGRAMS, busy)))
    grid = (triton.cdiv(T, bm) * split, n, L + int(store))
    _lora_fused_decode_kernel[grid](
        x, a, b_cat, y, slice_offsets, ranks, scaling, groups.sorted_token_ids, groups.active_slots,
        groups.slot_counts, groups.slot_starts,
        H, S, T, L,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        b_cat.stride(0), b_cat.stride(1), b_cat.stride(2), y.stride(0), y.stride(1),
        STORE=store, BLOCK_M=bm, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, SPLIT_N=split,
        BLOCK_L=max(16, triton.next_power_of_2(L)), PRECISION=dot_precision(x.dtype), num_warps=num_warps,
    )


def lora_fused_decode_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b_cat: torch.Tensor,
    slice_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    groups: SlotGroups,
    y: torch.Tensor,
    store: bool = False,
    max_width: int | None = None,
    split_n: int | None = None,
    num_warps: int = 4,
) -> None:
    """Reference of lora_fused_decode (same semantics and shapes): lora_shrink_ref into a zeroed fp32 h,
    then lora_expand_ref into y (store: into a zeroed fp32 delta, then copied to y). max_width, split_n, num_warps
    ignored."""
    n, _, R, _ = a.shape
    h = torch.zeros(n, x.shape[0], R, dtype=torch.float32, device=x.device)  # [n, T, R]
    lora_shrink_ref(x, a, ranks, groups, h)
    if not store:
        lora_expand_ref(h, b_cat, slice_offsets, ranks, scaling, groups, y)
        return
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [T, O]
    lora_expand_ref(h, b_cat, slice_offsets, ranks, scaling, groups, delta)
    y.copy_(delta)
