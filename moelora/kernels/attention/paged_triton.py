"""Triton attention over the paged KV cache, for a flat batch of query tokens (prefill, chunked prefill
and decode mixed), reading only device tensors (CUDA-graph safe). Reference: attention.paged_attention_ref.

Two kernels, each correct for any mix of rows (paged_attention picks one from shapes):

* split-KV decode ("flash-decoding"): grid (query row t, KV head, split), NUM_SPLITS from shapes only
  (choose_splits: T, Hkv and the SM count), so the launch is the same whatever the lengths and works
  inside a CUDA graph. A row's visible keys [lo, p] (lo = 0 or the window's start) are cut into at most
  NUM_SPLITS chunks of whole TILE_N-key tiles (>= SPLIT_MIN_TILES each); a program attends the
  G = Hq // Hkv query heads of its KV head (padded to >= 16 rows) to its chunk, a tile at a time (block
  ids gathered per key from the block table), with tl.dot (tensor cores) and an online softmax in fp32;
  programs without a chunk exit at once. With NUM_SPLITS > 1 each program writes its partial (normalised acc,
  log-sum-exp) to an fp32 workspace and counts itself in an arrival counter of its (row, KV head); the one
  arriving last combines the chunks in index order (deterministic: no second launch); with NUM_SPLITS == 1 each
  program writes the output directly.
* tiled prefill: grid (query block, KV head) over ceil(T / BLOCK_M) + B query blocks (each sequence owns
  ceil(n_b / BLOCK_M) of them, found by a cumulative sum over query_start_loc; the rest exit); BLOCK_M rows x G heads
  = 128 tile rows share each K/V tile (tl.dot), causal and window masks per row.
"""

from __future__ import annotations

import functools

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton
from moelora.kernels.quant.split_k_triton import split_counters

