"""The dense multi-LoRA delta as a tensor of its own, for a consumer kernel to add (DenseLoRAConfig.defer;
reference: lora_delta_ref below).

The deferred form of a dense LoRA layer: its shrink and this expand run on the side stream beside the base GEMM
(the GEMM itself plain, without a LoRA epilogue), and the kernel that reads the GEMM's output next adds the
delta as it loads it — qk_norm_rope for qkv_proj, the post-attention RMSNorm for o_proj — so neither stream has
an add launch or a zero-fill. The expand here writes every row (0 for rows without an adapter), so its output
needs no zero-fill either. One program per (row block, column tile): the tile's slice, the rows' slots, ranks
and scalings, then the batch's slot groups' B stacked [G x R, BLOCK_N] and the rows' h placed in their group's
columns, one dot (tiles_triton.lora_prefetch_tile / lora_prefetched_expand, as the FP8 GEMM's prefetched epilogue).
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, pdl_args, require_triton
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.shrink_expand import lora_expand_ref
from moelora.kernels.lora.tiles_triton import PREFETCH_MAX_GROUPS, lora_prefetch_tile, lora_prefetched_expand

DELTA_MAX_GROUPS = PREFETCH_MAX_GROUPS  # at most this many slot groups (max_loras): B of all of them in one dot
DELTA_BLOCK_N = 64  # column tile; every slice boundary must be a multiple of it (delta_ok)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    @triton.jit
    def _lora_delta_kernel(h_ptr, b_ptr, d_ptr, off_ptr, ranks_ptr, scale_ptr, slots_ptr, act_ptr, T, O, S, L,
                           sh_s, sh_i, sh_m, sh_r, sb_s, sb_o, sb_r, sdm, sdo,
                           N_SLICES: tl.constexpr, SK: tl.constexpr, BR: tl.constexpr, G: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                           EVEN_R: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = rows < T
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < O
        i0, row_slot, rank_rows, scale_rows, slot_g, rank_g = lora_prefetch_tile(
            rows, mask_m, pid_n * BLOCK_N, off_ptr, ranks_ptr, scale_ptr, slots_ptr, act_ptr, S, L, N_SLICES, BR, G)
        acc = lora_prefetched_expand(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), rows, offs_n, mask_n, i0, row_slot, rank_rows,
            scale_rows, slot_g, rank_g, h_ptr, b_ptr, sh_s, sh_i, sh_m, sh_r, sb_s, sb_o, sb_r, BLOCK_M, BLOCK_N,
            SK, BR, G, PRECISION, EVEN_R, False)
        tl.store(d_ptr + rows[:, None] * sdm + offs_n[None, :] * sdo, acc.to(d_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


def delta_ok(slice_bounds: tuple[int, ...], num_groups: int) -> bool:
    """Whether lora_delta serves a layer: every slice boundary on a DELTA_BLOCK_N column tile boundary (a tile in one
    slice) and at most DELTA_MAX_GROUPS slot groups (max_loras)."""
    return 0 < num_groups <= DELTA_MAX_GROUPS and all(o % DELTA_BLOCK_N == 0 for o in slice_bounds[1:-1])


def _block_m(T: int) -> int:
    return 16 if T <= 16 else (32 if T <= 128 else 64)


def lora_delta(h: torch.Tensor, b_cat: torch.Tensor, slice_offsets: torch.Tensor, slice_bounds: tuple[int, ...],
               ranks: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor, active_slots: torch.Tensor,
               delta: torch.Tensor, num_warps: int = 0) -> None:
    """Semantics (lora_delta_ref; slice i owns columns o_i = slice_offsets[i] : slice_offsets[i+1]):
        delta[t, o_i] = scaling[i, s] * (round_B(sum_k h[k, i, t, :r]) @ b_cat[s, o_i, :r].T)   s = token_slots[t] >= 0,
                                                                                           r = ranks[i, s] > 0
        delta[t, o_i] = 0 otherwise (rows of slot -1, slices of rank 0): every entry written, rounded once
    h: [split_k, n, T, R] fp32 (the shrink's partials) · b_cat: [S, O, R] · slice_offsets: [n+1] int32 (slice_bounds:
    the same on the host) · ranks, scaling: [n, S] · token_slots: [T] int32 · active_slots: [L] int32 (the slot of
    each slot group, -1 unused; every slot of token_slots among them) · delta: [T, O] (x's dtype), any contents
    num_warps: per program (0: Triton's 4; the deferred chain's 8). The same sums either way.
    """
    require_triton()
    sk, n, T, R = h.shape
    S, O, Rb = b_cat.shape
    L = active_slots.shape[0]
    if tuple(delta.shape) != (T, O) or Rb != R or len(slice_bounds) != n + 1 or slice_bounds[-1] != O:
        raise ValueError(f"lora_delta: expected delta [{T}, {O}] and b_cat [S, {O}, {R}] over {n} slices ending at "
                         f"{O}; found delta {tuple(delta.shape)}, b_cat {tuple(b_cat.shape)}, slice bounds "
                         f"{list(slice_bounds)}")
    if not delta_ok(slice_bounds, L):
        raise ValueError(f"lora_delta: needs slice bounds on multiples of {DELTA_BLOCK_N} and 1..{DELTA_MAX_GROUPS} slot "
                         f"groups, found bounds {list(slice_bounds)} and {L} groups (use lora_expand)")
    br = max(16, triton.next_power_of_2(R))
    bm, bn = _block_m(T), DELTA_BLOCK_N
    if T:
        _lora_delta_kernel[(triton.cdiv(T, bm), triton.cdiv(O, bn))](
            h, b_cat, delta, slice_offsets, ranks, scaling, token_slots, active_slots, T, O, S, L,
            h.stride(0), h.stride(1), h.stride(2), h.stride(3), b_cat.stride(0), b_cat.stride(1), b_cat.stride(2),
            delta.stride(0), delta.stride(1),
            N_SLICES=n, SK=sk, BR=br, G=triton.next_power_of_2(L), BLOCK_M=bm, BLOCK_N=bn,
            PRECISION=dot_precision(b_cat.dtype), EVEN_R=R == br, **({"num_warps": num_warps} if num_warps else {}), **pdl_args(h.device))


def lora_delta_ref(h: torch.Tensor, b_cat: torch.Tensor, slice_offsets: torch.Tensor, ranks: torch.Tensor,
                   scaling: torch.Tensor, groups: SlotGroups, dtype: torch.dtype) -> torch.Tensor:
    """lora_delta's semantics in torch: [T, O] of dtype, the summed partials rounded to B's dtype (as the kernel's
    dot takes them), then lora_expand_ref into fp32 zeros, rounded once."""
    hs = h.sum(0).to(b_cat.dtype).float()  # [n, T, R]
    y = torch.zeros(hs.shape[1], b_cat.shape[1], dtype=torch.float32, device=h.device)
    lora_expand_ref(hs, b_cat, slice_offsets, ranks, scaling, groups, y)
    return y.to(dtype)
