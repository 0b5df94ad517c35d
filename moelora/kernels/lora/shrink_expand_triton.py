"""Triton kernels for dense multi-LoRA (SGMV style): one launch covers every slot of the batch.

Grid axis 2 walks the slot groups of SlotGroups (fixed size max_loras, so the launch is the same
for every batch and CUDA-graph safe); a program whose group is unused, or whose row block lies past
its group's token count, or whose rank tile lies past the slot's true rank, exits at once.
References with the same signatures: kernels/lora/shrink_expand.py.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, pdl_args, require_triton
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.tiles_triton import lora_b_tile

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, out_ptr, ranks_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr,
        H, R, S,
        sxm, sxk, sa_i, sa_s, sa_r, sa_k, so_s, so_i, so_m, so_r,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        PRECISION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        if LAUNCH_DEPENDENTS:  # the next kernel (launched with PDL) may start now; it waits before reading out
            tl.extra.cuda.gdc_launch_dependents()
        pid_mr = tl.program_id(0)
        pid_isk = tl.program_id(1)
        group = tl.program_id(2)
        slot = tl.load(active_ptr + group)
        if slot < 0:
            return
        count = tl.load(count_ptr + group)
        n_rb = tl.cdiv(R, BLOCK_R)
        pid_m = pid_mr // n_rb
        pid_r = pid_mr % n_rb
        if pid_m * BLOCK_M >= count:
            return
        i = pid_isk // SPLIT_K
        sk = pid_isk % SPLIT_K
        rank = tl.load(ranks_ptr + i * S + slot)
        if pid_r * BLOCK_R >= rank:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(sorted_ptr + tl.load(start_ptr + group) + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + i * sa_i + slot.to(tl.int64) * sa_s
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(sk * BLOCK_K, H, BLOCK_K * SPLIT_K):
            kk = k0 + offs_k
            mask_k = kk < H
            xt = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_base + offs_r[None, :] * sa_r + kk[:, None] * sa_k, mask=mask_r[None, :] & mask_k[:, None], other=0.0)
            acc += tl.dot(xt, at, input_precision=PRECISION)
        # split sk stores its partial sum in out[sk] (no atomics, no zero-filled buffer; the expand adds them)
        ptrs = out_ptr + sk * so_s + i * so_i + rows[:, None] * so_m + offs_r[None, :] * so_r
        tl.store(ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _expand_kernel(
        h_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr,
        O, S,
        sh_s, sh_i, sh_m, sh_r, sb_s, sb_o, sb_r, sym, syo,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
        PRECISION: tl.constexpr, EVEN_R: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        pid_mn = tl.program_id(0)
        i = tl.program_id(1)
        group = tl.program_id(2)
        slot = tl.load(active_ptr + group)
        if slot < 0:
            return
        count = tl.load(count_ptr + group)
        n_nb = tl.cdiv(O, BLOCK_N)
        pid_m = pid_mn // n_nb
        pid_n = pid_mn % n_nb
        if pid_m * BLOCK_M >= count:
            return
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:
            return
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        scale = tl.load(scale_ptr + i * S + slot)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(sorted_ptr + tl.load(start_ptr + group) + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < width
        offs_r = tl.arange(0, BLOCK_R)
        b_base = b_ptr + slot.to(tl.int64) * sb_s + (o0 + offs_n[None, :]) * sb_o
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            mask_rr = rr < rank
            h_ptrs = h_ptr + i * sh_i + rows[:, None] * sh_m + rr[None, :] * sh_r
            # EVEN_R (the buffers' rank a multiple of BLOCK_R): h and B masked by row / column only, so the loads
            # along the contiguous rank dim are vectorized, and the entries past the slot's rank zeroed after
            # them (a per-element rank mask made them 2-byte loads); the same values
            if EVEN_R:
                mask_h = mask_m[:, None]
            else:
                mask_h = mask_m[:, None] & mask_rr[None, :]
            ht = tl.load(h_ptrs, mask=mask_h, other=0.0)
            for sk in range(1, SPLIT_K):  # the shrink's split-K partial sums, added in a fixed order
                ht += tl.load(h_ptrs + sk * sh_s, mask=mask_h, other=0.0)
            if EVEN_R:
                ht = tl.where(mask_rr[None, :], ht, 0.0)
            bt = lora_b_tile(b_base + rr[:, None] * sb_r, mask_rr, mask_n, EVEN_R)
            acc += tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
        ptrs = y_ptr + rows[:, None] * sym + (o0 + offs_n[None, :]) * syo
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)


SHRINK_SPLIT_MAX_TOKENS = 256  # lora_shrink splits K up to this many tokens (decode batches)
# lora_expand's (block_m, block_n, num_warps) above SHRINK_SPLIT_MAX_TOKENS tokens: bf16 prefill with 4 adapters kept
# 73.2% of the no-adapter throughput against 71.1% at the decode tile (64 x 64, 4 warps)
EXPAND_PREFILL_TILE = (128, 64, 4)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else (32 if num_tokens <= 64 else 64)


def _block_k(H: int, num_tokens: int | None = None, decode_block_k: int = 0) -> int:
    """The shrink's K tile: decode_block_k at decode sizes when given (the deferred shrink's), else 64; at most H's
    next power of two."""
    if decode_block_k and num_tokens is not None and num_tokens <= SHRINK_SPLIT_MAX_TOKENS:
        return min(decode_block_k, max(16, triton.next_power_of_2(H)))
    return 64 if H >= 64 else max(16, triton.next_power_of_2(H))


def lora_shrink_splits(num_tokens: int, H: int) -> int:
    """Split-K factor of lora_shrink for T tokens and input width H: decode batches (<= 256 tokens) split the input
    dim, up to 8 splits of >= 4 K tiles each, so that enough programs share the K loop (each (slot group, row
    block, slice) program otherwise walks all of H serially: 19 us a call at 256 tokens on the H200); else 1."""
    if not HAS_TRITON or num_tokens > SHRINK_SPLIT_MAX_TOKENS:
        return 1
    return max(1, min(8, H // (_block_k(H) * 4)))


def lora_shrink_buffer(n: int, num_tokens: int, R: int, H: int, device: torch.device | str,
                       max_splits: int = 0) -> torch.Tensor:
    """The shrink's output for lora_shrink / lora_expand: [split_k, n, T, R] fp32, uninitialised (every entry the
    expand reads is written by the shrink; split_k = lora_shrink_splits on a GPU, 1 elsewhere, at most max_splits
    when > 0; the shrink takes split_k from the buffer)."""
    splits = lora_shrink_splits(num_tokens, H) if torch.device(device).type == "cuda" else 1
    if max_splits > 0:
        splits = min(splits, max_splits)
    return torch.empty(splits, n, num_tokens, R, dtype=torch.float32, device=device)


def _as_parts(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(0)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, groups: SlotGroups, out: torch.Tensor,
                launch_dependents: bool = False, block_k: int = 0) -> None:
    """Semantics (out [n, T, R] is out[0] of a [1, n, T, R] one):
        for i in range(n): for t in range(T):
            s = token_slots[t]
            if s >= 0: sum_k out[k, i, t, :ranks[i, s]] = x[t] @ a[i, s, :ranks[i, s]].T   (other entries untouched)
        split k of out.shape[0] stores the partial sum over its share of the input dim (lora_expand adds them)
    x: [T, H] · a: [n, S, R, H] · ranks: [n, S] int32 · groups: tokens grouped by slot
    out: [split_k, n, T, R] or [n, T, R] fp32, any contents (lora_shrink_buffer makes one)
    launch_dependents: every program first lets the next kernel start (programmatic dependent launch, sm_90+:
    that kernel is launched with launch_pdl and waits for this grid before it reads out; a no-op otherwise)
    block_k: the K tile at decode sizes (<= SHRINK_SPLIT_MAX_TOKENS tokens; 0: 64). It sets which K steps each
    split sums (split sk takes the tiles sk, sk + split_k, ...), so the fp32 partials, not what they sum to, depend
    on it.
    """
    require_triton()
    n, S, R, H = a.shape
    T = x.shape[0]
    parts = _as_parts(out)
    split_k = parts.shape[0]
    L = groups.active_slots.shape[0]
    bm = _block_m(T)
    block_r = max(16, min(64, triton.next_power_of_2(R)))
    grid = (triton.cdiv(T, bm) * triton.cdiv(R, block_r), n * split_k, L)
    _shrink_kernel[grid](
        x, a, parts, ranks, groups.sorted_token_ids, groups.active_slots, groups.slot_counts, groups.slot_starts,
        H, R, S,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3),
        BLOCK_M=bm, BLOCK_R=block_r, BLOCK_K=_block_k(H, T, block_k), SPLIT_K=split_k, PRECISION=dot_precision(x.dtype),
        **({"LAUNCH_DEPENDENTS": True} if launch_dependents else {}), **pdl_args(x.device),
    )


def lora_expand(
    h: torch.Tensor,
    b_cat: torch.Tensor,
    slice_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    groups: SlotGroups,
    y: torch.Tensor,
) -> None:
    """Semantics (slice i owns columns o_i = slice_offsets[i] : slice_offsets[i+1] of y and rows o_i of b_cat;
    hs = h.sum(0) for the shrink's [split_k, n, T, R] partials, hs = h for [n, T, R]):
        for i in range(n): for t in range(T):
            s = token_slots[t]; r = ranks[i, s]
            if s >= 0 and r > 0: y[t, o_i] += scaling[i, s] * (hs[i, t, :r] @ b_cat[s, o_i, :r].T)
    h: [split_k, n, T, R] or [n, T, R] fp32 · b_cat: [S, O, R] · slice_offsets: [n+1] int32 · ranks: [n, S] int32
    scaling: [n, S] fp32 · groups: tokens grouped by slot · y: [T, O] updated in place
    """
    require_triton()
    h = _as_parts(h)
    _, n, T, R = h.shape
    S, O, _ = b_cat.shape
    L = groups.active_slots.shape[0]
    bm = _block_m(T)
    block_n = 64 if O >= 64 else max(16, triton.next_power_of_2(O))
    warps = {}
    if T > SHRINK_SPLIT_MAX_TOKENS:
        bm, bn, w = EXPAND_PREFILL_TILE
        block_n, warps = min(bn, max(16, triton.next_power_of_2(O))), {"num_warps": w}
    block_r = 16
    grid = (triton.cdiv(T, bm) * triton.cdiv(O, block_n), n, L)
    _expand_kernel[grid](
        h, b_cat, y, slice_offsets, ranks, scaling, groups.sorted_token_ids, groups.active_slots,
        groups.slot_counts, groups.slot_starts,
        O, S,
        h.stride(0), h.stride(1), h.stride(2), h.stride(3), b_cat.stride(0), b_cat.stride(1), b_cat.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=h.shape[0], PRECISION=dot_precision(b_cat.dtype),
        EVEN_R=R % block_r == 0 and b_cat.shape[2] == R, **warps, **pdl_args(h.device),
    )
