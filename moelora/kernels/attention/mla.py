"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, with per-slot kv_b_proj LoRA.

Cache layout, per layer: kv_cache [num_blocks, block_size, C + R] holds, for every token, its C = kv_lora_rank
latent (after kv_a_layernorm) followed by its R = qk_rope_head_dim rotated key, which all heads share.
kv_b_proj, W [H * (Dn + Dv), C], maps a latent to head h's k_nope (rows h*(Dn+Dv) .. h*(Dn+Dv)+Dn) and v (the
next Dv rows): W_UK [H, Dn, C] and W_UV [H, Dv, C]. Its LoRA (A [r, C], B [H*(Dn+Dv), r], scaling) splits the
same way into B_K [H, Dn, r] and B_V [H, Dv, r]. The flat-batch conventions (block_tables, seq_lens,
query_start_loc, the causal rule) are those of attention.paged_attention_ref.

Two forms of one function:
- expanded (prefill): k_nope, v = (W + scaling * B A) latent for every context token, then attention with
  q = [q_nope | q_pe] and k = [k_nope | k_pe];
- absorbed (decode): q_lat = W_UK^T q_nope + scaling * A^T (B_K^T q_nope) (the key side folded into the query,
  the LoRA kept factored), attention of [q_lat | q_pe] over the cached [latent | k_pe] rows (one shared head;
  the values are the latents), then o = W_UV o_lat + scaling * B_V (A o_lat). Per-step work does not grow with
  the context beyond reading the latents, and no adapter's weights are ever merged into W.
The Triton absorbed decode (mla_triton.mla_decode) reads device metadata only; its reference is
mla_decode_paged_ref below (one new token per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels.lora.groups import SlotGroups


@dataclass
class KVBLoRAArgs:
    """kv_b_proj LoRA buffers of one layer (LoRAWeights with one slice) and the batch's token -> slot map.

    a: [1, S, Rmax, C] · b: [S, H*(Dn+Dv), Rmax] · scaling: [1, S] fp32 · ranks: [1, S] int32
    token_slots: [T] int32, -1 = no adapter; all tokens of one sequence carry the same slot
    groups: the same rows grouped by slot (what the Triton kernels read); None for the references
    """

    token_slots: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor
    ranks: torch.Tensor
    groups: SlotGroups | None = None


def write_latent_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Semantics:
        for t in range(T):
            if slot_mapping[t] >= 0: kv_cache.view(-1, C + R)[slot_mapping[t]] = cat(kv_c[t], k_pe[t])
    kv_c: [T, C] · k_pe: [T, R] · kv_cache: [NB, BS, C + R] · slot_mapping: [T] int64 (-1 = padding, skipped)
    """
    keep = slot_mapping >= 0
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep]  # [T', C + R]
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[keep]] = rows.to(kv_cache.dtype)


def write_latent_direct(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """write_latent_ref without the mask (no host synchronisation, CUDA-graph safe): every slot_mapping[t] >= 0;
    padding rows of a graph batch point at the cache's dummy block instead of -1."""
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)


def _context(kv_cache: torch.Tensor, block_tables: torch.Tensor, b: int, L: int) -> torch.Tensor:
    """The L cached rows [L, C + R] of sequence b, in position order."""
    BS = kv_cache.shape[1]
    blocks = block_tables[b, : (L + BS - 1) // BS].long()
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:L]


def _causal(n: int, L: int, device) -> torch.Tensor:
    """[n, L] bool: the n new rows sit at positions L-n .. L-1 and see keys at positions <= their own."""
    pos = torch.arange(L - n, L, device=device)[:, None]
    return torch.arange(L, device=device)[None, :] <= pos