TILE_N = 64  # keys per inner step of the split kernel
SPLIT_PROGRAMS_PER_SM = 4  # split-KV grid target: this many (row, KV head, split) programs per SM
MAX_SPLITS = 64  # splits per (row, KV head) at most
SPLIT_MIN_TILES = 2  # each split covers at least this many tiles (128 keys)
PREFILL_TILE_ROWS = 128  # (query row, head) pairs per program of the prefill kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.quant.fp8_act_triton import e4m3_groups

    @triton.jit
    def _split_range(token_seq_ptr, seq_lens_ptr, qsl_ptr, t, window, NUM_SPLITS, MIN_TILES,
                     TILE: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """(b, pos, lo_key, tile_lo, tiles per split, active splits) of query row t; b < 0: padding."""
        b = tl.load(token_seq_ptr + t)
        bs = tl.maximum(b, 0)
        L = tl.load(seq_lens_ptr + bs)
        s0 = tl.load(qsl_ptr + bs)
        n = tl.load(qsl_ptr + bs + 1) - s0
        pos = L - n + (t - s0)  # position of this query token: it sees keys lo_key..pos
        lo_key = pos * 0
        if HAS_WINDOW:
            lo_key = tl.maximum(pos - window + 1, 0)
        tile_lo = lo_key // TILE
        ntiles = pos // TILE + 1 - tile_lo
        tps = tl.maximum((ntiles + NUM_SPLITS - 1) // NUM_SPLITS, MIN_TILES)
        return b, pos, lo_key, tile_lo, tps, (ntiles + tps - 1) // tps

    @triton.jit
    def merge_splits(o_ptrs, lse_ptrs, so_s, n, mask_r, mask_o, LOG2: tl.constexpr):
        """The n split partials of R rows merged in split order (read past L1): sum_j w_j o_j / sum_j w_j, w_j =
        e^(lse_j - M) (2^ with LOG2), M = max_j lse_j (0 where every split is empty: lse -inf, the row gives 0).
        o_ptrs [R, C]: split 0's normalised o, split j at + j * so_s; lse_ptrs [R]: its log-sum-exp, split j at + j."""
        M = tl.full(lse_ptrs.shape, float("-inf"), tl.float32)
        for j in range(0, n):
            M = tl.maximum(M, tl.load(lse_ptrs + j, mask=mask_r, other=float("-inf"), cache_modifier=".cg"))
        M = tl.where(M == float("-inf"), 0.0, M)
        W = tl.zeros(lse_ptrs.shape, tl.float32)
        acc = tl.zeros(o_ptrs.shape, tl.float32)
        for j in range(0, n):
            x = tl.load(lse_ptrs + j, mask=mask_r, other=float("-inf"), cache_modifier=".cg") - M
            w = tl.exp2(x) if LOG2 else tl.exp(x)
            W += w
            acc += w[:, None] * tl.load(o_ptrs + j * so_s, mask=mask_o, other=0.0, cache_modifier=".cg")
        return acc / tl.maximum(W, 1e-30)[:, None]

    @triton.jit
    def _store_out(o, out_ptr, oq_ptr, os_ptr, t, heads, mask_g, mask_d, so_t, so_h, Hq, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        """o [BLOCK_G, BLOCK_D] fp32, heads `heads` of row t -> out [T, Hq, D] in its dtype and, with QUANT, the
        rounded values (0 past D) in e4m3 per head (one group of D) into oq [T, Hq * D] and the scales into os
        [T, Hq], as quantize_act_group does."""
        mask_o = mask_g[:, None] & mask_d[None, :]
        offs_d = tl.arange(0, BLOCK_D)
        ob = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h + offs_d[None, :], ob, mask=mask_o)
        if QUANT:
            q, scale = e4m3_groups(tl.where(mask_o, ob.to(tl.float32), 0.0), 448.0)  # scale: [BLOCK_G]
            row = t.to(tl.int64) * Hq + heads
            tl.store(oq_ptr + row[:, None] * D + offs_d[None, :], q.to(oq_ptr.dtype.element_ty), mask=mask_o)
            tl.store(os_ptr + row, scale, mask=mask_g)

    @triton.jit
    def _paged_attn_split_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_lse_ptr, cnt_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        scale, window, G, NUM_SPLITS, MIN_TILES,
        sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt_b,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        oq_ptr=None, os_ptr=None, QUANT: tl.constexpr = False,
    ):
        # QUANT: also out quantized per (row, head) for an FP8 o_proj: oq [T, Hq * D] e4m3 and
        # os [T, Hq] fp32 (one scale group = one head: D == the GEMM's group), the numbers of quantize_act_group
        # program (t, kvh, sp): query row t, its G heads of KV head kvh, the sp-th chunk of tps tiles of
        # the row's key range [lo_key, pos] (tiles of TILE positions counted from lo_key's tile)
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        b, pos, lo_key, tile_lo, tps, n_active = _split_range(
            token_seq_ptr, seq_lens_ptr, qsl_ptr, t, window, NUM_SPLITS, MIN_TILES, TILE, HAS_WINDOW)
        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < G
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        heads = kvh * G + offs_g
        if (b < 0) & (sp == 0):  # padding row, written 0 (no zero-filled output buffer needed)
            _store_out(tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32), out_ptr, oq_ptr, os_ptr, t, heads, mask_g,
                       mask_d, so_t, so_h, tl.num_programs(1) * G, D, BLOCK_D, QUANT)
        if (b < 0) | (sp >= n_active):  # padding row, or nothing left for this split
            return
        k_lo = (tile_lo + sp * tps) * TILE  # its first tile holds a visible key (lo_key or k_lo itself)
        k_hi = tl.minimum(k_lo + tps * TILE, pos + 1)

        q = tl.load(q_ptr + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2; m_i in log2 units
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        offs_n = tl.arange(0, TILE)
        bt_row = bt_ptr + b.to(tl.int64) * sbt_b
        for k0 in range(k_lo, k_hi, TILE):
            key = k0 + offs_n  # [TILE] cache positions
            valid = (key < k_hi) & (key >= lo_key)
            blk = tl.load(bt_row + key // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [TILE] block ids
            slot = key % BLOCK_SIZE
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + blk[:, None] * sk_b + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # [TILE, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, TILE] fp32, log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a visible key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * sv_b + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # [TILE, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        o = acc / l_i[:, None]
        if DIRECT:
            _store_out(o, out_ptr, oq_ptr, os_ptr, t, heads, mask_g, mask_d, so_t, so_h, tl.num_programs(1) * G, D,
                       BLOCK_D, QUANT)
        else:
            # partials to the workspace: ws_o [T, Hq, NUM_SPLITS, D], ws_lse [T, Hq, NUM_SPLITS] (log2 units), fp32;
            # the split arriving last for (t, kvh) (cnt: one counter a (row, KV head), left at 0) merges the row's
            # active splits (merge_splits)
            row0 = (t.to(tl.int64) * (G * tl.num_programs(1)) + heads) * NUM_SPLITS  # [BLOCK_G]
            o_ptrs = ws_o_ptr + row0[:, None] * D + offs_d[None, :]
            mask_o = mask_g[:, None] & mask_d[None, :]
            tl.store(o_ptrs + sp * D, o, mask=mask_o)
            tl.store(ws_lse_ptr + row0 + sp, m_i + tl.log2(l_i), mask=mask_g)
            tl.debug_barrier()  # every thread's partial stored before the count (the atomic is acq_rel, gpu scope)
            tile = t * tl.num_programs(1) + kvh
            if tl.atomic_add(cnt_ptr + tile, 1) == n_active - 1:
                _store_out(merge_splits(o_ptrs, ws_lse_ptr + row0, D, n_active, mask_g, mask_o, True), out_ptr, oq_ptr,
                           os_ptr, t, heads, mask_g, mask_d, so_t, so_h, tl.num_programs(1) * G, D, BLOCK_D, QUANT)
                tl.store(cnt_ptr + tile, 0)

    @triton.jit
    def _paged_attn_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        scale, window, G, B,
        sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt_b,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # program (i, kvh): the i-th query block over all sequences (sequence b owns ceil(n_b / BLOCK_M)
        # consecutive blocks), BLOCK_M of its rows x the G heads of KV head kvh flattened into
        # BLOCK_M * BLOCK_G tile rows, against its causal key range TILE keys at a time (tl.dot)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        # this block's sequence: the first b whose cumulative block count passes pid
        offs_b = tl.arange(0, BLOCK_B)
        mask_b = offs_b < B
        start_b = tl.load(qsl_ptr + offs_b, mask=mask_b, other=0)
        nblk = (tl.load(qsl_ptr + offs_b + 1, mask=mask_b, other=0) - start_b + BLOCK_M - 1) // BLOCK_M  # [BLOCK_B]
        cum_end = tl.cumsum(nblk, axis=0)  # inclusive
        seq = tl.sum(((cum_end <= pid) & mask_b).to(tl.int32), axis=0)
        if seq >= B:  # past the last block
            return
        j = pid - tl.sum(tl.where(offs_b < seq, nblk, 0), axis=0)  # block index within the sequence
        L = tl.load(seq_lens_ptr + seq)
        s0 = tl.load(qsl_ptr + seq)
        n = tl.load(qsl_ptr + seq + 1) - s0
        offs = tl.arange(0, BLOCK_M * BLOCK_G)
        i_row = j * BLOCK_M + offs // BLOCK_G  # row index within the sequence's new tokens
        g = offs % BLOCK_G
        t = s0 + i_row  # flat row
        in_seq = i_row < n
        row_ok = in_seq & (g < G)
        row_ok = row_ok & (tl.load(token_seq_ptr + t, mask=in_seq, other=-1) == seq)
        pos = L - n + i_row  # [M] query positions
        head = kvh * G + g
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q = tl.load(q_ptr + t.to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None] & mask_d[None, :], other=0.0)  # [M, BLOCK_D]
        pos_max = L - n + tl.minimum(j * BLOCK_M + BLOCK_M, n) - 1
        k_hi = pos_max + 1
        k_lo = pos_max * 0
        if HAS_WINDOW:
            k_lo = (tl.maximum(L - n + j * BLOCK_M - window + 1, 0) // TILE) * TILE
        qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2
        m_i = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_M * BLOCK_G, BLOCK_D), tl.float32)
        offs_n = tl.arange(0, TILE)
        bt_row = bt_ptr + seq.to(tl.int64) * sbt_b
        for k0 in range(k_lo, k_hi, TILE):
            key = k0 + offs_n
            kvalid = key < k_hi
            blk = tl.load(bt_row + key // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
            slot = key % BLOCK_SIZE
            kv_mask = kvalid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + blk[:, None] * sk_b + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # [TILE, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, TILE], log2 units
            allowed = key[None, :] <= pos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (key[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (window)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * sv_b + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + t.to(tl.int64)[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_workspace_numel(T: int, Hq: int, D: int, num_splits: int) -> int:
    """fp32 elements of the split-KV workspace: partial outputs [T, Hq, S, D], log-sum-exps [T, Hq, S]."""
    return T * Hq * num_splits * (D + 1) if num_splits > 1 else 0


def choose_splits(T: int, Hkv: int, num_sms: int = 132) -> int:
    """Splits per (row, KV head) of the split-KV kernel, from shapes only (CUDA-graph safe).

    Rule: enough programs to fill the GPU, SPLIT_PROGRAMS_PER_SM programs per SM:
        NUM_SPLITS = clamp(ceil(SPLIT_PROGRAMS_PER_SM * num_sms / (T * Hkv)), 1, MAX_SPLITS)
    e.g. on 132 SMs with Hkv = 4: T = 1 -> 64, 16 -> 9, 64 -> 3, 128 -> 2, >= 132 -> 1 (no workspace).
    A row's key range is cut into min(NUM_SPLITS, ceil(tiles / SPLIT_MIN_TILES)) chunks of whole TILE_N-key tiles,
    so short rows use fewer splits (the other programs exit at once), and the workspace does not grow with the
    table width (split_workspace_numel)."""
    return max(1, min(MAX_SPLITS, -(-SPLIT_PROGRAMS_PER_SM * num_sms // (T * Hkv))))


def decode_kernel_chosen(num_tokens: int, num_seqs: int, kernel: str = "auto") -> bool:
    """Whether paged_attention runs the split-KV "decode" kernel for T query rows over B sequences (it writes 0
    to padding rows, so its output buffer needs no zero-fill): "auto" picks it when T <= B."""
    if kernel not in ("auto", "decode", "prefill"):
        raise ValueError(f"kernel must be auto, decode or prefill, got {kernel!r}")
    return kernel == "decode" or (kernel == "auto" and num_tokens <= num_seqs)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_seq: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None, out: torch.Tensor, kernel: str = "auto", num_splits: int | None = None,
                    min_tiles: int | None = None, workspace: torch.Tensor | None = None,
                    out_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Semantics, per query row t of sequence b = token_seq[t] (-1: padding: written 0 by the "decode" kernel,
    left untouched by "prefill"; decode_kernel_chosen says which one runs), with
    L = seq_lens[b], s:e = query_start_loc[b]:query_start_loc[b+1], p = L - (e - s) + (t - s):
        out[t, h] = softmax_j(q[t, h] . k[j, h // G] * scale) @ v[.., h // G] over cache positions j <= p
        (and j > p - sliding_window), k/v of sequence b read through block_tables[b]; G = Hq // Hkv
    q: [T, Hq, D] · k_cache, v_cache: [NB, BS, Hkv, D] · block_tables: [B, max_blocks] int32
    token_seq: [T] int32 · seq_lens: [B] int32 · query_start_loc: [B+1] int32 · out: [T, Hq, D]

    out_fp8: (q [T, Hq * D] float8_e4m3fn, scale [T, Hq] fp32) or None: the "decode" kernel also writes
    quantize_act_group(out.reshape(T, Hq * D), D) there (padding rows included: zeros), for an FP8 o_proj whose
    scale group is one head (D a power of two); "prefill" raises.

    kernel (every kernel computes the semantics above for any mix of rows; the choice is speed only):
      "auto": "decode" when T <= B (at most ~one row per sequence: decode batches, CUDA graphs), else
              "prefill" — shapes only, so a captured graph always launches the same kernels.
      "decode": split-KV, grid (T, Hkv, NUM_SPLITS), NUM_SPLITS = num_splits or choose_splits(T, Hkv, SMs),
              chunks of at least min_tiles (default SPLIT_MIN_TILES) 64-key tiles; the partials go to `workspace`
              ([T, Hq, NUM_SPLITS, D] + [T, Hq, NUM_SPLITS] in one flat fp32 tensor of >= split_workspace_numel
              elements; None: allocated here, inside a graph capture from the graph's pool) and the split
              arriving last for a (row, KV head) combines them in a fixed order (deterministic run to run; the bits
              may change with T); its arrival counters are split_k_triton's. NUM_SPLITS == 1 (or no counters yet
              inside a graph capture): direct output, no workspace.
      "prefill": tiled; BLOCK_M rows of one sequence x G heads (128 tile rows) per (query block, KV head).
    """
    require_triton()
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    B = block_tables.shape[0]
    if T == 0:
        return
    kernel = "decode" if decode_kernel_chosen(T, B, kernel) else "prefill"
    if out_fp8 is not None and (kernel != "decode" or D & (D - 1)):
        raise ValueError(f"out_fp8: the decode kernel with a power-of-two head dim only (kernel {kernel!r}, D={D})")
    oq, os_ = out_fp8 if out_fp8 is not None else (None, None)
    quant = dict(oq_ptr=oq, os_ptr=os_, QUANT=True) if out_fp8 is not None else {}
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
               block_tables.stride(0))
    has_window = sliding_window is not None
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    BLOCK_D = max(16, triton.next_power_of_2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if kernel == "prefill":
        BLOCK_G = triton.next_power_of_2(G)
        BLOCK_M = max(1, PREFILL_TILE_ROWS // BLOCK_G)
        _paged_attn_prefill_kernel[(triton.cdiv(T, BLOCK_M) + B, Hkv)](
            q, k_cache, v_cache, out, block_tables, token_seq, seq_lens, query_start_loc,
            scale, sliding_window or 0, G, B, *strides,
            BLOCK_SIZE=BS, BLOCK_G=BLOCK_G, BLOCK_M=BLOCK_M, BLOCK_B=max(16, triton.next_power_of_2(B)), D=D,
            BLOCK_D=BLOCK_D, TILE=TILE_N,
            HAS_WINDOW=has_window, DOT_PRECISION=precision, num_warps=8, num_stages=2,
        )
        return
    if num_splits is None:
        num_splits = choose_splits(T, Hkv, num_sms(q.device.index or 0) if q.is_cuda else 132)
    min_tiles = SPLIT_MIN_TILES if min_tiles is None else min_tiles
    if min_tiles < 1 or num_splits < 1:
        raise ValueError(f"num_splits and min_tiles must be >= 1, got {num_splits}, {min_tiles}")
    cnt = split_counters(q.device, T * Hkv) if num_splits > 1 else None
    if cnt is None:  # one split, or no arrival counters yet inside a graph capture (split_counters): direct output
        num_splits, cnt, ws_o, ws_lse = 1, out, out, out  # no counters, no workspace
    else:
        n_ml = T * Hq * num_splits
        need = split_workspace_numel(T, Hq, D, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < need or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous fp32 tensor of >= {need} elements")
        ws_o, ws_lse = workspace[: n_ml * D], workspace[n_ml * D : need]
    _paged_attn_split_kernel[(T, Hkv, num_splits)](
        q, k_cache, v_cache, out, ws_o, ws_lse, cnt, block_tables, token_seq, seq_lens, query_start_loc,
        scale, sliding_window or 0, G, num_splits, min_tiles, *strides,
        BLOCK_SIZE=BS, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=BLOCK_D,
        TILE=TILE_N, HAS_WINDOW=has_window, DIRECT=num_splits == 1, DOT_PRECISION=precision,
        num_warps=4, num_stages=2, **quant,
    )
