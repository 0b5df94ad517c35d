"""Two-pass grouped kernel for routed-expert multi-LoRA: the (slot, expert) groups of moe_lora_grouped, with the
shrink split over the input dim (reference: moe_lora_fused_ref, the same semantics; launched by
moe_lora_grouped_triton.moe_lora_grouped when its config has d_chunk > 0).

Why: the one-launch grouped kernel gives each group block one program that streams the whole A[i, s, e]
(64 KiB for a gate_up slice at rank 16) before it can start its expand, so at decode sizes (a few hundred groups)
each SM holds a few long dependent chains and the kernel reaches ~2 TB/s on the H200 (session 9: 32 µs for
59 MB at 64 tokens, 43 µs for 89 MB at 256). Here:
    pass 1 (shrink), one program per (group block, slice i, input chunk j of D_CHUNK):
        h_part[j, rows, i, :] = X[rows, chunk j] @ A[i, s, e, :r, chunk j].T      (fp32, tl.dot, pipelined loads)
    pass 2 (expand), one program per (group block, slice i, output tile):
        hv = (sum over j in order 0, 1, ... of h_part[j, rows, i, :]) * scaling[i, s] (* router weight)
        y[rows, tile] (+)= hv @ B[s, e, tile, :r].T                                (hi/lo split as moe_lora_grouped)
so every program does a few loads and the whole grid is in flight at once. The partials are summed in a fixed
order (no atomics): results are deterministic and graph replays are bit-equal to eager runs. A pass-1 program
writes only the rows of its own block, and pass 2 reads only those, so h_part needs no zero-fill; slices of
rank 0 skip pass 1 and pass 2 treats them as h = 0 (store mode writes their zeros). Store mode's zero programs
(rows of tokens without an adapter) are pass 2's, as in moe_lora_grouped.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON
from moelora.kernels.moe_lora_triton import _a_strides, _b_strides

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.moe_lora_grouped_triton import grouped_expand_tiles, grouped_zero_rows

    @triton.jit
    def _grouped_shrink_kernel(
        x_ptr, a_ptr, h_ptr, ranks_ptr, sorted_ptr, bvex_ptr,
        D, S, E, K, P,
        sxm, sxd, sa_i, sa_s, sa_e, sa_r, sa_d, sh_j, sh_p, sh_i,
        X_PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        D_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        i = tl.program_id(1)
        j = tl.program_id(2)
        v = tl.load(bvex_ptr + pid)  # the block's virtual expert v = slot * E + e
        if v < 0:  # a block past the last group
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if rank == 0:  # pass 2 takes h = 0 for this slice without reading it
            return
        offs_m = tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + pid * BLOCK_M + offs_m)
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rows = pairs if X_PER_PAIR else pairs // K
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_d = tl.arange(0, BLOCK_D)
        a_base = a_ptr + i.to(tl.int64) * sa_i + slot.to(tl.int64) * sa_s + e * sa_e
        acc_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D_CHUNK, BLOCK_D):  # a static trip count: the loads are pipelined
            dd = j * D_CHUNK + d0 + offs_d
            mask_d = dd < D
            at = tl.load(a_base + offs_r[None, :] * sa_r + dd[:, None] * sa_d, mask=mask_r[None, :] & mask_d[:, None],
                         other=0.0)  # [BLOCK_D, BLOCK_R]
            xt = tl.load(x_ptr + rows[:, None] * sxm + dd[None, :] * sxd, mask=mask_m[:, None] & mask_d[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_D]
            acc_h += tl.dot(xt.to(at.dtype), at, input_precision=PRECISION)
        tl.store(h_ptr + j * sh_j + pairs[:, None] * sh_p + i * sh_i + offs_r[None, :], acc_h, mask=mask_m[:, None])

    @triton.jit
    def _grouped_expand_kernel(
        h_ptr, b_ptr, y_ptr, off_ptr, ranks_ptr, scale_ptr, ids_ptr, slots_ptr, w_ptr, sorted_ptr, bvex_ptr,
        S, E, K, P, NUM_BLOCKS,
        sh_j, sh_p, sh_i, sb_s, sb_e, sb_o, sb_r, syp, syo,
        NUM_J: tl.constexpr, HAS_W: tl.constexpr, STORE: tl.constexpr, SPLIT_HV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        i = tl.program_id(1)
        pid_n = tl.program_id(2)
        o0 = tl.load(off_ptr + i)
        width = tl.load(off_ptr + i + 1) - o0
        if pid_n * BLOCK_N >= width:  # a split past this slice's width (a narrower slice)
            return
        if pid >= NUM_BLOCKS:  # store mode only: zeros for the rows of tokens without an adapter
            grouped_zero_rows(y_ptr, slots_ptr, ids_ptr, pid - NUM_BLOCKS, pid_n, o0, width, K, P, syp, syo,
                              BLOCK_M, BLOCK_N, SPLIT_N)
            return
        v = tl.load(bvex_ptr + pid)
        if v < 0:
            return
        slot = v // E
        e = (v % E).to(tl.int64)
        rank = tl.load(ranks_ptr + i * S + slot)
        if not STORE:
            if rank == 0:  # add mode: slices of rank 0 stay untouched
                return
        offs_m = tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + pid * BLOCK_M + offs_m)
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        mask_h = mask_m[:, None] & mask_r[None, :]  # rank 0 (store mode): nothing read, h = 0, zeros written
        h_rows = h_ptr + pairs[:, None] * sh_p + i * sh_i + offs_r[None, :]
        hv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for j in tl.static_range(NUM_J):  # the partials in order: deterministic
            hv += tl.load(h_rows + j * sh_j, mask=mask_h, other=0.0)
        hv = hv * tl.load(scale_ptr + i * S + slot)
        if HAS_W:
            hv = hv * tl.load(w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        grouped_expand_tiles(hv, b_ptr + slot.to(tl.int64) * sb_s + e * sb_e, y_ptr + pairs[:, None] * syp, mask_m,
                             offs_r, mask_r, o0, width, pid_n, sb_o, sb_r, syo, STORE, SPLIT_HV, BLOCK_N, SPLIT_N)


def grouped_two_pass(x, a, b_cat, y, slice_offsets, ranks, scaling, ids, token_slots, w, sorted_ids, bvex,
                     num_experts: int, top_k: int, x_per_pair: bool, has_w: bool, store: bool, block_m: int, block_r: int,
                     block_d: int, d_chunk: int, block_n: int, split_n: int, num_warps: int, num_stages: int) -> None:
    """Launch pass 1 and pass 2 (moe_lora_grouped checked the arguments and chose the tiles).
    top_k: K of the batch · x: [T, D] or [P, D] · a: [n, S, E|1, R, D] · b_cat: [S, E|1, O, R] · y: [P, O] · ids: [P] · sorted_ids,
    bvex: grouped_align's · w: [P] router weights (or any fp32 tensor when not has_w) · block_r >= R, a power of
    two · d_chunk: input columns per pass-1 program (a multiple of block_d) · split_n: output splits per (block,
    slice) in pass 2. h_part: [cdiv(D, d_chunk), P, n, block_r] fp32, made here."""
    n, S, _, _, D = a.shape
    P = ids.numel()
    nb = bvex.shape[0]
    num_j = triton.cdiv(D, d_chunk)
    h = torch.empty(num_j, P, n, block_r, dtype=torch.float32, device=x.device)
    f32 = b_cat.dtype == torch.float32
    _grouped_shrink_kernel[(nb, n, num_j)](
        x, a, h, ranks, sorted_ids, bvex, D, S, num_experts, top_k, P,
        x.stride(0), x.stride(1), *_a_strides(a), h.stride(0), h.stride(1), h.stride(2),
        X_PER_PAIR=x_per_pair, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_D=block_d, D_CHUNK=d_chunk,
        PRECISION="ieee" if f32 else None, num_warps=num_warps, num_stages=num_stages,
    )
    zero_blocks = triton.cdiv(P, block_m) if store else 0
    _grouped_expand_kernel[(nb + zero_blocks, n, split_n)](
        h, b_cat, y, slice_offsets, ranks, scaling, ids, token_slots, w, sorted_ids, bvex,
        S, num_experts, top_k, P, nb,
        h.stride(0), h.stride(1), h.stride(2), *_b_strides(b_cat), y.stride(0), y.stride(1),
        NUM_J=num_j, HAS_W=has_w, STORE=store, SPLIT_HV=not f32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, SPLIT_N=split_n, num_warps=num_warps,
    )