def _slot_factors(lora: KVBLoRAArgs | None, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(A [r, C], B [H*(Dn+Dv), r], scaling) of a slot; None for slot -1, rank 0 or no LoRA."""
    if lora is None or slot < 0:
        return None
    r = int(lora.ranks[0, slot])
    if r == 0:
        return None
    return lora.a[0, slot, :r], lora.b[slot, :, :r], lora.scaling[0, slot]


def mla_prefill_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int], scale: float,
                    lora: KVBLoRAArgs | None = None) -> torch.Tensor:
    """Expanded form. Semantics, per sequence b (rows s:e, L = seq_lens[b], slot = token_slots[s]):
        lat, k_pe = cache rows 0..L-1 of b split at C                          # [L, C], [L, R]
        kv = lat @ W.T (+ scaling[slot] * (lat @ A[slot].T) @ B[slot].T)          # [L, H*(Dn+Dv)]
        k_nope, v = kv.view(L, H, Dn+Dv) split at Dn; k = [k_nope | k_pe for every head]
        out[s+i] = softmax([q_nope | q_pe] . k^T * scale, causal) @ v            # softmax in fp32
    q_nope: [T, H, Dn] · q_pe: [T, H, R] · kv_cache: [NB, BS, C + R] · w_kv_b: [H*(Dn+Dv), C]
    block_tables: [B, max_blocks] int · seq_lens, query_start_loc: host lists · returns [T, H, Dv] in q's dtype
    """
    T, H, Dn = q_nope.shape
    C = w_kv_b.shape[1]
    Dv = w_kv_b.shape[0] // H - Dn
    dt = q_nope.dtype
    out = q_nope.new_zeros(T, H, Dv)
    for b, L in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        ctx = _context(kv_cache, block_tables, b, L).to(dt)
        lat, k_pe = ctx[:, :C], ctx[:, C:]
        kv = lat @ w_kv_b.T  # [L, H*(Dn+Dv)]
        f = _slot_factors(lora, int(lora.token_slots[s]) if lora is not None else -1)
        if f is not None:
            a, b_s, sc = f
            kv = kv + ((lat @ a.T) @ b_s.T) * sc.to(dt)
        kv = kv.view(L, H, Dn + Dv)
        k = torch.cat([kv[..., :Dn], k_pe[:, None, :].expand(L, H, k_pe.shape[-1])], dim=-1)  # [L, H, Dn+R]
        v = kv[..., Dn:]  # [L, H, Dv]
        q = torch.cat([q_nope[s:e], q_pe[s:e]], dim=-1)  # [n, H, Dn+R]
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        scores = scores.masked_fill(~_causal(e - s, L, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt)
        out[s:e] = torch.einsum("hnl,lhv->nhv", probs, v)
    return out


def mla_decode_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int], scale: float,
                   lora: KVBLoRAArgs | None = None) -> torch.Tensor:
    """Absorbed form (the same function as mla_prefill_ref; any number of rows per sequence, causal).
    Semantics, per token t with slot s = token_slots[t]:
        q_lat[t, h] = W_UK[h].T @ q_nope[t, h] (+ scaling[s] * A[s].T @ (B_K[s, h].T @ q_nope[t, h]))   # [C]
        o_lat[t, h] = softmax([q_lat | q_pe][t, h] . cache_rows^T * scale, causal) @ cache_rows[:, :C]  # [C]
        out[t, h]   = W_UV[h] @ o_lat[t, h] (+ scaling[s] * B_V[s, h] @ (A[s] @ o_lat[t, h]))           # [Dv]
    shapes as mla_prefill_ref · returns [T, H, Dv] in q's dtype
    """
    T, H, Dn = q_nope.shape
    C = w_kv_b.shape[1]
    Dv = w_kv_b.shape[0] // H - Dn
    dt = q_nope.dtype
    w = w_kv_b.view(H, Dn + Dv, C)
    w_uk, w_uv = w[:, :Dn], w[:, Dn:]  # [H, Dn, C], [H, Dv, C]
    q_lat = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, C]
    groups = []  # per slot with LoRA on kv_b: (rows, A [r, C], B_K [H, Dn, r], B_V [H, Dv, r], scaling)
    if lora is not None:
        slots = lora.token_slots.long()
        for slot in torch.unique(slots).tolist():
            f = _slot_factors(lora, slot)
            if f is not None:
                a, b_s, sc = f
                bh = b_s.reshape(H, Dn + Dv, -1)
                groups.append(((slots == slot).nonzero().squeeze(1), a, bh[:, :Dn], bh[:, Dn:], sc.to(dt)))
    for rows, a, bk, _, sc in groups:
        h = torch.einsum("thd,hdr->thr", q_nope[rows], bk)  # [m, H, r]
        q_lat[rows] += (h @ a) * sc  # [m, H, C]
    o_lat = q_nope.new_zeros(T, H, C)
    for b, L in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        ctx = _context(kv_cache, block_tables, b, L).to(dt)  # [L, C+R]
        q = torch.cat([q_lat[s:e], q_pe[s:e]], dim=-1)  # [n, H, C+R]
        scores = torch.einsum("nhc,lc->hnl", q, ctx) * scale
        scores = scores.masked_fill(~_causal(e - s, L, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt)
        o_lat[s:e] = torch.einsum("hnl,lc->nhc", probs, ctx[:, :C])
    out = torch.einsum("thc,hvc->thv", o_lat, w_uv)  # [T, H, Dv]
    for rows, a, _, bv, sc in groups:
        h = o_lat[rows] @ a.T  # [m, H, r]
        out[rows] += torch.einsum("thr,hvr->thv", h, bv) * sc
    return out


def mla_decode_paged_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                         block_tables: torch.Tensor, token_seq: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         lora: KVBLoRAArgs | None = None) -> torch.Tensor:
    """mla_decode_ref for one new token per sequence, from device metadata (the signature of the Triton
    mla_triton.mla_decode). Row t is the newest token of sequence token_seq[t] (-1: padding, output 0), which
    holds seq_lens[token_seq[t]] cached tokens. token_seq: [T] int32 · seq_lens: [B] int32; else as mla_decode_ref.
    """
    T, H, _ = q_nope.shape
    Dv = w_kv_b.shape[0] // H - q_nope.shape[-1]
    out = q_nope.new_zeros(T, H, Dv)
    seq = token_seq.long().cpu()
    rows = (seq >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    lens = seq_lens.long().cpu()[seq[rows]].tolist()
    tables = block_tables[seq[rows].to(block_tables.device)]
    sub = None
    if lora is not None:
        sub = KVBLoRAArgs(lora.token_slots[rows.to(lora.token_slots.device)], lora.a, lora.b, lora.scaling, lora.ranks)
    dev_rows = rows.to(q_nope.device)
    out[dev_rows] = mla_decode_ref(q_nope[dev_rows], q_pe[dev_rows], kv_cache, w_kv_b, tables, lens,
                                   list(range(len(lens) + 1)), scale, sub)
    return out
