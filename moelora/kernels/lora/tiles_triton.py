"""The dense multi-LoRA expand as @triton.jit tiles for other kernels' epilogues: the FP8 GEMM's (kernels/quant/
fp8_triton.py, dense and grouped-expert), the deferred delta kernel's (delta_triton.py) and lora_expand's B tile.
Semantics: kernels/lora/shrink_expand.py's lora_expand_ref, on one [BLOCK_M, BLOCK_N] tile, added in fp32."""

from __future__ import annotations

from moelora.kernels._triton import HAS_TRITON

PREFETCH_MAX_GROUPS = 8  # the stacked one-dot expand (lora_prefetched_expand) serves at most this many slot groups

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def lora_b_tile(ptrs, mask_r, col_in, EVEN_R: tl.constexpr):
        """B tile [BR, BN] (rank along dim 0, contiguous), 0 past the rank (mask_r [BR]) and outside col_in [BN];
        EVEN_R: loaded masked by column only (vectorized along the rank: 16-byte loads instead of the 2-byte ones a
        per-element rank mask makes), the rank mask applied after the load; the same values. Rank 0 (mask_r all
        false: a slot without this module, an unused slot group) loads nothing in both forms."""
        if EVEN_R:  # (the rank count compared as a vector: the interpreter takes no scalar in a mask)
            n_live = tl.sum(mask_r.to(tl.int32), axis=0)
            col_live = col_in & (tl.zeros_like(col_in.to(tl.int32)) < n_live)
            bt = tl.where(mask_r[:, None], tl.load(ptrs, mask=col_live[None, :], other=0.0), 0.0)
        else:
            bt = tl.load(ptrs, mask=mask_r[:, None] & col_in[None, :], other=0.0)
        return bt

    @triton.jit
    def lora_expand_tile(acc, rows, mask_m, offs_n, mask_n, lh_ptr, lb_ptr, loff_ptr, lrank_ptr, lscale_ptr,
                         lslot_ptr, lact_ptr, S, L, slh_s, slh_i, slh_m, slh_r, slb_s, slb_o, slb_r,
                         LORA_N: tl.constexpr, LORA_SK: tl.constexpr, LORA_BR: tl.constexpr,
                         LORA_PRECISION: tl.constexpr, UNROLLED: tl.constexpr, EVEN_R: tl.constexpr = False):
        """acc [BLOCK_M, BLOCK_N] fp32 + the dense multi-LoRA expand of rows `rows`, columns offs_n (lora_expand's
        semantics): acc[t, o_i] += scaling[i, s] * (sum_k lh[k, i, t, :r] rounded to B's dtype) @ lb[s, o_i, :r].T
        for rows t of slot s = lslot[t] >= 0, r = ranks[i, s] > 0. Every row's h (the shrink's LORA_SK split-K
        partials summed) is loaded once per slice, before the slots, which then load only B.
        UNROLLED == 0: a loop over all S slots, each skipped unless some row has it (lact unused). UNROLLED > 0:
        the batch's L slot groups (lact [L]: the slot of group l, -1 unused), the first UNROLLED unrolled without
        branches (their slot, rank, scaling and B loads all independent, so they are in flight together; a group
        whose slot is -1 or absent from these rows adds an exact 0), the rest in that loop.
        EVEN_R (the buffers' rank == LORA_BR): h and B loaded masked by row / column only, so the loads along the
        contiguous rank dim are vectorized, and the entries past each rank zeroed after the load (a per-element
        rank mask made them 2-byte loads); the same values."""
        row_slot = tl.load(lslot_ptr + rows, mask=mask_m, other=-1)  # [BLOCK_M]
        has = mask_m & (row_slot >= 0)
        offs_r = tl.arange(0, LORA_BR)
        if UNROLLED > 0:
            loop_hi = L
        else:
            loop_hi = S
        for i in tl.static_range(LORA_N):
            o0 = tl.load(loff_ptr + i)
            col_in = mask_n & (offs_n >= o0) & (offs_n < tl.load(loff_ptr + i + 1))  # [BLOCK_N]
            if tl.max(col_in.to(tl.int32), axis=0) > 0:  # this tile meets slice i
                # every row's h once: its slot's rank masks the columns (entries past it are never written)
                rank_rows = tl.load(lrank_ptr + i * S + tl.maximum(row_slot, 0), mask=has, other=0)  # [BLOCK_M]
                mask_hr = offs_r[None, :] < rank_rows[:, None]
                hr_ptrs = lh_ptr + i * slh_i + rows[:, None] * slh_m + offs_r[None, :] * slh_r
                if EVEN_R:
                    mask_h = has[:, None]
                else:
                    mask_h = mask_hr
                h_all = tl.load(hr_ptrs, mask=mask_h, other=0.0)
                for part in tl.static_range(1, LORA_SK):  # the shrink's split-K partials, in order
                    h_all += tl.load(hr_ptrs + part * slh_s, mask=mask_h, other=0.0)
                if EVEN_R:
                    h_all = tl.where(mask_hr, h_all, 0.0)
                for g in tl.static_range(UNROLLED):
                    slot = tl.load(lact_ptr + g)
                    slot_c = tl.maximum(slot, 0)
                    rank = tl.where(slot >= 0, tl.load(lrank_ptr + i * S + slot_c), 0)
                    bt = lora_b_tile(lb_ptr + slot_c * slb_s + offs_n[None, :] * slb_o + offs_r[:, None] * slb_r,
                                     offs_r < rank, col_in, EVEN_R)  # [BR, BN]
                    ht = tl.where((row_slot == slot)[:, None], h_all, 0.0)
                    acc += tl.dot(ht.to(bt.dtype), bt, input_precision=LORA_PRECISION) * tl.load(
                        lscale_ptr + i * S + slot_c)
                for g in range(UNROLLED, loop_hi):
                    if UNROLLED > 0:
                        slot = tl.load(lact_ptr + g)
                    else:
                        slot = g
                    row_in = row_slot == slot
                    rank = tl.load(lrank_ptr + i * S + tl.maximum(slot, 0))
                    if (slot >= 0) & (tl.max(row_in.to(tl.int32), axis=0) > 0) & (rank > 0):
                        mask_r = offs_r < rank
                        bt = lora_b_tile(lb_ptr + slot * slb_s + offs_n[None, :] * slb_o + offs_r[:, None] * slb_r,
                                         mask_r, col_in, EVEN_R)  # [BR, BN]
                        ht = tl.where(row_in[:, None], h_all, 0.0)
                        acc += tl.dot(ht.to(bt.dtype), bt, input_precision=LORA_PRECISION) * tl.load(
                            lscale_ptr + i * S + slot)
        return acc

    @triton.jit
    def lora_prefetch_tile(rows, mask_m, n0, loff_ptr, lrank_ptr, lscale_ptr, lslot_ptr, lact_ptr, S, L,
                           LORA_N: tl.constexpr, LORA_BR: tl.constexpr, G: tl.constexpr):
        """The chain of dependent loads the expand of a column tile inside one slice needs before it can read h and
        B, loaded before the K steps so that none of it follows them: the tile's slice i0 (n0: its first column),
        per row its slot and that slot's rank and scaling for i0 (0 for rows without one), and per slot group g < G
        its slot (lact[g]; -1 unused or g >= L) and that slot's rank. Returns (i0, row_slot, rank_rows, scale_rows,
        slot_g [G], rank_g [G]). (Holding B itself through the K steps took 255 registers and spilled.)"""
        i0 = 0
        for i in tl.static_range(1, LORA_N):
            i0 += (tl.load(loff_ptr + i) <= n0).to(tl.int32)
        row_slot = tl.load(lslot_ptr + rows, mask=mask_m, other=-1)  # [BLOCK_M]
        has = mask_m & (row_slot >= 0)
        row_c = tl.maximum(row_slot, 0)
        rank_rows = tl.load(lrank_ptr + i0 * S + row_c, mask=has, other=0)
        scale_rows = tl.load(lscale_ptr + i0 * S + row_c, mask=has, other=0.0)
        offs_g = tl.arange(0, G)
        slot_g = tl.load(lact_ptr + offs_g, mask=offs_g < L, other=-1)  # [G]
        rank_g = tl.load(lrank_ptr + i0 * S + tl.maximum(slot_g, 0), mask=slot_g >= 0, other=0)
        return i0, row_slot, rank_rows, scale_rows, slot_g, rank_g

    @triton.jit
    def lora_stacked_b(offs_n, mask_n, slot_g, rank_g, lb_ptr, slb_s, slb_o, slb_r, BLOCK_N: tl.constexpr,
                       LORA_BR: tl.constexpr, G: tl.constexpr, EVEN_R: tl.constexpr):
        """The slot groups' B stacked [G x LORA_BR, BLOCK_N]: row g * LORA_BR + r = lb[slot of group g, offs_n, r],
        0 past the group's rank (and for unused groups). EVEN_R: read in whole rank rows, zeroed after the load."""
        offs_r = tl.arange(0, LORA_BR)
        # B as [G, BR, BLOCK_N] (the slot constant along the rank dim, so the loads along it are vectorized)
        ptrs_b = (lb_ptr + tl.maximum(slot_g, 0)[:, None, None].to(tl.int64) * slb_s + offs_r[None, :, None] * slb_r
                  + offs_n[None, None, :] * slb_o)
        live_r = offs_r[None, :, None] < rank_g[:, None, None]  # [G, BR, 1]
        if EVEN_R:
            b3 = tl.load(ptrs_b, mask=(rank_g > 0)[:, None, None] & mask_n[None, None, :], other=0.0)
            b3 = tl.where(live_r, b3, tl.zeros_like(b3))
        else:
            b3 = tl.load(ptrs_b, mask=live_r & mask_n[None, None, :], other=0.0)
        return tl.reshape(b3, (G * LORA_BR, BLOCK_N))

    @triton.jit
    def lora_stacked_expand(acc, b, rows, i0, row_slot, rank_rows, scale_rows, slot_g, lh_ptr, slh_s, slh_i, slh_m,
                            slh_r, BLOCK_M: tl.constexpr, LORA_SK: tl.constexpr, LORA_BR: tl.constexpr,
                            G: tl.constexpr, LORA_PRECISION: tl.constexpr, H_CG: tl.constexpr):
        """acc + each row's h [LORA_BR] (its LORA_SK partials summed in order, 0 past the row's rank, rounded to B's
        dtype) placed in its slot group's columns of [BLOCK_M, G x LORA_BR] (0 in the others) times the stacked b
        (lora_stacked_b), times each row's scaling. H_CG: h loaded through L2 only (cache modifier ".cg": written by
        other programs of the same launch)."""
        offs_r = tl.arange(0, LORA_BR)
        mask_h = (row_slot >= 0)[:, None] & (offs_r[None, :] < rank_rows[:, None])
        ptrs = lh_ptr + i0 * slh_i + rows[:, None] * slh_m + offs_r[None, :] * slh_r
        if H_CG:
            h = tl.load(ptrs, mask=mask_h, other=0.0, cache_modifier=".cg")  # [BLOCK_M, BR]
            for part in tl.static_range(1, LORA_SK):  # the shrink's split-K partials, in order
                h += tl.load(ptrs + part * slh_s, mask=mask_h, other=0.0, cache_modifier=".cg")
        else:
            h = tl.load(ptrs, mask=mask_h, other=0.0)  # [BLOCK_M, BR]
            for part in tl.static_range(1, LORA_SK):
                h += tl.load(ptrs + part * slh_s, mask=mask_h, other=0.0)
        hb = h.to(b.dtype)
        in_g = (row_slot[:, None] == slot_g[None, :]) & (row_slot >= 0)[:, None]  # [BLOCK_M, G]
        h3 = tl.broadcast_to(hb[:, None, :], (BLOCK_M, G, LORA_BR))
        hg = tl.reshape(tl.where(in_g[:, :, None], h3, tl.zeros_like(h3)), (BLOCK_M, G * LORA_BR))
        return acc + tl.dot(hg, b, input_precision=LORA_PRECISION) * scale_rows[:, None]

    @triton.jit
    def lora_prefetched_expand(acc, rows, offs_n, mask_n, i0, row_slot, rank_rows, scale_rows, slot_g, rank_g,
                               lh_ptr, lb_ptr, slh_s, slh_i, slh_m, slh_r, slb_s, slb_o, slb_r, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr,
                               LORA_SK: tl.constexpr, LORA_BR: tl.constexpr, G: tl.constexpr,
                               LORA_PRECISION: tl.constexpr, EVEN_R: tl.constexpr, WAIT: tl.constexpr):
        """acc + the expand from lora_prefetch_tile's loads, in one dot: the stacked B [G x LORA_BR, BLOCK_N]
        (lora_stacked_b) loaded first, then (WAIT: after gdc_wait, the shrink complete) each row's h placed in its
        slot group's columns (lora_stacked_expand); their product times each row's scaling: per row the products of
        lora_expand_tile's dot for its slot (the other groups add exact zeros)."""
        b = lora_stacked_b(offs_n, mask_n, slot_g, rank_g, lb_ptr, slb_s, slb_o, slb_r, BLOCK_N, LORA_BR, G, EVEN_R)
        if WAIT:  # launched with PDL: the K steps ran beside the shrink; h is complete after this
            tl.extra.cuda.gdc_wait()
        return lora_stacked_expand(acc, b, rows, i0, row_slot, rank_rows, scale_rows, slot_g, lh_ptr, slh_s, slh_i,
                                   slh_m, slh_r, BLOCK_M, LORA_SK, LORA_BR, G, LORA_PRECISION, False)
