"""Attention over a paged KV cache: cache writes and causal attention of a flat batch.

Cache layout, per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A flat batch holds the new tokens of B sequences back to back; sequence b owns query rows
query_start_loc[b]:query_start_loc[b+1] and, after this step's write, seq_lens[b] cached tokens
found through block_tables[b]. Its new tokens are the last q_len of those seq_lens[b] positions.
"""

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Semantics:
        for t in range(T):
            if slot_mapping[t] >= 0:
                k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]; the same for v
    k, v: [T, Hkv, D] · k_cache, v_cache: [NB, BS, Hkv, D] · slot_mapping: [T] int64 (-1 = padding, skipped)
    """
    keep = slot_mapping >= 0
    idx = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[idx] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[idx] = v[keep].to(v_cache.dtype)


def write_kv_direct(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """write_kv_ref without the mask (no host synchronisation, CUDA-graph safe): every slot_mapping[t] >= 0;
    padding rows of a graph batch point at the cache's dummy block instead of -1."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: list[int], query_start_loc: list[int], scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Semantics, per sequence b with L = seq_lens[b], rows s:e = query_start_loc[b]:query_start_loc[b+1]:
        keys/values = cache positions 0..L-1 of b (through block_tables[b])
        query row s+i sits at position p = L - (e - s) + i and sees key j iff j <= p
        (and j > p - sliding_window when a window is set); GQA: query head h reads kv head h // (Hq // Hkv)
        out[s+i] = softmax(q . k^T * scale) @ v, the softmax in fp32
    q: [T, Hq, D] · k_cache, v_cache: [NB, BS, Hkv, D] · block_tables: [B, max_blocks] int
    seq_lens, query_start_loc: host lists of B and B+1 ints · returns [T, Hq, D] in q.dtype
    """
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    groups = Hq // Hkv
    out = torch.zeros_like(q)
    for b, L in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        nblk = (L + BS - 1) // BS
        blocks = block_tables[b, :nblk].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L]  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L]
        k = k.repeat_interleave(groups, dim=1).transpose(0, 1).to(q.dtype)  # [Hq, L, D]
        v = v.repeat_interleave(groups, dim=1).transpose(0, 1).to(q.dtype)
        qb = q[s:e].transpose(0, 1)  # [Hq, n, D]
        n = e - s
        pos = torch.arange(L - n, L, device=q.device)[:, None]  # [n, 1]
        key = torch.arange(L, device=q.device)[None, :]  # [1, L]
        allowed = key <= pos
        if sliding_window is not None:
            allowed &= key > pos - sliding_window
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, n, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[s:e] = torch.matmul(probs, v).transpose(0, 1)
    return out
