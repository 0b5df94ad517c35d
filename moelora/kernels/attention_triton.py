"""Triton attention over the paged KV cache, for a flat batch of query tokens (prefill, chunked prefill
and decode mixed), reading only device tensors (CUDA-graph safe). Reference: attention.paged_attention_ref.

Three kernels, each correct for any mix of rows (paged_attention picks one from shapes):

* split-KV decode ("flash-decoding"): grid (query row t, KV head, partition). A partition is a fixed span
  of PART cache positions; the program attends the G = Hq // Hkv query heads of its KV head (padded to
  >= 16 rows) to the part of the row's causal range inside its partition, TILE_N keys at a time (block
  ids gathered per key from the block table), with tl.dot (tensor cores) and an online softmax in fp32.
  Partitions past the row's position (or before its sliding window) exit at once, so the grid depends
  only on shapes (T, Hkv, block_tables.shape[1]) and works inside a CUDA graph. With more than one
  partition each program writes its partial (max, sum, normalised acc) to an fp32 workspace and a
  second kernel combines the partitions in index order (deterministic); with one partition the first
  kernel writes the output directly.
* tiled prefill: grid (query block, KV head) over ceil(T / BLOCK_M) + B query blocks (each sequence owns
  ceil(n_b / BLOCK_M) of them, found by a scan of query_start_loc; the rest exit); BLOCK_M rows x G heads
  = 128 tile rows share each K/V tile (tl.dot), causal and window masks per row.
* legacy (kernel="legacy"): one program per (query row, KV head), a serial loop over the blocks with
  broadcast products (no tensor cores). Kept for comparison (scripts/bench_attention.py).
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton

TILE_N = 64  # keys per inner step of the split kernel
DEFAULT_PARTITION = 256  # cache positions per partition (multiple of TILE_N)
MAX_PARTITIONS = 512  # partitions per row at most (PART doubles past that)
MAX_WORKSPACE_ELEMS = 1 << 24  # fp32 elements of the partial-output workspace (64 MiB; PART doubles past that)
PREFILL_TILE_ROWS = 128  # (query row, head) pairs per program of the prefill kernel

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

    @triton.jit
    def _paged_attn_split_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        scale, window, G, NUM_PARTS,
        sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt_b,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        TILE: tl.constexpr, PART: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # program (t, kvh, part): query row t, its G heads of KV head kvh, cache positions
        # [part * PART, (part + 1) * PART) intersected with the row's causal (and window) range
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        b = tl.load(token_seq_ptr + t)
        if b < 0:  # padding row
            return
        L = tl.load(seq_lens_ptr + b)
        s0 = tl.load(qsl_ptr + b)
        n = tl.load(qsl_ptr + b + 1) - s0
        pos = L - n + (t - s0)  # position of this query token: it sees keys 0..pos
        start = part * PART
        lo_key = 0  # first key inside the window
        if HAS_WINDOW:
            lo_key = tl.maximum(pos - window + 1, 0)
        if (start > pos) | (start + PART <= lo_key):  # partition past the causal end or before the window
            return
        k_lo = tl.maximum(start, (lo_key // TILE) * TILE)  # tile-aligned: the first tile holds key lo_key
        k_hi = tl.minimum(start + PART, pos + 1)

        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < G
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        offs_n = tl.arange(0, TILE)
        bt_row = bt_ptr + b.to(tl.int64) * sbt_b
        for k0 in range(k_lo, k_hi, TILE):
            key = k0 + offs_n  # [TILE] cache positions
            valid = key < k_hi
            if HAS_WINDOW:
                valid = valid & (key >= lo_key)
            blk = tl.load(bt_row + key // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [TILE] block ids
            slot = key % BLOCK_SIZE
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + blk[:, None] * sk_b + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # [TILE, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, TILE] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a valid key
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * sv_b + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # [TILE, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        o = acc / l_i[:, None]
        mask_o = mask_g[:, None] & mask_d[None, :]
        if DIRECT:
            tl.store(out_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mask_o)
        else:
            # workspace: ws_o [T, Hq, NUM_PARTS, D], ws_m / ws_l [T, Hq, NUM_PARTS], all contiguous fp32
            row = (t.to(tl.int64) * (G * tl.num_programs(1)) + heads) * NUM_PARTS + part  # [BLOCK_G]
            tl.store(ws_o_ptr + row[:, None] * D + offs_d[None, :], o, mask=mask_o)
            tl.store(ws_m_ptr + row, m_i, mask=mask_g)
            tl.store(ws_l_ptr + row, l_i, mask=mask_g)

    @triton.jit
    def _paged_attn_reduce_kernel(
        out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        window, NUM_PARTS, so_t, so_h,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PART: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        # program (t, h): out[t, h] = sum_p w_p * o_p over the row's active partitions, in index order,
        # w_p = l_p * exp(m_p - M) / sum_p' l_p' * exp(m_p' - M), M = max_p m_p
        t = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.load(token_seq_ptr + t)
        if b < 0:
            return
        L = tl.load(seq_lens_ptr + b)
        s0 = tl.load(qsl_ptr + b)
        n = tl.load(qsl_ptr + b + 1) - s0
        pos = L - n + (t - s0)
        p_hi = pos // PART
        p_lo = p_hi * 0
        if HAS_WINDOW:
            p_lo = tl.maximum(pos - window + 1, 0) // PART
        row0 = (t.to(tl.int64) * tl.num_programs(1) + h) * NUM_PARTS
        offs_p = tl.arange(0, BLOCK_P)
        active = (offs_p >= p_lo) & (offs_p <= p_hi)
        m = tl.load(ws_m_ptr + row0 + offs_p, mask=active, other=float("-inf"))
        l = tl.load(ws_l_ptr + row0 + offs_p, mask=active, other=0.0)
        M = tl.max(m, axis=0)
        W = tl.sum(tl.where(active, l * tl.exp(m - M), 0.0), axis=0)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for pidx in range(p_lo, p_hi + 1):
            w = tl.load(ws_l_ptr + row0 + pidx) * tl.exp(tl.load(ws_m_ptr + row0 + pidx) - M) / W  # 1.0 if alone
            acc += w * tl.load(ws_o_ptr + (row0 + pidx) * D + offs_d, mask=mask_d, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * so_t + h * so_h + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


    @triton.jit
    def _paged_attn_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, token_seq_ptr, seq_lens_ptr, qsl_ptr,
        scale, window, G, B,
        sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt_b,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # program (i, kvh): the i-th query block over all sequences (sequence b owns ceil(n_b / BLOCK_M)
        # consecutive blocks), BLOCK_M of its rows x the G heads of KV head kvh flattened into
        # BLOCK_M * BLOCK_G tile rows, against its causal key range TILE keys at a time (tl.dot)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = pid * 0 - 1
        j = pid * 0
        cum = pid * 0
        for bb in range(0, B):  # find this block's sequence (B loads of query_start_loc, cached)
            nblk = (tl.load(qsl_ptr + bb + 1) - tl.load(qsl_ptr + bb) + BLOCK_M - 1) // BLOCK_M
            hit = (pid >= cum) & (pid < cum + nblk)
            seq = tl.where(hit, bb, seq)
            j = tl.where(hit, pid - cum, j)
            cum += nblk
        if seq < 0:  # past the last block
            return
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
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, TILE]
            allowed = key[None, :] <= pos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (key[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (window)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * sv_b + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + t.to(tl.int64)[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


def choose_partition(T: int, Hq: int, D: int, max_ctx: int, partition_size: int | None = None) -> tuple[int, int]:
    """(PART, NUM_PARTS) of the split kernel, from shapes only (CUDA-graph safe).

    Rules: PART = partition_size or DEFAULT_PARTITION (256 cache positions; a multiple of TILE_N); it doubles
    while NUM_PARTS = ceil(max_ctx / PART) > MAX_PARTITIONS or the workspace T * Hq * NUM_PARTS * D fp32
    would pass MAX_WORKSPACE_ELEMS (64 MiB). So decode batches (small T) get ~ctx/256 partitions per
    (row, KV head) and large prefill batches end with one partition (no workspace, direct output).
    The partition boundaries (PART) decide the order of the fp32 sums: same shapes -> same bits.
    """
    part = partition_size or DEFAULT_PARTITION
    if part % TILE_N:
        raise ValueError(f"partition_size must be a multiple of {TILE_N}, got {part}")
    while True:
        num_parts = max(1, -(-max_ctx // part))
        if num_parts == 1 or (num_parts <= MAX_PARTITIONS and T * Hq * num_parts * D <= MAX_WORKSPACE_ELEMS):
            return part, num_parts
        part *= 2


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
    kernel: str = "auto",
    partition_size: int | None = None,
) -> None:
    """Semantics, per query row t of sequence b = token_seq[t] (-1: padding, left untouched), with
    L = seq_lens[b], s:e = query_start_loc[b]:query_start_loc[b+1], p = L - (e - s) + (t - s):
        out[t, h] = softmax_j(q[t, h] . k[j, h // G] * scale) @ v[.., h // G] over cache positions j <= p
        (and j > p - sliding_window), k/v of sequence b read through block_tables[b]; G = Hq // Hkv
    q: [T, Hq, D] · k_cache, v_cache: [NB, BS, Hkv, D] · block_tables: [B, max_blocks] int32
    token_seq: [T] int32 · seq_lens: [B] int32 · query_start_loc: [B+1] int32 · out: [T, Hq, D]

    kernel (every kernel computes the semantics above for any mix of rows; the choice is speed only):
      "auto": "decode" when T <= B (at most ~one row per sequence: decode batches, CUDA graphs), else
              "prefill" — shapes only, so a captured graph always launches the same kernels.
      "decode": split-KV; partitions of PART cache positions from
              choose_partition(T, Hq, D, block_tables.shape[1] * BS, partition_size); partial results go
              to an fp32 workspace ([T, Hq, NUM_PARTS, D] + [2, T, Hq, NUM_PARTS], allocated here: inside a
              graph capture it comes from the graph's pool), combined by a second kernel in a fixed order.
      "prefill": tiled; BLOCK_M rows of one sequence x G heads (128 tile rows) per (query block, KV head).
      "legacy": the first kernel (one program per (row, KV head), serial over blocks, no tensor cores).
    """
    require_triton()
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    B = block_tables.shape[0]
    if T == 0:
        return
    if kernel == "auto":
        kernel = "decode" if T <= B else "prefill"
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
               block_tables.stride(0))
    has_window = sliding_window is not None
    if kernel == "legacy":
        _paged_attn_kernel[(T, Hkv)](
            q, k_cache, v_cache, out, block_tables, token_seq, seq_lens, query_start_loc,
            scale, sliding_window or 0, G, *strides,
            BLOCK_SIZE=BS, BLOCK_G=triton.next_power_of_2(G), D=D, BLOCK_D=triton.next_power_of_2(D),
            HAS_WINDOW=has_window,
        )
        return
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    BLOCK_D = max(16, triton.next_power_of_2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if kernel == "prefill":
        BLOCK_G = triton.next_power_of_2(G)
        BLOCK_M = max(1, PREFILL_TILE_ROWS // BLOCK_G)
        _paged_attn_prefill_kernel[(triton.cdiv(T, BLOCK_M) + B, Hkv)](
            q, k_cache, v_cache, out, block_tables, token_seq, seq_lens, query_start_loc,
            scale, sliding_window or 0, G, B, *strides,
            BLOCK_SIZE=BS, BLOCK_G=BLOCK_G, BLOCK_M=BLOCK_M, D=D, BLOCK_D=BLOCK_D, TILE=TILE_N,
            HAS_WINDOW=has_window, DOT_PRECISION=precision, num_warps=8, num_stages=2,
        )
        return
    if kernel != "decode":
        raise ValueError(f"kernel must be auto, decode, prefill or legacy, got {kernel!r}")
    part, num_parts = choose_partition(T, Hq, D, block_tables.shape[1] * BS, partition_size)
    direct = num_parts == 1
    if direct:
        ws_o = ws_m = ws_l = out  # unused
    else:
        ws_o = torch.empty(T, Hq, num_parts, D, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(2, T, Hq, num_parts, dtype=torch.float32, device=q.device)
        ws_m, ws_l = ws_ml[0], ws_ml[1]
    _paged_attn_split_kernel[(T, Hkv, num_parts)](
        q, k_cache, v_cache, out, ws_o, ws_m, ws_l, block_tables, token_seq, seq_lens, query_start_loc,
        scale, sliding_window or 0, G, num_parts, *strides,
        BLOCK_SIZE=BS, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=BLOCK_D,
        TILE=TILE_N, PART=part, HAS_WINDOW=has_window, DIRECT=direct, DOT_PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    if not direct:
        _paged_attn_reduce_kernel[(T, Hq)](
            out, ws_o, ws_m, ws_l, token_seq, seq_lens, query_start_loc,
            sliding_window or 0, num_parts, out.stride(0), out.stride(1),
            D=D, BLOCK_D=BLOCK_D, BLOCK_P=triton.next_power_of_2(num_parts), PART=part,
            HAS_WINDOW=has_window, num_warps=1,
        )
