"""Triton attention over the paged KV cache, for a flat batch of query tokens (prefill, chunked prefill
and decode mixed), reading only device tensors (CUDA-graph safe). Reference: attention.paged_attention_ref.

One program per (query token, KV head): the token's query heads of that group attend to its causal
prefix in the cache (the cache already holds this step's keys), block by block through the block
table, with an online softmax in fp32.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        scale, window, G,
        sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt_b,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.load(token_seq_ptr + t)
        if b < 0:  # padding row
            return
        L = tl.load(seq_lens_ptr + b)
        s0 = tl.load(qsl_ptr + b)
        n = tl.load(qsl_ptr + b + 1) - s0
        pos = L - n + (t - s0)  # position of this query token
        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < G
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        offs_s = tl.arange(0, BLOCK_SIZE)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0) // BLOCK_SIZE
        for blk in range(lo, pos // BLOCK_SIZE + 1):
            block_id = tl.load(bt_ptr + b.to(tl.int64) * sbt_b + blk).to(tl.int64)
            key_pos = blk * BLOCK_SIZE + offs_s
            valid = key_pos <= pos
            if HAS_WINDOW:
                valid = valid & (key_pos > pos - window)
            k = tl.load(k_ptr + block_id * sk_b + offs_s[:, None] * sk_s + kvh * sk_h + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BS, D]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + block_id * sv_b + offs_s[:, None] * sv_s + kvh * sv_h + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BS, D]
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Semantics, per query row t of sequence b = token_seq[t] (-1: padding, left untouched), with
    L = seq_lens[b], s:e = query_start_loc[b]:query_start_loc[b+1], p = L - (e - s) + (t - s):
        out[t, h] = softmax_j(q[t, h] . k[j, h // G] * scale) @ v[.., h // G] over cache positions j <= p
        (and j > p - sliding_window), k/v of sequence b read through block_tables[b]; G = Hq // Hkv
    q: [T, Hq, D] · k_cache, v_cache: [NB, BS, Hkv, D] · block_tables: [B, max_blocks] int32
    token_seq: [T] int32 · seq_lens: [B] int32 · query_start_loc: [B+1] int32 · out: [T, Hq, D]
    """
    require_triton()
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    _paged_attn_kernel[(T, Hkv)](
        q, k_cache, v_cache, out, block_tables, token_seq, seq_lens, query_start_loc,
        scale, sliding_window or 0, G,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        BLOCK_SIZE=BS, BLOCK_G=triton.next_power_of_2(G), D=D, BLOCK_D=triton.next_power_of_2(D),
        HAS_WINDOW=sliding_window is not None,
    )
