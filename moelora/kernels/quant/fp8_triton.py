"""Triton kernels for block-scaled FP8 (references: fp8.py): activation quantization, the dense
block-scaled GEMM and the grouped GEMM of the routed experts over (token, k) pairs.

One GEMM kernel serves both: a program owns BLOCK_M rows (dense: consecutive rows; grouped: a block of
pairs of one expert from moe_lora_align with one slot) and BLOCK_N output columns, and walks K in steps
of BLOCK_K inside one scale group. A bf16/fp16/fp32 input is quantized in the kernel, per row and group,
exactly as quantize_act_group_ref does (so one launch per GEMM and no fp8 copy of the activations); a
pre-quantized input (x_fp8, x_scale) is read as is. For many rows (prefill) the in-kernel quantization is
repeated by every column tile; set_fp8_prequant_min_rows(n) quantizes inputs of >= n rows once beforehand
(quantize_act_group, the same numbers) instead. torch._scaled_mm is not used: torch 2.11 refuses
1x128 / 128x128 block scales on sm90 (FIELD_NOTES.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moelora.kernels._triton import HAS_TRITON, DeviceError, _env_choice, _env_int_default, require_triton
from moelora.kernels.quant.fp8 import (
    FP8_DTYPE, FP8_MAX, dequantize_act_group, fp8_block_matmul_ref, fp8_grouped_matmul_ref, grouped_matmul_dequantized,
    quantize_act_group_ref,
)
from moelora.kernels.moe_lora.chain import moe_lora_align

MIN_CAPABILITY = (8, 9)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.lora.shrink_expand_triton import lora_b_tile

    @triton.jit
    def e4m3_groups(vg, FP8_MAX_C: tl.constexpr):
        """The one e4m3 group quantization every kernel uses (quantize_act_group's numbers): vg [G, GROUP] fp32, one
        group a row -> (q [G, GROUP] fp32 in [-FP8_MAX, FP8_MAX], to be cast to e4m3 by the store; scale [G] =
        max(amax, 1e-12) / FP8_MAX)."""
        scale = tl.maximum(tl.max(tl.abs(vg), axis=1), 1e-12) / FP8_MAX_C
        return tl.clamp(vg / scale[:, None], -FP8_MAX_C, FP8_MAX_C), scale

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, sxt, sqt, sst, FP8_MAX_C: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, BLOCK)
        mask = (offs < K) & (tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_ptr + t * sxt + offs, mask=mask, other=0.0).to(tl.float32)
        q, scale = e4m3_groups(tl.reshape(x, (1, BLOCK)), FP8_MAX_C)  # one group: [1, BLOCK], [1]
        tl.store(q_ptr + t * sqt + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + t * sst + g + tl.arange(0, 1), scale)

    @triton.jit
    def store_group_quant(v, q_row_ptr, s_row_ptr, offs0, N, FP8_MAX_C: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr):
        """Producer-side activation quantization (a @triton.jit helper for other kernels' epilogues): v [BLOCK]
        fp32, the values of columns offs0 .. offs0 + BLOCK of one row (0 past N; BLOCK and offs0 multiples of
        GROUP) -> q_row[cols] = e4m3(v / scale), s_row[col // GROUP] = scale, the numbers of quantize_act_group."""
        qg, scale = e4m3_groups(tl.reshape(v, (BLOCK // GROUP, GROUP)), FP8_MAX_C)  # scale: [BLOCK // GROUP]
        q = tl.reshape(qg, (BLOCK,))
        cols = offs0 + tl.arange(0, BLOCK)
        tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=cols < N)
        groups = offs0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(s_row_ptr + groups, scale, mask=groups * GROUP < N)

    @triton.jit
    def split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, sk, tile, SPLIT_K: tl.constexpr):
        """The split-K epilogue of a [BLOCK_M, BLOCK_N] fp32 tile (this file's GEMM and nvfp4_triton's): split sk
        stores its partial in ws[sk] ([SPLIT_K, M, N] fp32, contiguous) and counts itself in cnt[tile]; the split
        arriving last adds the partials in order sk = 0, 1, ... (deterministic) and resets the counter to 0 for
        the next launch (stream order). Returns (the sum on the last split, else acc unchanged; whether last):
        the caller returns unless last. (A split first reading the counter and, finding the
        others all in, keeping its partial in registers: slower at decode sizes, e.g. the LoRA-split qkv / o_proj
        at 16 tokens 17.4 / 19.1 against 16.5 / 17.0 µs; removed.)"""
        tile_ws = ws_ptr + rows[:, None] * N + offs_n[None, :]
        mask_c = mask_m[:, None] & mask_n[None, :]
        tl.store(tile_ws + sk * M * N, acc, mask=mask_c)
        tl.debug_barrier()  # every thread's partial stored before the count (the atomic is acq_rel, gpu scope)
        last = tl.atomic_add(cnt_ptr + tile, 1) == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            for j in range(SPLIT_K):
                acc += tl.load(tile_ws + j * M * N, mask=mask_c, other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + tile, 0)
        return acc, last

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

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, ids_ptr, bexp_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        sam, sak, sasm, sasg, sbe, sbn, sbk, sbse, sbsn, sbsk, scm, scn,
        FP8_MAX_C: tl.constexpr, A_FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
        GROUP_K: tl.constexpr, SCALE_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_ROW_DIV: tl.constexpr = 1,
        SPLIT_K: tl.constexpr = 1,
        lh_ptr=None, lb_ptr=None, loff_ptr=None, lrank_ptr=None, lscale_ptr=None, lslot_ptr=None, lact_ptr=None,
        S=0, L=0, slh_s=0, slh_i=0, slh_m=0, slh_r=0, slb_s=0, slb_o=0, slb_r=0, slb_e=0,
        LORA_N: tl.constexpr = 0, LORA_SK: tl.constexpr = 1, LORA_BR: tl.constexpr = 16,
        LORA_PRECISION: tl.constexpr = "ieee", LORA_SPLIT: tl.constexpr = 0, PARTS: tl.constexpr = 1,
        LORA_GROUPS: tl.constexpr = 8, LORA_WAIT: tl.constexpr = False, LORA_EVEN_R: tl.constexpr = False,
        LORA_FLAGS: tl.constexpr = 2048,
    ):
        # LORA_N > 0: the multi-LoRA expand (lora_expand_tile) added to the fp32 tile before its one rounding. On the
        # grouped expert GEMM (routed-expert LoRA at prefill, set_prefill_lora_epilogue): the epilogue form, rows are
        # pairs (their slot and h per pair), B of the block's expert (lb + e * slb_e). Dense, by one of two forms:
        # LORA_SPLIT == 0: in the epilogue, after the K steps (and the split-K sum). Four forms were measured
        # of this epilogue, bit-equal on the H200 (scripts/bench_fp8_lora_epilogue.py, µs per qkv / o_proj call
        # at 64 tokens, 4 adapters; the base GEMM alone 10.5 / 12.1): h hoisted before the slot loop (kept) 19.9 /
        # 22.8; h loaded per slot present 22.2 / 24.7 (end to end 4,651 / 4,443 against 4,715 / 4,593 tok/s at
        # batch 64, 4 / 8 adapters); slots stacked in one [BM, 8 x 16] dot 21.7 / 23.9 (255 registers and spills
        # at 64-row blocks; 45.0 against 30.1 for qkv at 256 tokens); four slots' B loaded before their four dots
        # 20.2 / 22.7, 22.0 / 24.3 with 8 adapters against 22.9 / 25.4, but 40.7 against 30.1 for qkv at 256
        # tokens (180 registers against 145), and end to end 4,734 / 4,639 against 4,728 / 4,602 at batch 64 and
        # 12,570 / 11,322 against 12,930 / 11,603 at 256. The GEMM, then lora_expand in its own launch
        # (MOELORA_FP8_LORA_EPILOGUE=0): 21.1 / 22.0.
        # LORA_SPLIT == 3 / 4: see set_fp8_lora_split (mode 4: the LoRA program is sk == 0 and hands its tile over
        # by a flag; the K splits are sk = 1 .. SPLIT_K).
        # LORA_SPLIT == 2: one more program per tile (sk == SPLIT_K, no K steps) computes the LoRA tile as a
        # partial of the split-K sum (PARTS = SPLIT_K + 1 partials, the LoRA one last in the order), so its chain
        # of dependent loads (slots, ranks, h, then B per slot) runs beside the K steps instead of after them.
        # It walks the batch's slot groups, the first LORA_GROUPS unrolled without branches (lora_expand_tile; 0:
        # all S slots in the loop, as a removed mode 1 did: 18.8 / 20.3 µs against 18.6 / 20.1; the form
        # for an epilogue given no slot groups). LORA_WAIT (launched with PDL right after the shrink,
        # which lets it start at once): the K steps run beside the shrink and whatever adds the LoRA tile (the
        # LoRA program, or in mode 0 the program writing the tile) first waits for it (gdc_wait) before reading h;
        # every other input was written before the shrink started. Every tile has such a program, so the GEMM
        # completes after the shrink (what stream order promises the next kernel).
        # (The shrink inline was tried: no shrink launch and no h, each program accumulating its K steps'
        # h[BM, groups x R] from the unquantized x with one more dot per step, then adding its partial expand.
        # µs per call, 4 / 8 adapters (slot groups side by side: 64 / 128 columns), against mode 2 with PDL:
        # qkv at 16 tokens 18.3 / 21.6 vs 14.4 / 16.5, at 64 tokens 17.4 / 32.5 vs 17.0 / 19.1; o_proj at 64
        # tokens 15.9 / 23.3 vs 17.5 / 21.7; with x quantized in the GEMM instead, 27.3 for qkv at 64 tokens.
        # End to end at batch 64 it lost: 4,613 / 4,569 tok/s against 4,924 / 4,790. Removed.)
        # (Moving the expand out of the GEMM into the kernels reading its output was tried: qk_norm_rope for qkv, the
        # post-attention RMSNorm for o_proj; the GEMM plain, with PDL beside the shrink. µs per layer at batch 64, 4
        # adapters: qkv GEMM 14.7 -> 11.1, o_proj 13.8 -> 12.0, but qk_norm_rope 3.8 -> 9.7 and the norm 2.4 -> 5.5
        # (per-row programs each waiting for slot, h and B); end to end -1.1% / -0.6% (4 / 8 adapters), qkv alone
        # -0.8%, o_proj alone -0.2% / +0.4%. Reverted. A shrink with the slot groups side by side, 24 programs for
        # qkv instead of 96, left these GEMMs unchanged: +0.2% / -0.8%. Reverted.)
        # output row r (a pair, or a dense row) reads input row r // A_ROW_DIV (A_ROW_DIV = top_k: the token
        # rows of the routed experts' gate_up, no [P, H] gather copy)
        # SPLIT_K > 1 (dense decode: few output tiles, long K): split sk takes the K steps sk, sk + SPLIT_K, ...,
        # stores its fp32 partial tile in ws[sk], then counts itself in cnt[tile]; the split that arrives last
        # adds the PARTS partials in order sk = 0, 1, ..., writes the output and resets the counter to 0
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        sk = tl.program_id(2)
        offs_m = tl.arange(0, BLOCK_M)
        if GROUPED:
            e = tl.load(bexp_ptr + pid_m)
            if e < 0:
                return
            rows = tl.load(ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = e.to(tl.int64)
        else:
            rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = 0
        mask_m = rows < M
        a_rows = rows // A_ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        b_base = b_ptr + e * sbe + offs_n[:, None].to(tl.int64) * sbn
        bs_base = bs_ptr + e * sbse + (offs_n // SCALE_N) * sbsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA_SPLIT == 3:  # the expand's chain of metadata loads, before the K steps
            l_i0, l_slot, l_rank, l_scale, l_slot_g, l_rank_g = lora_prefetch_tile(
                rows, mask_m, pid_n * BLOCK_N, loff_ptr, lrank_ptr, lscale_ptr, lslot_ptr, lact_ptr, S, L, LORA_N,
                LORA_BR, LORA_GROUPS)
        ksk = sk  # this program's K split
        k_hi = K
        if LORA_SPLIT == 2:  # program sk == SPLIT_K computes the LoRA expand tile, no K steps
            k_hi = tl.where(sk < SPLIT_K, K, 0)
        if LORA_SPLIT == 4:  # program sk == 0 computes the LoRA expand tile, no K steps; K split ksk = sk - 1
            ksk = tl.maximum(sk - 1, 0)
            k_hi = tl.where(sk > 0, K, 0)
        for k0 in range(ksk * BLOCK_K, k_hi, BLOCK_K * SPLIT_K):
            kk = k0 + offs_k
            mask_k = kk < K
            a = tl.load(a_ptr + a_rows[:, None] * sam + kk[None, :] * sak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if A_FP8:
                a_s = tl.load(as_ptr + a_rows * sasm + (k0 // GROUP_K) * sasg, mask=mask_m, other=0.0)
                a_q = a
            else:  # quantize this row group here: BLOCK_K == GROUP_K, so the tile holds whole groups
                af = a.to(tl.float32)
                a_s = tl.maximum(tl.max(tl.abs(af), axis=1), 1e-12) / FP8_MAX_C  # [BLOCK_M]
                a_q = tl.clamp(af / a_s[:, None], -FP8_MAX_C, FP8_MAX_C).to(b_ptr.dtype.element_ty)
            b = tl.load(b_base + kk[None, :] * sbk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK]
            b_s = tl.load(bs_base + (k0 // GROUP_K) * sbsk, mask=mask_n, other=0.0)  # [BN]
            acc += tl.dot(a_q, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        tile = pid_m * tl.num_programs(1) + pid_n
        if LORA_SPLIT == 2 or LORA_SPLIT == 4:
            if sk == (SPLIT_K if LORA_SPLIT == 2 else 0):  # the LoRA program
                if LORA_WAIT:  # launched with PDL beside the shrink: h is complete (and visible) after this
                    tl.extra.cuda.gdc_wait()
                acc = lora_expand_tile(acc, rows, mask_m, offs_n, mask_n, lh_ptr, lb_ptr, loff_ptr, lrank_ptr,
                                       lscale_ptr, lslot_ptr, lact_ptr, S, L, slh_s, slh_i, slh_m, slh_r, slb_s,
                                       slb_o, slb_r, LORA_N, LORA_SK, LORA_BR, LORA_PRECISION, LORA_GROUPS,
                                       LORA_EVEN_R)
                if LORA_SPLIT == 4:  # its tile to ws[SPLIT_K], then the tile's flag raised (release)
                    tl.store(ws_ptr + SPLIT_K * M * N + rows[:, None] * N + offs_n[None, :], acc,
                             mask=mask_m[:, None] & mask_n[None, :])
                    tl.debug_barrier()  # every thread's part stored before the flag
                    tl.atomic_xchg(cnt_ptr + LORA_FLAGS + tile, 1, sem="release")
                    return
        if LORA_SPLIT == 4:
            if SPLIT_K > 1:  # the K splits' own sum first (their counter), then the LoRA tile
                acc, last = split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, ksk, tile,
                                           SPLIT_K)
                if not last:
                    return
            # wait for the tile's LoRA program (an earlier program of the grid: dispatched first), and lower its flag
            # for the next launch; then add its tile as split_k_reduce would as the last partial
            flag = tl.atomic_cas(cnt_ptr + LORA_FLAGS + tile, 1, 0, sem="acquire")
            while flag != 1:
                flag = tl.atomic_cas(cnt_ptr + LORA_FLAGS + tile, 1, 0, sem="acquire")
            acc += tl.load(ws_ptr + SPLIT_K * M * N + rows[:, None] * N + offs_n[None, :],
                           mask=mask_m[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
        elif PARTS > 1:
            acc, last = split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, sk, tile, PARTS)
            if not last:
                return
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if LORA_N > 0:
            if LORA_SPLIT == 3:
                acc = lora_prefetched_expand(acc, rows, offs_n, mask_n, l_i0, l_slot, l_rank, l_scale, l_slot_g,
                                             l_rank_g, lh_ptr, lb_ptr + e * slb_e, slh_s, slh_i, slh_m, slh_r, slb_s, slb_o,
                                             slb_r, BLOCK_M, BLOCK_N, LORA_SK, LORA_BR, LORA_GROUPS, LORA_PRECISION,
                                             LORA_EVEN_R, LORA_WAIT)
            if LORA_SPLIT == 0:
                if LORA_WAIT:  # launched with PDL: the K steps ran beside the shrink; h is complete after this
                    tl.extra.cuda.gdc_wait()
                # dense: all S slots in the loop (the measured form); grouped (prefill): the batch's slot
                # groups unrolled when given, their B loads in flight together
                acc = lora_expand_tile(acc, rows, mask_m, offs_n, mask_n, lh_ptr, lb_ptr + e * slb_e, loff_ptr, lrank_ptr,
                                       lscale_ptr, lslot_ptr, lact_ptr, S, L, slh_s, slh_i, slh_m, slh_r, slb_s,
                                       slb_o, slb_r, LORA_N, LORA_SK, LORA_BR, LORA_PRECISION,
                                       LORA_GROUPS if GROUPED else 0, LORA_EVEN_R)
        c = c_ptr + rows[:, None] * scm + offs_n[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def check_fp8_device(device: torch.device | str) -> None:
    """Clear error instead of a silent fallback: FP8 kernels need CUDA with compute capability >= 8.9."""
    device = torch.device(device)
    if device.type != "cuda":
        raise DeviceError(f"FP8 needs a CUDA GPU of compute capability >= 8.9; found {device.type}: run on such a "
                          "GPU, or keep the base in bf16 (leave out --quantization fp8; bench: --dtype bfloat16)")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise DeviceError(f"FP8 needs a CUDA GPU of compute capability >= 8.9; found {torch.cuda.get_device_name(device)} "
                          f"with compute capability {cap[0]}.{cap[1]}: keep the base in bf16, or use --quantization "
                          "nvfp4 (weight-only, any CUDA GPU)")


def quantize_act_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (quantize_act_group_ref):
        x_scale[t, g] = max(max(|x[t, g*group:(g+1)*group]|), 1e-12) / 448 ; x_fp8 = e4m3(x / x_scale per group)
    x: [T, K] (row stride free, unit column stride) · returns (x_fp8 [T, K] float8_e4m3fn, x_scale [T, ceil(K/group)] fp32)
    """
    require_triton()
    T, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    G = triton.cdiv(K, group)
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T:
        _act_quant_kernel[(T, G)](x, q, s, K, x.stride(0), q.stride(0), s.stride(0), FP8_MAX_C=FP8_MAX,
                                  GROUP=group, BLOCK=triton.next_power_of_2(group))
    return q, s


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters of _fp8_gemm_kernel (the K step is the scale group). block_m: rows per program of the
    dense GEMM (0: _block_m's choice; the grouped GEMM takes the alignment's). split_k: K splits of the dense
    GEMM (0: fp8_split_k's choice; 1: none; the grouped GEMM never splits). Only split_k changes the fp32
    summation order (partials added in split order); the rest gives the same sums."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    split_k: int = 0


_CONFIG_OVERRIDE: dict[str, Fp8GemmConfig | None] = {"dense": None, "expert": None}


def set_fp8_gemm_config(kind: str, config: Fp8GemmConfig | None) -> None:
    """Force the launch parameters of the dense ("dense") or grouped-expert ("expert") FP8 GEMM; None: the
    default of fp8_gemm_config. For scripts/sweep_fp8_gemm.py (tuning); results do not depend on it."""
    if kind not in _CONFIG_OVERRIDE:
        raise ValueError(f"set_fp8_gemm_config: kind must be 'dense' or 'expert', got {kind!r}")
    _CONFIG_OVERRIDE[kind] = config


_SPLIT_K_ENABLED = os.environ.get("MOELORA_FP8_SPLIT_K", "1") != "0"  # 0: never split the dense GEMM's K
SPLIT_K_TARGET_PROGRAMS = 264  # dense split-K, 16-row blocks: this many programs (2 per SM of an H200's 132)
SPLIT_K_TARGET_PROGRAMS_WIDE = 132  # 32/64-row blocks (4x the MMA work per K step): one per SM
_COUNTERS: dict[torch.device, torch.Tensor] = {}


# MOELORA_FP8_PREFILL_CONFIG / set_fp8_prefill_config: the FP8 GEMMs' launch parameters at prefill sizes, where the
# defaults came from sweeps at decode sizes.
#   "experts" (the default): the grouped expert GEMMs from PREFILL_MIN_PAIRS pairs take 128 x 128
#       tiles at 8 warps and 4 stages; the dense GEMM keeps its tiles;
#   "wide": the same for the grouped GEMMs, and 128 x 128 tiles at 8 warps and 3 stages for the dense
#       GEMM from PREFILL_MIN_ROWS rows (in 128-row blocks);
#   "narrow": the decode-swept tiles everywhere (64-wide, 4 warps for the grouped GEMMs), as before "experts".
# Measured (scripts/sweep_fp8_prefill.py on the H200, Qwen3-30B-A3B, 16,384 tokens, ms): gate_up 1.675 -> 1.423
# (bf16 1.547), down 1.373 -> 1.118 (3 stages 1.086; bf16 0.844); the dense GEMM is slower wide (qkv 0.526 ->
# 0.538, o_proj 0.442 -> 0.506-0.544), hence "experts". Compiled for sm_90 (scripts/compile_check_fp8_gemm.py):
# grouped 128 x 128 at 8 warps, 4 stages: 241 registers, no spills. Decode never reaches these sizes (the CUDA
# graphs stop at 256 rows, 2,048 pairs at top-8).
PREFILL_CONFIGS = ("experts", "wide", "narrow")
PREFILL_MIN_ROWS = 257
PREFILL_MIN_PAIRS = 2049
PREFILL_EXPERT_CONFIG = (128, 8, 4)  # block_n, num_warps, num_stages of the grouped GEMMs at prefill
_PREFILL = _env_choice("MOELORA_FP8_PREFILL_CONFIG", "experts", PREFILL_CONFIGS)


def set_fp8_prefill_config(name: str) -> None:
    """The FP8 GEMMs' launch parameters at prefill sizes: "experts" (the default), "wide" or "narrow"
    (MOELORA_FP8_PREFILL_CONFIG, above). The same sums each way (the K step is the scale group and prefill does not
    split K)."""
    if name not in PREFILL_CONFIGS:
        raise ValueError(f"set_fp8_prefill_config: expected one of {PREFILL_CONFIGS}, got {name!r}")
    _PREFILL[0] = name


def fp8_prefill_config() -> str:
    return _PREFILL[0]


def fp8_gemm_config(grid_m: int, N: int, grouped: bool, rows: int = 0) -> Fp8GemmConfig:
    """Default launch parameters (scripts/sweep_fp8_gemm.py on the H200, Qwen3-30B-A3B shapes):
    grouped experts: 64-wide column tiles, 4 stages (gate_up / down at 256 tokens 124 -> 115 / 72 -> 66 us,
    64 tokens unchanged at 99 / 54 us); dense: 64-wide column tiles (128 from 256 programs: prefill), 4 stages
    at decode sizes (qkv at 64 tokens 11.7 -> 8.5 us with 64-row blocks). set_fp8_gemm_config overrides it.
    rows: the GEMM's rows (pairs for the grouped GEMMs): from PREFILL_MIN_PAIRS pairs the grouped GEMMs take
    PREFILL_EXPERT_CONFIG (128 x 128 tiles at 8 warps) unless set_fp8_prefill_config("narrow"); with "wide" the
    dense GEMM takes 128 x 128 tiles at 8 warps from PREFILL_MIN_ROWS rows (in 128-row blocks)."""
    forced = _CONFIG_OVERRIDE["expert" if grouped else "dense"]
    if forced is not None:
        return forced
    if grouped and _PREFILL[0] != "narrow" and N >= 128 and rows >= PREFILL_MIN_PAIRS:
        return Fp8GemmConfig(*PREFILL_EXPERT_CONFIG)
    if not grouped and _PREFILL[0] == "wide" and N >= 128 and rows >= PREFILL_MIN_ROWS:
        return Fp8GemmConfig(128, 8, 3, 128, 1)
    if grouped:
        bn, nw, st = EXPERT_DECODE_CONFIG
        return Fp8GemmConfig(bn if N >= bn else max(16, triton.next_power_of_2(N)), nw, st)
    block_n = 128 if N >= 128 else max(16, triton.next_power_of_2(N))
    if block_n == 128 and grid_m * triton.cdiv(N, 128) < 256:  # decode: narrower tiles, more programs
        return Fp8GemmConfig(64, 4, DENSE_DECODE_STAGES)
    return Fp8GemmConfig(block_n)


# The grouped expert GEMM's launch below the prefill sizes, (BLOCK_N, warps, stages), from a sweep on the H200 at
# Qwen3-30B-A3B shapes; a second sweep over 16- to 128-wide tiles at 2-8 warps and 3-6 stages found none faster at
# 64 or 256 tokens (docs/experiments.md).
EXPERT_DECODE_CONFIG = (64, 4, 4)
DENSE_DECODE_STAGES = 4  # the dense decode GEMM's pipeline stages (the same first sweep; 8 and 12 lost end to end)


def fp8_split_k(tiles: int, k_steps: int, block_m: int = 16) -> int:
    """K splits of a dense GEMM with `tiles` output tiles of block_m rows and `k_steps` steps of one scale group:
    a power of two <= 8 with >= 4 K steps per split: for 16-row blocks the smallest reaching 264 programs (2 per
    SM of an H200), for wider blocks (4x the MMA work per K step) the largest staying within 132. The H200 sweep
    (qkv 2048 -> 5120 and o_proj 4096 -> 2048, fp8): 1-16 tokens best at 4-8 splits (o_proj at 1 token 7.0 -> 6.2 us with 8), 64 tokens qkv best unsplit
    (8.6 us; 2 splits 9.8), o_proj best at 4 (9.2 us; 8 splits 11.3), 256 tokens within 0.6 us of the best."""
    splits = 1
    while splits < 8 and k_steps >= splits * 8:
        if block_m <= 16 and tiles * splits >= SPLIT_K_TARGET_PROGRAMS:
            break
        if block_m > 16 and tiles * splits * 2 > SPLIT_K_TARGET_PROGRAMS_WIDE:
            break
        splits *= 2
    return splits


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The arrival counters of split-K tiles: int32 zeros, one buffer per device, left at zero by every launch, so
    launches in stream order (and in graph replays) share it. Made eagerly only: inside a CUDA-graph capture an
    allocation's zero-fill is only recorded, not run (a graph replayed before the one holding that memset would
    read garbage counters), so a capture that finds no buffer gets None and the GEMM does not split. The engine's
    warm-up run before each capture makes it. It is never outgrown in use (a split launch has < 264 tiles against
    the 4096 counters made; only a forced config could ask for more, and a replaced buffer would leave captured
    graphs pointing at freed memory). Split-K GEMMs on two streams at once would share it: none run so
    (the side streams carry LoRA and shared-expert work beside grouped expert GEMMs, which never split)."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = cnt
    return cnt


def split_k_buffers(out: torch.Tensor, tiles: int, split_k: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split_k, ws, cnt) for a launch whose kernel ends in split_k_reduce: the partials' workspace
    [split_k, M, N] fp32 and the arrival counters; split_k 1 (out standing in for both) when no split is asked
    or when the counters do not exist yet inside a graph capture (_split_counters). out: [M, N]."""
    if split_k <= 1:
        return 1, out, out
    cnt = _split_counters(out.device, tiles)
    if cnt is None:  # first use inside a graph capture: no counters can be made here
        return 1, out, out
    return split_k, torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device), cnt


@dataclass
class Fp8LoRAEpilogue:
    """A dense multi-LoRA expand for fp8_linear to add in its epilogue (kernels/lora_triton.lora_expand's
    semantics, fp32, before the output's one rounding). h: the shrink's [split_k, n, T, R] fp32 (or [n, T, R])
    · b_cat: [S, O, R] (or, for fp8_expert_gemm and fused_moe_triton.expert_gemm, the routed experts' [S, E|1, O,
    R], rows T being the pairs and
    token_slots the slot of each pair's token) · slice_offsets: [n+1] int32 · ranks: [n, S] int32 · scaling: [n, S] fp32
    · token_slots: [T] int32 (-1: no adapter, row untouched) · active_slots: [L] int32, the slot of each of the
    batch's slot groups (SlotGroups.active_slots, -1 unused), or None (the LoRA program then walks all S slots)
    · pdl: the GEMM may be launched with programmatic dependent launch (fp8_lora_pdl)."""

    h: torch.Tensor
    b_cat: torch.Tensor
    slice_offsets: torch.Tensor
    ranks: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    active_slots: torch.Tensor | None = None
    pdl: bool = False  # the shrink that wrote h was launched right before with launch_dependents (fp8_lora_pdl)
    slice_bounds: tuple[int, ...] | None = None  # slice_offsets on the host (set_fp8_lora_split mode 3 needs them)
    prefetch: bool = False  # fp8_expert_gemm: mode 3's form (metadata before the K steps) where prefetch_ok

    def prefetch_ok(self, block_n: int) -> bool:
        """Whether set_fp8_lora_split mode 3 can serve a launch of block_n-wide column tiles: slot groups given, at
        most LORA_PREFETCH_MAX_GROUPS of them, and every slice boundary on a tile boundary (a tile in one slice)."""
        return (self.active_slots is not None and 0 < self.active_slots.shape[0] <= LORA_PREFETCH_MAX_GROUPS
                and self.slice_bounds is not None and all(o % block_n == 0 for o in self.slice_bounds[1:-1]))

    def kernel_args(self, prefetch: bool = False) -> dict:
        from moelora.kernels._triton import dot_precision, lora_even_r

        h = self.h if self.h.dim() == 4 else self.h.unsqueeze(0)
        sk, n, _, R = h.shape
        b = self.b_cat
        per_expert = {}
        if b.dim() == 4:  # routed experts [S, E|1, O, R]: the expert dim's stride (0 when shared by all experts)
            per_expert = {"slb_e": b.stride(1) if b.shape[1] > 1 else 0}
            b = b[:, 0]
        return dict(lh_ptr=h, lb_ptr=self.b_cat, loff_ptr=self.slice_offsets, lrank_ptr=self.ranks,
                    lscale_ptr=self.scaling, lslot_ptr=self.token_slots, S=b.shape[0], slh_s=h.stride(0),
                    slh_i=h.stride(1), slh_m=h.stride(2), slh_r=h.stride(3), slb_s=b.stride(0), slb_o=b.stride(1),
                    slb_r=b.stride(2), **per_expert,
                    LORA_N=n, LORA_SK=sk, LORA_BR=max(16, triton.next_power_of_2(R)),
                    LORA_EVEN_R=lora_even_r() and R == max(16, triton.next_power_of_2(R)) and b.shape[2] == R,
                    LORA_PRECISION=dot_precision(b.dtype),
                    **(dict(LORA_GROUPS=0) if self.active_slots is None else
                       dict(lact_ptr=self.active_slots, L=self.active_slots.shape[0],
                            LORA_GROUPS=(triton.next_power_of_2(self.active_slots.shape[0]) if prefetch else
                                         min(LORA_GROUPS_UNROLLED, self.active_slots.shape[0])))))


def _launch(a, a_scale, w, w_scale, out, bias, block, ids, bexp, block_m: int, grid_m: int,
            a_row_div: int = 1, lora: Fp8LoRAEpilogue | None = None, pdl_ok: bool = False) -> None:
    M, K = out.shape[0], a.shape[1]
    N = w.shape[-2]
    bn, bk = block
    block_k = bk
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"FP8 Triton GEMM: block_k must be a power of two >= 16, got weight_block_size {list(block)}")
    cfg = fp8_gemm_config(grid_m, N, ids is not None, M)
    block_n = cfg.block_n
    grid_n = triton.cdiv(N, block_n)
    split_k = 1
    if ids is None and (_SPLIT_K_ENABLED or cfg.split_k):  # dense: split K when few output tiles (decode)
        split_k = cfg.split_k or fp8_split_k(grid_m * grid_n, triton.cdiv(K, block_k), block_m)
    lora_split = 0
    tiles = grid_m * grid_n
    if lora is not None and ids is not None:  # grouped experts: after the K steps, or mode 3 (metadata prefetched)
        lora_split = 3 if lora.prefetch and lora.prefetch_ok(block_n) else 0
    if lora is not None and ids is None:
        mode = _LORA_SPLIT[0]
        if (mode == 3 and not lora.prefetch_ok(block_n)) or (mode == 4 and not mode4_ok(tiles, split_k)):
            mode = 2
        if mode == 3 or M <= _LORA_SPLIT[1] or tiles * (split_k + 1) <= LORA_SPLIT_MAX_PROGRAMS:
            lora_split = mode
    lora_part = 1 if lora_split in (2, 4) else 0
    need = tiles + (LORA_FLAGS if lora_split == 4 else 0)  # counters (mode 4: its flags after LORA_FLAGS)
    cnt_now = _COUNTERS.get(out.device)
    counters_before = cnt_now is not None and cnt_now.numel() >= need
    parts, ws, cnt = split_k_buffers(out, need, split_k + lora_part)
    if lora_part and parts == 1:  # no counters (first use inside a capture): the epilogue form, unsplit
        lora_split, split_k = 0, 1
    else:
        split_k = parts - lora_part
    # PDL only when nothing was launched between the shrink and this GEMM: no quantization launch for x (pdl_ok),
    # the split-K counters (if any) already there (counters_before: not zero-filled by this call)
    pdl = lora is not None and lora.pdl and pdl_ok and (parts == 1 or counters_before)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    s3 = w_scale if w_scale.dim() == 3 else w_scale.unsqueeze(0)
    a_fp8 = a.dtype == FP8_DTYPE
    sas = (a_scale.stride(0), a_scale.stride(1)) if a_fp8 else (0, 0)
    grid = (grid_m, grid_n, parts)
    _fp8_gemm_kernel[grid](
        a, a_scale if a_fp8 else a, w3, s3, out, bias if bias is not None else out,
        ids if ids is not None else out, bexp if bexp is not None else out, ws, cnt,
        M, N, K, a.stride(0), a.stride(1), *sas, w3.stride(0), w3.stride(1), w3.stride(2),
        s3.stride(0), s3.stride(1), s3.stride(2), out.stride(0), out.stride(1),
        FP8_MAX_C=FP8_MAX, A_FP8=a_fp8, GROUPED=ids is not None, HAS_BIAS=bias is not None,
        GROUP_K=bk, SCALE_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, A_ROW_DIV=a_row_div,
        SPLIT_K=split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **(lora.kernel_args(prefetch=lora_split == 3) if lora is not None else {}),
        **({"LORA_SPLIT": lora_split} if lora is not None else {}), **({"PARTS": parts} if parts > 1 else {}),
        **({"LORA_WAIT": True, "launch_pdl": True} if pdl else {}),
    )


# measured on the H200 (Qwen3-30B-A3B fp8): 1 (always) against 0 (in the kernel) gave decode
# 3,735 -> 4,192 tok/s at batch 64 and 7,048 -> 8,469 at 256; at 1,024 prefill went 15,179 -> 32,129 tok/s
_PREQUANT_MIN_ROWS = [_env_int_default("MOELORA_FP8_PREQUANT_MIN_ROWS", 1)]


def set_fp8_prequant_min_rows(rows: int) -> None:
    """Inputs of at least `rows` rows (bf16/fp16/fp32) are quantized once by quantize_act_group before the GEMM
    instead of inside it, where each of the N / BLOCK_N column tiles re-quantizes the same rows; the results
    are the same (one formula). Default 1: always beforehand (faster at every batch measured); 0: always in the
    kernel. Also MOELORA_FP8_PREQUANT_MIN_ROWS=n."""
    _PREQUANT_MIN_ROWS[0] = max(0, int(rows))


def act_quant_buffers(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs for a producer kernel that quantizes its own output x [T, K] (store_group_quant): x_fp8 [T, K]
    float8_e4m3fn and x_scale [T, K / group] fp32. Attach them with attach_act_quant."""
    T, K = x.shape
    return (torch.empty(T, K, dtype=FP8_DTYPE, device=x.device),
            torch.empty(T, K // group, dtype=torch.float32, device=x.device))


def attach_act_quant(x: torch.Tensor, x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
    """Mark x as already quantized (quantize_act_group(x, group) == (x_fp8, x_scale)): an FP8 GEMM reading x then
    skips its own quantization launch. The mark lives on this tensor object (a view or copy does not carry it);
    x must not be changed in place afterwards. Returns x."""
    x.fp8_act = (x_fp8, x_scale, group)
    return x


_LORA_EPILOGUE = [os.environ.get("MOELORA_FP8_LORA_EPILOGUE", "1") != "0"]


def set_fp8_lora_epilogue(enabled: bool) -> None:
    """Dense LoRA on an FP8 (Triton) LoRALinear: the expand inside the FP8 GEMM's epilogue (on by default; off, or
    MOELORA_FP8_LORA_EPILOGUE=0: the GEMM, then the expand kernel adding into its bf16 output)."""
    _LORA_EPILOGUE[0] = bool(enabled)


def fp8_lora_epilogue() -> bool:
    return _LORA_EPILOGUE[0]


def _lora_split_env() -> list[int]:
    mode = _env_int_default("MOELORA_FP8_LORA_SPLIT", 4)
    if mode not in (0, 2, 3, 4):
        raise ValueError(f"MOELORA_FP8_LORA_SPLIT must be 0 (the expand after the K steps), 2 (the LoRA program), "
                         f"3 (after the K steps, its metadata loaded before them) or 4 (the LoRA program first, "
                         f"its tile awaited by a flag), got {mode}")
    return [mode, _env_int_default("MOELORA_FP8_LORA_SPLIT_MAX_ROWS", 64)]


_LORA_SPLIT = _lora_split_env()
# above max_rows the LoRA program is still used while the launch (the GEMM's programs and one LoRA program per
# tile) stays within this many programs, 2 per SM of an H200: o_proj at 256 rows (128 tiles; µs per call, 4 / 8
# adapters: 25.7 / 26.4 against 27.4 / 33.6 after the K steps), not qkv (320 tiles: 34.9 / 39.8 against 26.1 /
# 29.5)
LORA_SPLIT_MAX_PROGRAMS = 264
LORA_GROUPS_UNROLLED = 8  # slot groups of set_fp8_lora_split mode 2 unrolled in the kernel (the rest in a loop)
LORA_PREFETCH_MAX_GROUPS = 8  # set_fp8_lora_split mode 3 serves batches of at most this many slot groups (max_loras)
LORA_FLAGS = 2048  # mode 4: the LoRA programs' flags sit at this offset in the split-K counters (tiles <= it)


def mode4_ok(tiles: int, split_k: int) -> bool:
    """Whether a launch of `tiles` output tiles and split_k K splits may take set_fp8_lora_split mode 4: its programs
    (one LoRA program and split_k K programs a tile) within LORA_SPLIT_MAX_PROGRAMS, 2 per SM of an H200, so that
    every program can be resident at once whatever order they start in (a K program waits for its tile's LoRA
    program), and its flags within the counters (tiles <= LORA_FLAGS)."""
    return tiles * (split_k + 1) <= LORA_SPLIT_MAX_PROGRAMS and tiles <= LORA_FLAGS


def set_fp8_lora_split(mode: int, max_rows: int | None = None) -> None:
    """Where the dense GEMM's LoRA expand runs for inputs of <= max_rows rows, or of more while the GEMM's programs
    and one LoRA program per output tile are at most LORA_SPLIT_MAX_PROGRAMS (MOELORA_FP8_LORA_SPLIT,
    MOELORA_FP8_LORA_SPLIT_MAX_ROWS; otherwise always 0): 0 in the epilogue after the K steps; 2 in one
    more program per output tile, beside the K steps, summed as the last split-K partial, over the batch's slot
    groups, the first LORA_GROUPS_UNROLLED unrolled with their loads in flight together. (A mode 1, the
    LoRA program walking all slots, was a little slower than 2 and was removed. Mode 0
    with h written by the norm and the attention, so nothing left to wait for, still lost to mode 2 with them,
    4,910 / 4,742 against 5,006 / 4,883 tok/s at fp8 128/128 batch 64, 4 / 8 adapters.)
    3: after the K steps like 0, at every size, but with the expand's chain of metadata loads (slice,
    slots, ranks, scalings: lora_prefetch_tile) issued before the K steps and one dot over the slot groups after
    them (lora_prefetched_expand), so only the loads of B and h (side by side) and that dot follow the K steps,
    and no split-K partial is added; used where Fp8LoRAEpilogue.prefetch_ok holds (slot groups given, at most
    LORA_PREFETCH_MAX_GROUPS, tiles inside one slice), else mode 2.
    4 (the default): mode 2's LoRA program, but first in the grid (program 0 of each tile), storing
    its tile and raising the tile's flag; the K-step program (the last K split) waits for the flag, lowers it and
    adds the tile, so the K steps' partial is neither stored nor counted nor read back (bit-equal to mode 2: the
    same sums in the same order). Only where mode4_ok holds (every program resident at once), else mode 2.
    Measured at fp8 128/128 batch 64, one A/B process: 5,119 / 4,996 tok/s against mode 2's 5,099 / 4,932 with
    4 / 8 adapters (+0.4% / +1.3%); per call with h ready, qkv / o_proj at 64 tokens, 4 adapters: 12.3 / 12.9 µs
    against 13.3 / 12.8 (the GEMM alone 8.6 / 9.4). Mode 3 lost: 5,071 / 4,946 against 5,098 / 4,951, its
    expand after the K steps 14.0 / 14.1 µs a call. Results are the same up to fp32 summation order."""
    if mode not in (0, 2, 3, 4):
        raise ValueError(f"set_fp8_lora_split: mode must be 0, 2, 3 or 4, got {mode}")
    _LORA_SPLIT[0] = mode
    if max_rows is not None:
        _LORA_SPLIT[1] = int(max_rows)


def fp8_lora_split() -> tuple[int, int]:
    """(mode, max_rows) of set_fp8_lora_split."""
    return _LORA_SPLIT[0], _LORA_SPLIT[1]


_LORA_PDL = [os.environ.get("MOELORA_FP8_LORA_PDL", "1") != "0"]


def set_fp8_lora_pdl(enabled: bool) -> None:
    """Programmatic dependent launch of the dense FP8 GEMM after its LoRA shrink (on by default;
    MOELORA_FP8_LORA_PDL=0 turns it off): where fp8_lora_pdl says yes, the shrink lets the GEMM start at once and
    the GEMM's K steps run beside it; only the code adding the LoRA tile waits for the shrink. Results do not
    change."""
    _LORA_PDL[0] = bool(enabled)


def fp8_lora_pdl_enabled() -> bool:
    """The set_fp8_lora_pdl switch itself (fp8_lora_pdl also asks the device)."""
    return _LORA_PDL[0]


def fp8_lora_pdl(device: torch.device) -> bool:
    """Whether the dense FP8 GEMM with LoRA is launched with PDL after its shrink: the switch on, and a GPU of
    compute capability >= 9.0 (Hopper: griddepcontrol)."""
    if not (_LORA_PDL[0] and device.type == "cuda"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_prequantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x_fp8, x_scale) for an FP8 GEMM reading x: its producer's quantization, or quantize_act_group now; (x, None)
    when the GEMM would quantize x itself (set_fp8_prequant_min_rows)."""
    return _prequantized(x, None, group)


_PRODUCER_QUANT = os.environ.get("MOELORA_FP8_PRODUCER_QUANT", "1") != "0"  # 0: the GEMMs quantize their inputs


def act_quant_ok(K: int, group: int | None, block: int) -> bool:
    """Whether a producer kernel of tile `block` can quantize a K-wide output in groups of `group` (and producer
    quantization is on: MOELORA_FP8_PRODUCER_QUANT=0 turns it off)."""
    return _PRODUCER_QUANT and bool(group) and K % group == 0 and block % group == 0


def _prequantized(x: torch.Tensor, x_scale: torch.Tensor | None, group: int):
    """(x, x_scale): the quantization its producer attached (attach_act_quant), else quantized here when
    set_fp8_prequant_min_rows asks for it at this row count."""
    mark = getattr(x, "fp8_act", None)
    if mark is not None and x_scale is None and mark[2] == group and x.dtype != FP8_DTYPE:
        return mark[0], mark[1]
    n = _PREQUANT_MIN_ROWS[0]
    if x.dtype == FP8_DTYPE or not n or x.shape[0] < n:
        return x, x_scale
    return quantize_act_group(x, group)


def _block_m(rows: int) -> int:
    return 16 if rows <= 512 else 64


def _dense_block_m(rows: int) -> int:
    """Rows per program of the dense GEMM: the whole batch up to 64 rows (each weight tile read once; the sweep:
    qkv at 64 / 256 tokens 11.7 -> 8.5 / 27.4 -> 13.8 us against 16-row blocks), 64 beyond (128 from
    PREFILL_MIN_ROWS with set_fp8_prefill_config("wide"))."""
    if rows >= PREFILL_MIN_ROWS and _PREFILL[0] == "wide":
        return 128
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def fp8_linear(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    lora: Fp8LoRAEpilogue | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics (fp8_block_matmul_ref):
        xq, xs = quantize_act_group(x, block_k)    (or x, x_scale when x is already float8)
        y = deq(xq, xs) @ deq(w_fp8, w_scale_inv).T (+ bias)     # fp32 accumulation
        (+ lora: the expand of Fp8LoRAEpilogue added in fp32, rounded once with y: fp8_linear_lora_ref)
    x: [T, K] bf16/fp16/fp32, or float8 with x_scale [T, ceil(K/bk)] · w_fp8: [N, K] float8_e4m3fn
    w_scale_inv: [ceil(N/bn), ceil(K/bk)] fp32 · bias: [N] or None
    returns [T, N] in out_dtype, default x.dtype (bf16 for a float8 x); out: written instead of a new tensor (made
    by the caller, e.g. on another stream than the one this runs on), [T, N] of that dtype
    """
    require_triton()
    T = x.shape[0]
    if out_dtype is None:
        out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    if out is None:
        out = torch.empty(T, w_fp8.shape[0], dtype=out_dtype, device=x.device)
    elif tuple(out.shape) != (T, w_fp8.shape[0]) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"fp8_linear: out must be a contiguous [{T}, {w_fp8.shape[0]}] {out_dtype} tensor, found "
                         f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if T == 0:
        return out
    forced = _CONFIG_OVERRIDE["dense"]
    bm = forced.block_m if forced is not None and forced.block_m else _dense_block_m(T)
    xq, x_scale = _prequantized(x, x_scale, block[1])
    mark = getattr(x, "fp8_act", None)
    no_launch = x.dtype == FP8_DTYPE or xq.dtype != FP8_DTYPE or (mark is not None and xq is mark[0])
    _launch(xq, x_scale, w_fp8, w_scale_inv, out, bias, block, None, None, bm, triton.cdiv(T, bm), lora=lora,
            pdl_ok=no_launch)
    return out


def fp8_linear_lora_ref(x, w_fp8, w_scale_inv, block, bias, lora: Fp8LoRAEpilogue, groups, x_scale=None,
                        out_dtype=None) -> torch.Tensor:
    """fp8_linear(..., lora=lora) in torch: the fp32 base output plus lora_expand_ref's delta, rounded once.
    groups: the SlotGroups of lora.token_slots (the reference walks slots on the host)."""
    from moelora.kernels.lora.shrink_expand import lora_expand_ref

    y = fp8_linear_ref(x, w_fp8, w_scale_inv, block, bias, x_scale, out_dtype=torch.float32)
    h = lora.h if lora.h.dim() == 4 else lora.h.unsqueeze(0)
    h = h.sum(0).to(lora.b_cat.dtype).float()  # the kernel rounds h to the factors' dtype, as lora_expand does
    lora_expand_ref(h, lora.b_cat, lora.slice_offsets, lora.ranks, lora.scaling, groups, y)
    return y.to(out_dtype or (torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype))


def fp8_linear_ref(x, w_fp8, w_scale_inv, block=(128, 128), bias=None, x_scale=None, out_dtype=None) -> torch.Tensor:
    """fp8_linear's semantics in torch (the test oracle)."""
    if x.dtype == FP8_DTYPE:
        x = dequantize_act_group(x, x_scale, block[1])
        out_dtype = out_dtype or torch.bfloat16
    y = fp8_block_matmul_ref(x, w_fp8, w_scale_inv, block, bias)
    return y.to(out_dtype or y.dtype)


def fp8_grouped_gemm(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, pair_exp: torch.Tensor,
    block: tuple[int, int] = (128, 128), align: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics (fp8_grouped_matmul_ref):
        for p in range(P): y[p] = fp8_linear(x[p], w_fp8[pair_exp[p]], w_scale_inv[pair_exp[p]])
    x: [P, K] bf16/fp16/fp32 (quantized per row and group in the kernel), or float8 with x_scale [P, ceil(K/bk)]
    w_fp8: [E, N, K] float8_e4m3fn
    w_scale_inv: [E, ceil(N/bn), ceil(K/bk)] fp32 · pair_exp: [P] int (expert of each row)
    align: fp8_grouped_align(pair_exp, E) when the caller reuses it (gate_up and down share one)
    returns [P, N] in x.dtype (bf16 for a float8 x), rows in x's order. No host synchronisation (CUDA-graph safe).
    """
    require_triton()
    P = x.shape[0]
    out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    out = torch.empty(P, w_fp8.shape[1], dtype=out_dtype, device=x.device)
    if P == 0:
        return out
    bm = _block_m(P)
    sorted_ids, bexp = align if align is not None else fp8_grouped_align(pair_exp, w_fp8.shape[0], bm)
    x, x_scale = _prequantized(x, x_scale, block[1])
    _launch(x, x_scale, w_fp8, w_scale_inv, out, None, block, sorted_ids, bexp, bm, bexp.shape[0])
    return out


def fp8_grouped_gemm_ref(x, w_fp8, w_scale_inv, pair_exp, block=(128, 128), align=None, x_scale=None) -> torch.Tensor:
    """fp8_grouped_gemm's semantics in torch (the test oracle)."""
    if x.dtype == FP8_DTYPE:
        xd = dequantize_act_group(x, x_scale, block[1])
        return grouped_matmul_dequantized(xd, w_fp8, w_scale_inv, pair_exp, block, torch.bfloat16)
    return fp8_grouped_matmul_ref(x, w_fp8, w_scale_inv, pair_exp, block)


def fp8_expert_gemm(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int],
    topk_ids: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor], gather_rows: bool, block_m: int,
    x_scale: torch.Tensor | None = None, lora: Fp8LoRAEpilogue | None = None,
) -> torch.Tensor:
    """The FP8 grouped GEMM on the routed-expert fast path's alignment (fused_moe_triton.moe_align), reading
    token rows in place. Semantics (fp8_expert_gemm_ref), pairs p = t * K + k, e = topk_ids.flatten()[p]:
        row = x[p // K] if gather_rows else x[p]
        y[p] = fp8_linear(row, w_fp8[e], w_scale_inv[e])       (row quantized per 128-group in the kernel)
    x: [T, D] (gather_rows) or [P, D], bf16/fp16/fp32, or float8 with x_scale · w_fp8: [E, N, D] float8_e4m3fn
    w_scale_inv: [E, ceil(N/bn), ceil(D/bk)] fp32 · topk_ids: [T, K] · align: moe_align(topk_ids, E, block_m)
    block_m: the alignment's block (>= 16) · returns [P, N] in x.dtype (bf16 for a float8 x). CUDA-graph safe.
    lora: the routed experts' LoRA expand added in the epilogue before the one rounding (fp8_expert_gemm_lora_ref):
        y[p, o_i] += scaling[i, s] * (h[i, p, :r] rounded to B's dtype) @ B[s, e, o_i, :r].T,  s = token_slots[p]
    with h: [n, P, R] fp32 (the pairs' shrink, moe_lora_grouped_shrink) · b_cat: [S, E|1, N, R] · token_slots: [P]
    (pairs of slot -1 get no delta).
    """
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    sorted_ids, bexp = expert_align_blocks("fp8_expert_gemm", align, block_m)
    out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    out = torch.empty(P, w_fp8.shape[1], dtype=out_dtype, device=x.device)
    if P:
        x, x_scale = _prequantized(x, x_scale, block[1])  # gather_rows: the T token rows, once
        _launch(x, x_scale, w_fp8, w_scale_inv, out, None, block, sorted_ids, bexp, block_m, bexp.shape[0],
                a_row_div=K if gather_rows else 1, lora=lora)
    return out


def fp8_expert_gemm_lora_ref(x, w_fp8, w_scale_inv, block, topk_ids, gather_rows, lora: Fp8LoRAEpilogue,
                             x_scale=None) -> torch.Tensor:
    """fp8_expert_gemm(..., lora=lora) in torch: the fp32 base output plus each pair's expand, rounded once."""
    T, K = topk_ids.shape
    rows = torch.arange(T * K, device=x.device) // K if gather_rows else torch.arange(T * K, device=x.device)
    xr = x[rows]
    if xr.dtype == FP8_DTYPE:
        xr = dequantize_act_group(xr, x_scale[rows], block[1])
    y = grouped_matmul_dequantized(xr, w_fp8, w_scale_inv, topk_ids.reshape(-1), block, torch.float32) \
        if x.dtype == FP8_DTYPE else fp8_grouped_matmul_ref(xr, w_fp8, w_scale_inv, topk_ids.reshape(-1), block).float()
    return expert_lora_expand_ref(y, topk_ids, lora).to(torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)


def expert_lora_expand_ref(y: torch.Tensor, topk_ids: torch.Tensor, lora: Fp8LoRAEpilogue) -> torch.Tensor:
    """The routed experts' LoRA expand of a grouped GEMM's epilogue (fp8_expert_gemm / expert_gemm with lora=),
    added in place to y [P, O] fp32: y[p, o_i] += scaling[i, s] * (h[i, p, :r] rounded to B's dtype) @
    B[s, e, o_i, :r].T for pairs p of slot s = token_slots[p] >= 0 on expert e = topk_ids.flatten()[p]. Returns y."""
    h = lora.h if lora.h.dim() == 3 else lora.h.sum(0)
    b = lora.b_cat
    off = lora.slice_offsets.tolist()
    for p, (e, s) in enumerate(zip(topk_ids.reshape(-1).tolist(), lora.token_slots.tolist())):
        if s < 0:
            continue
        be = b[s, e if b.shape[1] > 1 else 0]
        for i in range(len(off) - 1):
            r = int(lora.ranks[i, s])
            if r > 0:
                hr = h[i, p, :r].to(b.dtype).float()
                y[p, off[i]:off[i + 1]] += lora.scaling[i, s].float() * (be[off[i]:off[i + 1], :r].float() @ hr)
    return y


def expert_align_blocks(caller: str, align: tuple[torch.Tensor, torch.Tensor], block_m: int):
    """(sorted_ids, block_expert) of a moe_align result, checked to hold blocks of block_m (>= 16) rows."""
    sorted_ids, bexp = align
    if sorted_ids.shape[0] != bexp.shape[0] * block_m or block_m < 16:
        raise ValueError(f"{caller}: align holds {sorted_ids.shape[0]} ids in {bexp.shape[0]} blocks; "
                         f"expected blocks of block_m={block_m} (>= 16)")
    return sorted_ids, bexp


def fp8_expert_gemm_ref(x, w_fp8, w_scale_inv, block, topk_ids, align, gather_rows, block_m, x_scale=None):
    """fp8_expert_gemm's semantics in torch (align and block_m are ignored: rows are matched by topk_ids)."""
    T, K = topk_ids.shape
    rows = torch.arange(T * K, device=x.device) // K if gather_rows else torch.arange(T * K, device=x.device)
    xs = None if x_scale is None else x_scale[rows]
    return fp8_grouped_gemm_ref(x[rows], w_fp8, w_scale_inv, topk_ids.reshape(-1), block, x_scale=xs)


def fp8_grouped_align(pair_exp: torch.Tensor, num_experts: int, block_m: int | None = None):
    """Rows grouped by expert, each group padded to block_m (moe_lora_align with one slot): (sorted_ids [P_max]
    int32, padding = P; block_expert [P_max / block_m] int32, -1 past the end)."""
    P = pair_exp.numel()
    bm = block_m or _block_m(P)
    slots = torch.zeros(P, dtype=torch.int32, device=pair_exp.device)
    if pair_exp.is_cuda:
        from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast as align
    else:
        align = moe_lora_align
    return align(pair_exp.view(P, 1), slots, num_experts, 1, bm)


__all__ = ["set_fp8_lora_epilogue", "fp8_lora_epilogue", "set_fp8_lora_split", "fp8_lora_split", "set_fp8_lora_pdl", "fp8_lora_pdl", "fp8_prequantize", "Fp8LoRAEpilogue", "fp8_linear_lora_ref", "act_quant_buffers", "attach_act_quant", "act_quant_ok", "Fp8GemmConfig", "set_fp8_gemm_config", "fp8_gemm_config", "set_fp8_prefill_config", "fp8_prefill_config", "fp8_split_k", "check_fp8_device", "quantize_act_group", "quantize_act_group_ref", "fp8_linear", "fp8_linear_ref",
           "fp8_grouped_gemm", "fp8_grouped_gemm_ref", "fp8_grouped_align", "fp8_expert_gemm", "fp8_expert_gemm_ref", "fp8_expert_gemm_lora_ref", "expert_lora_expand_ref"]
