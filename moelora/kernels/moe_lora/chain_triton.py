"""Triton kernels for routed-expert multi-LoRA over (token, k) pairs (references: moe_lora.py).

Two variants, chosen by size:
- decode (few pairs): GEMV-like, one program per (pair, slice, chunk); the shrink splits the input
  dim across programs (atomic adds into h), the expand tiles the output; rank-sized tiles, no padding
  of rows to 16, no alignment pass;
- prefill: pairs aligned by virtual expert slot * E + e (moe_lora_align), blocks of BLOCK_M pairs of one
  (adapter, expert), tiled tl.dot over the input (shrink) or the output (expand).
An expert dim of 1 in A or B is read with expert stride 0 (the shared-outer layout).
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, deterministic, dot_precision, require_triton
from moelora.kernels.moe_lora.chain import moe_lora_align, pair_virtual_experts

GEMV_MAX_PAIRS = 2048  # at most this many (token, k) pairs: the decode variant (256 tokens at top-8); H200, 8 adapters, rank 16: GEMV ~0.07 us per pair (48 us at 512), tiled 241 us at 2048

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_shrink_kernel(
        x_ptr, a_ptr, out_ptr, ranks_ptr, ids_ptr, slots_ptr,
        D, S, K,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, so_p, so_i, so_r,
        X_PER_PAIR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    ):
        p = tl.program_id(0)
        i = tl.program_id(1)
        sk = tl.program_id(2)
        t = p // K
        slot = tl.load(slots_ptr + t)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        e = tl.load(ids_ptr + p).to(tl.int64)
        if e < 0:  # another rank's expert (expert parallelism): no delta
            return
        row = p if X_PER_PAIR else t
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_d = tl.arange(0, BLOCK_D)
        a_base = a_ptr + i * sa_i + slot.to(tl.int64) * sa_s + e * sa_e
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in range(sk * BLOCK_D, D, BLOCK_D * SPLIT):
            dd = d0 + offs_d
            mask_d = dd < D
            xv = tl.load(x_ptr + row.to(tl.int64) * sxm + dd * sxd, mask=mask_d, other=0.0).to(tl.float32)
            at = tl.load(a_base + offs_r[:, None] * sa_r + dd[None, :] * sa_d, mask=mask_r[:, None] & mask_d[None, :], other=0.0)
            acc += tl.sum(at.to(tl.float32) * xv[None, :], axis=1)
        ptrs = out_ptr + p.to(tl.int64) * so_p + i * so_i + offs_r * so_r
        if SPLIT == 1:
            tl.store(ptrs, acc, mask=mask_r)
        else:
            tl.atomic_add(ptrs, acc, mask=mask_r)

    @triton.jit
    def _gemv_expand_kernel(
        h_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr,
        S, K,
        sh_p, sh_i, sh_r, sb_s, sb_e, sb_o, sb_r, syp, syo,
        HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        p = tl.program_id(0)
        i = tl.program_id(1)
        pid_n = tl.program_id(2)
        slot = tl.load(slots_ptr + p // K)
        if slot < 0:
            return
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:
            return
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        e = tl.load(ids_ptr + p).to(tl.int64)
        if e < 0:  # another rank's expert (expert parallelism): y[p] untouched
            return
        scale = tl.load(scale_ptr + i * S + slot)
        if HAS_W:
            scale = scale * tl.load(w_ptr + p).to(tl.float32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < width
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        hv = tl.load(h_ptr + p.to(tl.int64) * sh_p + i * sh_i + offs_r * sh_r, mask=mask_r, other=0.0)
        bt = tl.load(b_ptr + slot.to(tl.int64) * sb_s + e * sb_e + (o0 + offs_n[:, None]) * sb_o + offs_r[None, :] * sb_r,
                     mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        acc = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N]
        ptrs = y_ptr + p.to(tl.int64) * syp + (o0 + offs_n) * syo
        y = tl.load(ptrs, mask=mask_n, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _tiled_shrink_kernel(
        x_ptr, a_ptr, out_ptr, ranks_ptr, sorted_ptr, bvex_ptr,
        D, S, E, K, P,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, so_p, so_i, so_r,
        X_PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        i = tl.program_id(1)
        v = tl.load(bvex_ptr + b)
        if v < 0:
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rows = pairs if X_PER_PAIR else pairs // K
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_d = tl.arange(0, BLOCK_D)
        a_base = a_ptr + i * sa_i + slot.to(tl.int64) * sa_s + e * sa_e
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < D
            xt = tl.load(x_ptr + rows[:, None] * sxm + dd[None, :] * sxd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            at = tl.load(a_base + offs_r[None, :] * sa_r + dd[:, None] * sa_d, mask=mask_r[None, :] & mask_d[:, None], other=0.0)
            acc += tl.dot(xt, at, input_precision=PRECISION)
        tl.store(out_ptr + pairs[:, None] * so_p + i * so_i + offs_r[None, :] * so_r, acc,
                 mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _tiled_expand_kernel(
        h_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, sorted_ptr, bvex_ptr, w_ptr,
        S, E, P, O,
        sh_p, sh_i, sh_r, sb_s, sb_e, sb_o, sb_r, syp, syo,
        HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        i = tl.program_id(1)
        pid_n = tl.program_id(2)
        v = tl.load(bvex_ptr + b)
        if v < 0:
            return
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:
            return
        scale = tl.load(scale_ptr + i * S + slot)
        pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < width
        offs_r = tl.arange(0, BLOCK_R)
        b_base = b_ptr + slot.to(tl.int64) * sb_s + e * sb_e + (o0 + offs_n[None, :]) * sb_o
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            mask_rr = rr < rank
            ht = tl.load(h_ptr + pairs[:, None] * sh_p + i * sh_i + rr[None, :] * sh_r,
                         mask=mask_m[:, None] & mask_rr[None, :], other=0.0)
            bt = tl.load(b_base + rr[:, None] * sb_r, mask=mask_rr[:, None] & mask_n[None, :], other=0.0)
            acc += tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
        acc = acc * scale
        if HAS_W:
            acc = acc * tl.load(w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        ptrs = y_ptr + pairs[:, None] * syp + (o0 + offs_n[None, :]) * syo
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def moe_lora_plan(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int):
    """The alignment the tiled variant needs for this routing, or None when the decode variant will run.
    One plan serves the gate_up and down shrink/expand of a layer (same routing, same slots)."""
    P = topk_ids.numel()
    if _use_gemv(P, "auto"):
        return None
    align = moe_lora_align_fast if topk_ids.is_cuda else moe_lora_align
    return align(topk_ids, token_slots, num_experts, max_loras, _block_m(P))


def moe_lora_align_fast(
    topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora_align without a sort: counts per virtual expert, padded offsets, then one kernel that
    places each pair at offset[v] + atomic_add(fill[v], 1). The order of pairs inside a group is not
    fixed (it does not change any result: rows are computed independently); the groups, their
    padding and block_vexpert are exactly moe_lora_align's."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    V = max_loras * num_experts
    dev = topk_ids.device
    v = pair_virtual_experts(topk_ids, token_slots, num_experts, max_loras)  # [P]
    counts = torch.zeros(V + 1, dtype=torch.int32, device=dev).scatter_add_(0, v, torch.ones_like(v, dtype=torch.int32))
    padded = (counts[:V] + block_m - 1) // block_m * block_m
    cum = torch.cumsum(padded, 0)
    p_max = (P + min(V, P) * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((p_max,), P, dtype=torch.int32, device=dev)
    fill = torch.zeros(V, dtype=torch.int32, device=dev)
    block = 256
    _align_scatter_kernel[(triton.cdiv(P, block),)](v, cum, padded, fill, sorted_ids, P, V, BLOCK=block)
    block_start = torch.arange(0, p_max, block_m, device=dev)
    bv = torch.searchsorted(cum, block_start, right=True)
    block_vexpert = torch.where(block_start < cum[-1], bv, torch.full_like(bv, -1)).to(torch.int32)
    return sorted_ids, block_vexpert


if HAS_TRITON:

    @triton.jit
    def _align_scatter_kernel(v_ptr, cum_ptr, padded_ptr, fill_ptr, out_ptr, P, V, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < P
        v = tl.load(v_ptr + offs, mask=mask, other=V)
        valid = mask & (v < V)
        vc = tl.where(valid, v, 0)
        start = tl.load(cum_ptr + vc, mask=valid, other=0) - tl.load(padded_ptr + vc, mask=valid, other=0)
        pos = tl.atomic_add(fill_ptr + vc, 1, mask=valid)
        tl.store(out_ptr + start + pos, offs.to(tl.int32), mask=valid)


def _a_strides(a: torch.Tensor) -> tuple[int, ...]:
    """[n, S, E|1, R, D]; an expert dim of 1 is read with stride 0 (shared outer)."""
    return a.stride(0), a.stride(1), 0 if a.shape[2] == 1 else a.stride(2), a.stride(3), a.stride(4)


def _b_strides(b: torch.Tensor) -> tuple[int, ...]:
    """[S, E|1, O, R]."""
    return b.stride(0), 0 if b.shape[1] == 1 else b.stride(1), b.stride(2), b.stride(3)


def _use_gemv(num_pairs: int, variant: str) -> bool:
    if variant not in ("auto", "gemv", "tiled"):
        raise ValueError(f"variant {variant!r}: use 'auto', 'gemv' or 'tiled'")
    return variant == "gemv" or (variant == "auto" and num_pairs <= GEMV_MAX_PAIRS)


def _block_m(num_pairs: int) -> int:
    return 16 if num_pairs <= 512 else 32


def moe_lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    num_experts: int,
    out: torch.Tensor,
    x_per_pair: bool,
    variant: str = "auto",
    align: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Semantics:
        for p in range(T * K): t, e, s = p // K, topk_ids.flatten()[p], token_slots[p // K]
            if s >= 0: for i: r = ranks[i, s]; out[p, i, :r] = row @ a[i, s, e (0 if shared), :r].T
                       with row = x[p] if x_per_pair else x[t]          (other entries untouched)
    x: [T, D] or [T*K, D] · a: [n, S, E|1, R, D] · ranks: [n, S] int32 · topk_ids: [T, K] int · token_slots: [T] int32
    num_experts: E of the model (virtual expert = slot * E + e)
    out: [T*K, n, R] fp32, zero-filled by the caller · variant: "auto" | "gemv" | "tiled"
    align: moe_lora_align(...) output for the tiled variant (computed here when None)
    """
    require_triton()
    n, S, _, R, D = a.shape
    T, K = topk_ids.shape
    P = T * K
    ids = topk_ids.reshape(-1)
    block_r = max(16, triton.next_power_of_2(R))
    if _use_gemv(P, variant):
        block_d = 128 if D >= 128 else max(16, triton.next_power_of_2(D))
        split = 1 if deterministic() else max(1, min(16, D // (block_d * 2)))
        _gemv_shrink_kernel[(P, n, split)](
            x, a, out, ranks, ids, token_slots, D, S, K,
            x.stride(0), x.stride(1), *_a_strides(a), out.stride(0), out.stride(1), out.stride(2),
            X_PER_PAIR=x_per_pair, BLOCK_R=block_r, BLOCK_D=block_d, SPLIT=split,
        )
        return
    bm = _block_m(P)
    sorted_ids, bvex = align if align is not None else moe_lora_align(topk_ids, token_slots, num_experts, S, bm)
    block_d = 64 if D >= 64 else max(16, triton.next_power_of_2(D))
    _tiled_shrink_kernel[(bvex.shape[0], n)](
        x, a, out, ranks, sorted_ids, bvex, D, S, num_experts, K, P,
        x.stride(0), x.stride(1), *_a_strides(a), out.stride(0), out.stride(1), out.stride(2),
        X_PER_PAIR=x_per_pair, BLOCK_M=bm, BLOCK_R=block_r, BLOCK_D=block_d, PRECISION=dot_precision(x.dtype),
    )


def moe_lora_expand(
    h: torch.Tensor,
    b_cat: torch.Tensor,
    slice_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    num_experts: int,
    y: torch.Tensor,
    pair_weights: torch.Tensor | None = None,
    variant: str = "auto",
    align: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Semantics (slice i owns columns o_i = slice_offsets[i]:slice_offsets[i+1]):
        for p in range(T * K): e, s = topk_ids.flatten()[p], token_slots[p // K]
            if s >= 0: for i with r = ranks[i, s] > 0:
                y[p, o_i] += w[p] * scaling[i, s] * h[p, i, :r] @ b_cat[s, e (0 if shared), o_i, :r].T
        w = pair_weights (the router weights, [T*K]) or 1
    h: [T*K, n, R] fp32 · b_cat: [S, E|1, O, R] · slice_offsets: [n+1] int32 · ranks, scaling: [n, S]
    y: [T*K, O] updated in place · variant, align: as in moe_lora_shrink
    """
    require_triton()
    P, n, R = h.shape
    S, _, O, _ = b_cat.shape
    T, K = topk_ids.shape
    ids = topk_ids.reshape(-1)
    w = pair_weights if pair_weights is not None else h
    block_n = 128 if O >= 128 else max(16, triton.next_power_of_2(O))
    block_r = max(16, triton.next_power_of_2(R))
    if _use_gemv(P, variant):
        _gemv_expand_kernel[(P, n, triton.cdiv(O, block_n))](
            h, b_cat, y, slice_offsets, ranks, scaling, ids, token_slots, w, S, K,
            h.stride(0), h.stride(1), h.stride(2), *_b_strides(b_cat), y.stride(0), y.stride(1),
            HAS_W=pair_weights is not None, BLOCK_R=block_r, BLOCK_N=block_n,
        )
        return
    bm = _block_m(P)
    sorted_ids, bvex = align if align is not None else moe_lora_align(topk_ids, token_slots, num_experts, S, bm)
    _tiled_expand_kernel[(bvex.shape[0], n, triton.cdiv(O, 64))](
        h, b_cat, y, slice_offsets, ranks, scaling, sorted_ids, bvex, w, S, num_experts, P, O,
        h.stride(0), h.stride(1), h.stride(2), *_b_strides(b_cat), y.stride(0), y.stride(1),
        HAS_W=pair_weights is not None, BLOCK_M=bm, BLOCK_N=64, BLOCK_R=16, PRECISION=dot_precision(b_cat.dtype),
    )
