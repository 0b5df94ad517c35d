"""Triton MLA absorbed decode over the paged latent cache, reading only device tensors (CUDA-graph safe).
Reference with the same signature: mla.mla_decode_paged_ref (conventions: the module docstring of mla.py).

One decode row per sequence: row t is the newest token of sequence b = token_seq[t] (-1: padding row, output
0) and sees cache positions 0 .. seq_lens[b] - 1. Four launches, no host reads:
1. q_lat = W_UK^T q_nope                              one cuBLAS bmm over heads
2. q_lat += scaling * A^T (B_K^T q_nope)              _kvb_lora_q_kernel: per (slot group, row block, head)
3. o_lat = attention of [q_lat | q_pe] over the cache  _mla_attn_kernel (split over the context, fp32 online
   softmax; the split arriving last for a row merges the splits' log-sum-exp partials, as paged_triton's)
4. out = W_UV o_lat (bmm), += scaling * B_V (A o_lat)  _kvb_lora_o_kernel
The kv_b LoRA stays factored per slot: the tokens of each slot group read only that slot's A and B.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, require_triton
from moelora.kernels.attention.mla import KVBLoRAArgs
from moelora.kernels.attention.paged_triton import num_sms
from moelora.kernels.quant.split_k_triton import split_counters

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.attention.paged_triton import merge_splits

    @triton.jit
    def _mla_attn_kernel(
        ql_ptr, qpe_ptr, cache_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, o_ptr, lse_ptr, out_ptr, cnt_ptr,
        scale, H, C, R, BS,
        sql_t, sql_h, sqp_t, sqp_h, sc_b, sc_s, sbt_b, so_t, so_h, so_s, sl_t, sl_h, sout_t, sout_h,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        b = tl.load(token_seq_ptr + t)
        L = tl.where(b >= 0, tl.load(seq_lens_ptr + tl.maximum(b, 0)), 0)  # padding rows: no context, output 0
        chunk = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, L)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        t64 = t.to(tl.int64)
        q_c = tl.load(ql_ptr + t64 * sql_t + offs_h[:, None] * sql_h + offs_c[None, :],
                      mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # [BH, BC]
        q_r = tl.load(qpe_ptr + t64 * sqp_t + offs_h[:, None] * sqp_h + offs_r[None, :],
                      mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # [BH, BR]
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            page = tl.load(bt_ptr + b.to(tl.int64) * sbt_b + pos // BS, mask=valid, other=0).to(tl.int64)
            row = cache_ptr + page * sc_b + (pos % BS).to(tl.int64) * sc_s  # [BN] pointers to cache rows
            k_c = tl.load(row[:, None] + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)  # [BN, BC]
            k_r = tl.load(row[:, None] + C + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
            s = tl.dot(q_c.to(k_c.dtype), tl.trans(k_c), input_precision=PRECISION)
            s += tl.dot(q_r.to(k_r.dtype), tl.trans(k_r), input_precision=PRECISION)  # [BH, BN]
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=PRECISION)
            m_i = m_new
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        mask_o = mask_h[:, None] & mask_c[None, :]
        out_ptrs = out_ptr + t64 * sout_t + offs_h[:, None] * sout_h + offs_c[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptrs, out, mask=mask_o)
        else:  # the partials (o, lse) stored; the split arriving last for (t, hb) merges them in split order
            o_ptrs = o_ptr + t64 * so_t + offs_h[:, None] * so_h + offs_c[None, :]
            lse_ptrs = lse_ptr + t64 * sl_t + offs_h * sl_h
            tl.store(o_ptrs + split * so_s, out, mask=mask_o)
            tl.store(lse_ptrs + split, tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf")),
                     mask=mask_h)
            tl.debug_barrier()  # every thread's partial stored before the count (the atomic is acq_rel, gpu scope)
            tile = t * tl.num_programs(1) + hb
            if tl.atomic_add(cnt_ptr + tile, 1) == NUM_SPLITS - 1:
                tl.store(out_ptrs, merge_splits(o_ptrs, lse_ptrs, so_s, NUM_SPLITS, mask_h, mask_o, False), mask=mask_o)
                tl.store(cnt_ptr + tile, 0)

    @triton.jit
    def _group_rows(ranks_ptr, scale_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr, BLOCK_M: tl.constexpr,
                    BLOCK_R: tl.constexpr):
        """Program (row block, head, slot group)'s rows of its group -> (live, slot (int64), its scaling, rows [BLOCK_M]
        int64, mask_m, offs_r, mask_r); not live: an unused group, a block past its tokens or a slot of rank 0."""
        pid_m = tl.program_id(0)
        group = tl.program_id(2)
        slot = tl.load(active_ptr + group)
        s = tl.maximum(slot, 0)
        count = tl.load(count_ptr + group)
        rank = tl.load(ranks_ptr + s)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(sorted_ptr + tl.load(start_ptr + group) + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        live = (slot >= 0) & (pid_m * BLOCK_M < count) & (rank > 0)
        return live, s.to(tl.int64), tl.load(scale_ptr + s), rows, mask_m, offs_r, offs_r < rank

    @triton.jit
    def _kvb_lora_q_kernel(
        qn_ptr, a_ptr, b_ptr, ql_ptr, ranks_ptr, scale_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr,
        Dn, C, HEAD_ROWS,
        sqn_t, sqn_h, sa_s, sa_r, sb_s, sb_o, sb_r, sql_t, sql_h,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        h = tl.program_id(1)
        live, s64, scale, rows, mask_m, offs_r, mask_r = _group_rows(ranks_ptr, scale_ptr, sorted_ptr, active_ptr,
                                                                     count_ptr, start_ptr, BLOCK_M, BLOCK_R)
        if live == 0:
            return
        u = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)  # B_K[s, h]^T q_nope[t, h]
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, Dn, BLOCK_D):
            dd = d0 + offs_d
            mask_d = dd < Dn
            q = tl.load(qn_ptr + rows[:, None] * sqn_t + h * sqn_h + dd[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            bk = tl.load(b_ptr + s64 * sb_s + (h * HEAD_ROWS + dd[:, None]) * sb_o + offs_r[None, :] * sb_r,
                         mask=mask_d[:, None] & mask_r[None, :], other=0.0)  # [BD, BR]
            u += tl.dot(q.to(bk.dtype), bk, input_precision=PRECISION)
        u = u * scale
        offs_c = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + offs_c
            mask_c = cc < C
            a = tl.load(a_ptr + s64 * sa_s + offs_r[:, None] * sa_r + cc[None, :], mask=mask_r[:, None] & mask_c[None, :], other=0.0)
            d = tl.dot(u.to(a.dtype), a, input_precision=PRECISION)  # [BM, BC]
            ptrs = ql_ptr + rows[:, None] * sql_t + h * sql_h + cc[None, :]
            mask = mask_m[:, None] & mask_c[None, :]
            y = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (y.to(tl.float32) + d).to(ql_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _kvb_lora_o_kernel(
        ol_ptr, a_ptr, b_ptr, out_ptr, ranks_ptr, scale_ptr, sorted_ptr, active_ptr, count_ptr, start_ptr,
        Dn, Dv, C, HEAD_ROWS,
        sol_t, sol_h, sa_s, sa_r, sb_s, sb_o, sb_r, so_t, so_h,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        h = tl.program_id(1)
        live, s64, scale, rows, mask_m, offs_r, mask_r = _group_rows(ranks_ptr, scale_ptr, sorted_ptr, active_ptr,
                                                                     count_ptr, start_ptr, BLOCK_M, BLOCK_R)
        if live == 0:
            return
        u = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)  # A[s] o_lat[t, h]
        offs_c = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + offs_c
            mask_c = cc < C
            o = tl.load(ol_ptr + rows[:, None] * sol_t + h * sol_h + cc[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
            at = tl.load(a_ptr + s64 * sa_s + offs_r[None, :] * sa_r + cc[:, None], mask=mask_r[None, :] & mask_c[:, None], other=0.0)
            u += tl.dot(o.to(at.dtype), at, input_precision=PRECISION)  # [BM, BR]
        u = u * scale
        offs_v = tl.arange(0, BLOCK_V)
        for v0 in range(0, Dv, BLOCK_V):
            vv = v0 + offs_v
            mask_v = vv < Dv
            bv = tl.load(b_ptr + s64 * sb_s + (h * HEAD_ROWS + Dn + vv[None, :]) * sb_o + offs_r[:, None] * sb_r,
                         mask=mask_r[:, None] & mask_v[None, :], other=0.0)  # [BR, BV]
            d = tl.dot(u.to(bv.dtype), bv, input_precision=PRECISION)
            ptrs = out_ptr + rows[:, None] * so_t + h * so_h + vv[None, :]
            mask = mask_m[:, None] & mask_v[None, :]
            y = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (y.to(tl.float32) + d).to(out_ptr.dtype.element_ty), mask=mask)


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _num_splits(rows: int, head_blocks: int) -> int:
    """Split the context so a small batch still fills the GPU; fixed per batch size (a graph replays it)."""
    if not torch.cuda.is_available():
        return 2  # the interpreter: exercise the merge
    return max(1, min(16, -(-2 * num_sms(torch.cuda.current_device()) // max(rows * head_blocks, 1))))


def mla_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         token_seq: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         num_splits: int | None = None) -> torch.Tensor:
    """The attention core of absorbed decode (one shared latent head). Semantics, per row t with
    b = token_seq[t] (-1: padding, output 0), L = seq_lens[b], rows = cache positions 0..L-1 of b:
        o_lat[t, h] = softmax([q_lat | q_pe][t, h] . rows^T * scale) @ rows[:, :C]      # softmax in fp32
    q_lat: [T, H, C] · q_pe: [T, H, R] (any strides, last dim contiguous) · kv_cache: [NB, BS, C + R]
    block_tables: [B, max_blocks] int32 · token_seq: [T] int32 · seq_lens: [B] int32 · returns o_lat [T, H, C] fp32
    """
    require_triton()
    T, H, C = q_lat.shape
    R = q_pe.shape[-1]
    _, BS, _ = kv_cache.shape
    block_h = 16
    hb = triton.cdiv(H, block_h)
    ns = num_splits or _num_splits(T, hb)
    out = torch.empty(T, H, C, dtype=torch.float32, device=q_lat.device)
    cnt = split_counters(q_lat.device, T * hb) if ns > 1 else None
    if cnt is None:  # one split, or no arrival counters yet inside a graph capture (split_counters)
        ns, cnt, o_part, lse = 1, out, out[:, :, None], out
    else:
        o_part = torch.empty(T, H, ns, C, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(T, H, ns, dtype=torch.float32, device=q_lat.device)
    block_c = _p2(C)
    _mla_attn_kernel[(T, hb, ns)](
        q_lat, q_pe, kv_cache, block_tables, token_seq, seq_lens, o_part, lse, out, cnt,
        scale, H, C, R, BS,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=_p2(R), BLOCK_N=32 if block_c <= 256 else 16,
        NUM_SPLITS=ns, PRECISION=dot_precision(kv_cache.dtype),
        num_warps=8 if block_c >= 512 else 4,
    )
    return out


def mla_kvb_lora_q(q_nope: torch.Tensor, lora: KVBLoRAArgs, q_lat: torch.Tensor) -> None:
    """Key side of kv_b_proj's LoRA, folded into the absorbed query. Semantics, per row t with s = token_slots[t]:
        if s >= 0 and r = ranks[0, s] > 0:
            q_lat[t, h] += scaling[0, s] * A[s, :r].T @ (B_K[s, h, :, :r].T @ q_nope[t, h])
    q_nope: [T, H, Dn] · q_lat: [T, H, C] updated in place · lora.a: [1, S, Rmax, C] · lora.b: [S, H*(Dn+Dv), Rmax]
    lora.groups: the batch's SlotGroups (tokens grouped by slot)
    """
    require_triton()
    T, H, Dn = q_nope.shape
    C = q_lat.shape[-1]
    g = lora.groups
    a, b = lora.a[0], lora.b
    S, Rmax, _ = a.shape
    bm = 16 if T <= 16 else 32
    _kvb_lora_q_kernel[(triton.cdiv(T, bm), H, g.active_slots.shape[0])](
        q_nope, a, b, q_lat, lora.ranks, lora.scaling, g.sorted_token_ids, g.active_slots, g.slot_counts, g.slot_starts,
        Dn, C, b.shape[1] // H,
        q_nope.stride(0), q_nope.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        q_lat.stride(0), q_lat.stride(1),
        BLOCK_M=bm, BLOCK_R=_p2(Rmax), BLOCK_D=min(_p2(Dn), 64), BLOCK_C=min(_p2(C), 128),
        PRECISION=dot_precision(a.dtype),
    )


def mla_kvb_lora_o(o_lat: torch.Tensor, lora: KVBLoRAArgs, out: torch.Tensor) -> None:
    """Value side of kv_b_proj's LoRA, after attention. Semantics, per row t with s = token_slots[t]:
        if s >= 0 and r = ranks[0, s] > 0:
            out[t, h] += scaling[0, s] * B_V[s, h, :, :r] @ (A[s, :r] @ o_lat[t, h])
    o_lat: [T, H, C] · out: [T, H, Dv] updated in place · lora as mla_kvb_lora_q
    """
    require_triton()
    T, H, C = o_lat.shape
    Dv = out.shape[-1]
    g = lora.groups
    a, b = lora.a[0], lora.b
    S, Rmax, _ = a.shape
    head_rows = b.shape[1] // H
    bm = 16 if T <= 16 else 32
    _kvb_lora_o_kernel[(triton.cdiv(T, bm), H, g.active_slots.shape[0])](
        o_lat, a, b, out, lora.ranks, lora.scaling, g.sorted_token_ids, g.active_slots, g.slot_counts, g.slot_starts,
        head_rows - Dv, Dv, C, head_rows,
        o_lat.stride(0), o_lat.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_R=_p2(Rmax), BLOCK_V=min(_p2(Dv), 64), BLOCK_C=min(_p2(C), 128),
        PRECISION=dot_precision(a.dtype),
    )


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
               block_tables: torch.Tensor, token_seq: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               lora: KVBLoRAArgs | None = None) -> torch.Tensor:
    """Absorbed decode, one new token per sequence, device metadata only. Semantics, per row t with
    b = token_seq[t] (-1: padding, output 0), s = token_slots[t], rows = cache positions 0..seq_lens[b]-1 of b:
        q_lat[t, h] = W_UK[h].T @ q_nope[t, h] (+ scaling[s] * A[s].T @ (B_K[s, h].T @ q_nope[t, h]))   # [C]
        o_lat[t, h] = softmax([q_lat | q_pe][t, h] . rows^T * scale) @ rows[:, :C]                        # [C]
        out[t, h]   = W_UV[h] @ o_lat[t, h] (+ scaling[s] * B_V[s, h] @ (A[s] @ o_lat[t, h]))            # [Dv]
    q_nope: [T, H, Dn] · q_pe: [T, H, R] · kv_cache: [NB, BS, C + R] · w_kv_b: [H*(Dn+Dv), C]
    block_tables: [B, max_blocks] int32 · token_seq: [T] int32 · seq_lens: [B] int32
    lora: KVBLoRAArgs with groups set, or None · returns [T, H, Dv] in q's dtype
    """
    T, H, Dn = q_nope.shape
    C = w_kv_b.shape[1]
    w = w_kv_b.view(H, -1, C)  # [H, Dn+Dv, C]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :Dn]).transpose(0, 1)  # [T, H, C] (a view of [H, T, C])
    if lora is not None:
        mla_kvb_lora_q(q_nope, lora, q_lat)
    o_lat = mla_decode_attention(q_lat, q_pe, kv_cache, block_tables, token_seq, seq_lens, scale).to(q_nope.dtype)
    out = torch.bmm(o_lat.transpose(0, 1), w[:, Dn:].transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
    if lora is not None:
        mla_kvb_lora_o(o_lat, lora, out)
    return out
