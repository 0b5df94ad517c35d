"""Triton routed-expert (fused MoE) base path: alignment of (token, k) pairs by expert, a grouped GEMM
that reads its input rows by index and writes pair rows directly, SiLU-and-mul, the router-weighted
combine over k, and the softmax + top-k router. No host synchronisation and static output sizes
(they depend only on T, K, E and the block size), so every launcher can be captured in a CUDA graph.

Pairs: p = t * K + k (pair-major, as fused_moe_pairs lays out its intermediates). Expert weights as
transformers >= 5 stores them: gate_up [E, 2I, H] (gate rows first), down [E, H, I] (row-major; the GEMM
reads w[e] transposed through its strides).

Launches per MoE layer (no LoRA): route (1) + align (1; 3 above 2048 pairs) + gate_up GEMM with SiLU-and-mul fused (1) +
down GEMM (1) + combine (1). With LoRA the gate_up GEMM writes gu [P, 2I] (the LoRA delta is added to
it before the activation), then silu_and_mul (1).

Torch references sit beside each kernel (`*_ref`); tests/test_kernels_fused_moe.py checks them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelora.kernels._triton import HAS_TRITON, _env_choice, dot_precision, require_triton
from moelora.kernels.streams import launched_on

if HAS_TRITON:
    import triton
    import triton.language as tl


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of the grouped GEMM. block_m also fixes the padding of the alignment."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(num_pairs: int, fuse_act: bool = False) -> GemmConfig:
    """Autotune-free configs by the number of (token, k) pairs P (Hopper; about P/E rows per expert).
    Decode (P <= 1024, a few rows per expert): weight streaming dominates, so BLOCK_M 16, long K tiles,
    enough N tiles for ~200+ programs. Prefill: 32/64/128-row blocks, wider N tiles, 8 warps for 128 rows.
    fuse_act: the gate_up GEMM with SiLU-and-mul fused keeps two accumulators (gate, up), so its N tile is
    halved (the same programs count as a [P, 2I] GEMM with the full tile). Tune with scripts/bench_fused_moe.py --sweep."""
    if num_pairs <= 256:  # T <= 32 at top-8
        cfg = GemmConfig(16, 64, 128, 4, 3)
    elif num_pairs <= 1024:  # T <= 128
        cfg = GemmConfig(16, 128, 128, 4, 3)
    elif num_pairs <= 2048:  # T <= 256
        cfg = GemmConfig(32, 128, 128, 4, 3)
    elif num_pairs <= 4096:  # T <= 512
        cfg = GemmConfig(64, 128, 64, 4, 3)
    else:
        cfg = GemmConfig(128, 128, 64, 8, 3)
    return halved_n(cfg) if fuse_act else cfg


def halved_n(cfg: GemmConfig) -> GemmConfig:
    """The config of the gate_up GEMM with SiLU-and-mul fused: two accumulators, half the N tile."""
    return GemmConfig(cfg.block_m, max(32, cfg.block_n // 2), cfg.block_k, cfg.num_warps, cfg.num_stages)


# ------------------------------------------------------------------------------------------- alignment


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static size of sorted_pair_ids: every non-empty expert (at most min(E, P)) pads by < block_m."""
    p_max = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (p_max + block_m - 1) // block_m * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: pairs p = t*K + k grouped by expert e = topk_ids.flatten()[p] in increasing e, each group
    in increasing p and padded with the value P to a multiple of block_m; the rest of the static buffer = P.
    A pair whose id is outside [0, E) (-1: a pair another rank's expert takes, under expert parallelism) is
    left out: no GEMM computes its row.
        sorted_pair_ids[p_max] int32 · block_expert[p_max / block_m] int32 (expert of each block, -1 if unused)
    topk_ids: [T, K] int · p_max = max_padded_pairs(T*K, E, block_m)
    """
    T, K = topk_ids.shape
    P = T * K
    p_max = max_padded_pairs(P, num_experts, block_m)
    ids = topk_ids.reshape(-1).long().cpu()
    sorted_ids = torch.full((p_max,), P, dtype=torch.int32)
    block_expert = torch.full((p_max // block_m,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        pairs = (ids == e).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        n = (pairs.numel() + block_m - 1) // block_m * block_m
        sorted_ids[pos : pos + pairs.numel()] = pairs.to(torch.int32)
        block_expert[pos // block_m : (pos + n) // block_m] = e
        pos += n
    return sorted_ids.to(topk_ids.device), block_expert.to(topk_ids.device)


if HAS_TRITON:

    @triton.jit
    def _moe_align_kernel(
        ids_ptr, slots_ptr, sorted_ptr, bexp_ptr, shift_ptr, P, E, P_MAX, NUM_BLOCKS, TOP_K, NUM_EXPERTS,
        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SLOTS: tl.constexpr,
    ):
        # one program, P <= BLOCK_P: sort the keys e * BLOCK_P + p (stable by construction; pairs on no local
        # expert get e = E and sort last), then pair i of the sorted order goes to i + shift[e], shift[e] =
        # (padded start of e's group) - (pairs on experts below e); shift goes through global scratch.
        # HAS_SLOTS: group by virtual expert slot * NUM_EXPERTS + expert instead (E = max_loras * NUM_EXPERTS),
        # slot = slots[p // TOP_K]; a pair of slot -1 or expert -1 is left out
        offs = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)  # BLOCK_E > E: bin E holds the pairs left out (and the slots past P)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        if HAS_SLOTS:
            sl = tl.load(slots_ptr + offs // TOP_K, mask=offs < P, other=-1).to(tl.int32)
            e = tl.where((sl >= 0) & (e >= 0) & (e < NUM_EXPERTS), sl * NUM_EXPERTS + e, -1)
        e = tl.where((e >= 0) & (e < E), e, E)
        s = tl.sort(e * BLOCK_P + offs)  # [BLOCK_P]
        se, sp = s // BLOCK_P, s % BLOCK_P
        counts = tl.where(offs_e < E, tl.histogram(e, BLOCK_E), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(shift_ptr + offs_e, tl.cumsum(padded, axis=0) - padded - (tl.cumsum(counts, axis=0) - counts))
        for p0 in range(0, P_MAX, BLOCK_P):  # padding everywhere first
            tl.store(sorted_ptr + p0 + offs, tl.zeros((BLOCK_P,), tl.int32) + P, mask=p0 + offs < P_MAX)
        for b0 in range(0, NUM_BLOCKS, BLOCK_P):  # blocks of no expert: -1
            tl.store(bexp_ptr + b0 + offs, tl.zeros((BLOCK_P,), tl.int32) - 1, mask=b0 + offs < NUM_BLOCKS)
        tl.debug_barrier()  # shift and the fills land before the loads and stores below (other threads)
        keep = se < E
        dest = offs + tl.load(shift_ptr + se, mask=keep, other=0)
        tl.store(sorted_ptr + dest, sp, mask=keep)
        # every block of a group holds at least one real pair, so this writes each used block's expert
        tl.store(bexp_ptr + dest // BLOCK_M, se, mask=keep)

    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, P, P_MAX, FILL,
                            BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
        # program c: counts[c, e] = #pairs of chunk c on expert e; pads sorted_ids[c*FILL : (c+1)*FILL] with P
        c = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        offs_p = tl.arange(0, BLOCK_P)
        pp = c * BLOCK_P + offs_p
        e = tl.load(ids_ptr + pp, mask=pp < P, other=-1).to(tl.int32)
        hit = (e[:, None] == offs_e[None, :]).to(tl.int32)
        tl.store(counts_ptr + c * BLOCK_E + offs_e, tl.sum(hit, axis=0))
        for f0 in range(c * FILL, (c + 1) * FILL, BLOCK_P):
            ff = f0 + offs_p
            tl.store(sorted_ptr + ff, tl.zeros((BLOCK_P,), tl.int32) + P, mask=(ff < (c + 1) * FILL) & (ff < P_MAX))

    @triton.jit
    def _align_offsets_kernel(counts_ptr, base_ptr, bexp_ptr, C, NUM_BLOCKS,
                              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
        # one program: base[c, e] = pairs of e in chunks before c (c < C), base[C, e] = start of e's group; block -> expert
        offs_e = tl.arange(0, BLOCK_E)
        offs_c = tl.arange(0, BLOCK_C)
        carry = tl.zeros((BLOCK_E,), tl.int32)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + offs_c
            ptrs = cc[:, None] * BLOCK_E + offs_e[None, :]
            tile = tl.load(counts_ptr + ptrs, mask=(cc < C)[:, None], other=0)
            tl.store(base_ptr + ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=(cc < C)[:, None])
            carry += tl.sum(tile, axis=0)
        padded = (carry + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        tl.store(base_ptr + C * BLOCK_E + offs_e, ends - padded)  # row C: the start of each expert's group
        total = tl.max(ends, axis=0)
        for b0 in range(0, NUM_BLOCKS, BLOCK_C):
            bb = b0 + offs_c
            start = bb * BLOCK_M
            be = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
            tl.store(bexp_ptr + bb, tl.where(start < total, be, -1), mask=bb < NUM_BLOCKS)

    @triton.jit
    def _align_place_kernel(ids_ptr, base_ptr, sorted_ptr, P, C, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
        # program c: each pair of chunk c goes to base[C, e] + base[c, e] + (its rank among the chunk's pairs of e)
        c = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        pp = c * BLOCK_P + tl.arange(0, BLOCK_P)
        valid = pp < P
        e = tl.load(ids_ptr + pp, mask=valid, other=-1).to(tl.int32)
        hit = (e[:, None] == offs_e[None, :]).to(tl.int32)
        base = tl.load(base_ptr + c * BLOCK_E + offs_e) + tl.load(base_ptr + C * BLOCK_E + offs_e)
        dest = tl.sum(hit * (base[None, :] + tl.cumsum(hit, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + dest, pp.to(tl.int32), mask=valid & (tl.sum(hit, axis=1) > 0))  # id -1: left out


ALIGN_ONE_PROGRAM_MAX_PAIRS = 2048  # above: three launches spread over chunks of pairs
# the base expert alignment alone (moe_align) may switch to the three launches earlier: at 2,048 pairs its one
# program took 17 µs a layer on the H200 (a profile at batch 256); not yet measured the other way
EXPERT_ALIGN_ONE_PROGRAM_MAX_PAIRS = int(os.environ.get("MOELORA_EXPERT_ALIGN_ONE_PROGRAM_MAX_PAIRS", "2048"))


def _align_one_program(ids: torch.Tensor, slots: torch.Tensor | None, top_k: int, num_experts: int, max_loras: int,
                       P: int, block_m: int, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                       stream: "torch.cuda.Stream | None" = None):
    """One launch of _moe_align_kernel over groups [0, num_experts * max_loras) (virtual experts with slots);
    stream: see moe_align."""
    groups = num_experts * max_loras
    block_e1 = triton.next_power_of_2(groups + 1)
    shift = torch.empty(block_e1, dtype=torch.int32, device=ids.device)  # scratch
    with launched_on(stream):
        _moe_align_kernel[(1,)](ids, slots if slots is not None else ids, sorted_ids, block_expert, shift, P, groups,
                                sorted_ids.shape[0], block_expert.shape[0], top_k, num_experts,
                                BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_E=block_e1,
                                HAS_SLOTS=slots is not None, num_warps=4 if P <= 512 else 8)
    return sorted_ids, block_expert


LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS = 8192  # virtual experts (max_loras x E) the one-program alignment takes


def moe_lora_align_one_program(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                               block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora.moe_lora_align (same groups, order and padding: stable) in one launch of one program, for
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS and max_loras * E < LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS (checked here).
    topk_ids: [T, K] · token_slots: [T] int · returns sorted_pair_ids [P_max] int32, block_vexpert int32."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    V = num_experts * max_loras
    if P > ALIGN_ONE_PROGRAM_MAX_PAIRS or V >= LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS:
        raise ValueError(f"moe_lora_align_one_program: {P} pairs over {V} virtual experts; at most "
                         f"{ALIGN_ONE_PROGRAM_MAX_PAIRS} pairs and {LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS - 1} groups")
    p_max = max_padded_pairs(P, V, block_m)
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=topk_ids.device)
    bvex = torch.empty(p_max // block_m, dtype=torch.int32, device=topk_ids.device)
    return _align_one_program(topk_ids.reshape(-1), token_slots, K, num_experts, max_loras, P, block_m, sorted_ids, bvex)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              stream: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_ref on the device: no atomics (stable inside each group), no host sync.
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS (and MOELORA_EXPERT_ALIGN_ONE_PROGRAM_MAX_PAIRS, default the same): one
    launch of one program (tl.sort of the pairs by expert, a histogram for
    the group sizes); larger P: count per chunk of pairs (C programs), offsets (1 program), placement (C programs).
    stream: launch on this CUDA stream instead (its priority places the program; set_moe_lora_early mode "2"): it
    waits for the current stream's work so far, the current stream waits for the launches; the outputs are
    allocated on the current stream. None: the current stream.
    topk_ids: [T, K] int · returns sorted_pair_ids [p_max] int32 (pad = T*K), block_expert [p_max/block_m] int32
    """
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    p_max = max_padded_pairs(P, num_experts, block_m)
    n_blocks = p_max // block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_p = max(16, min(256, 16384 // block_e))
    ids = topk_ids.reshape(-1)
    if P <= min(ALIGN_ONE_PROGRAM_MAX_PAIRS, EXPERT_ALIGN_ONE_PROGRAM_MAX_PAIRS):  # decode: one sort of all pairs
        return _align_one_program(ids, None, 1, num_experts, 1, P, block_m, sorted_ids, block_expert, stream)
    C = triton.cdiv(P, block_p)
    counts = torch.empty(C, block_e, dtype=torch.int32, device=dev)
    base = torch.empty(C + 1, block_e, dtype=torch.int32, device=dev)
    with launched_on(stream):
        _align_count_kernel[(C,)](ids, counts, sorted_ids, P, p_max, triton.cdiv(p_max, C),
                                  BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
        _align_offsets_kernel[(1,)](counts, base, block_expert, C, n_blocks,
                                    BLOCK_M=block_m, BLOCK_C=max(16, 8192 // block_e), BLOCK_E=block_e, num_warps=8)
        _align_place_kernel[(C,)](ids, base, sorted_ids, P, C, BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
    return sorted_ids, block_expert


# ----------------------------------------------------------------------------------------- grouped GEMM


def expert_gemm_ref(
    inp: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, gather_rows: bool,
    pair_weights: torch.Tensor | None = None, fuse_act: bool = False,
) -> torch.Tensor:
    """Semantics: for p in range(T*K): e = topk_ids.flatten()[p]; row = inp[p // K] if gather_rows else inp[p]
        y = w[e] @ row                                  # [O], fp32 accumulation
        fuse_act: y = silu(y[:O/2]) * y[O/2:]           # gate rows first
        out[p] = y * pair_weights[p] (if given)
    inp: [T, D] (gather_rows) or [T*K, D] · w: [E, O, D] · pair_weights: [T*K] · returns [T*K, O or O/2]
    """
    T, K = topk_ids.shape
    rows = inp.float()[torch.arange(T * K, device=inp.device) // K] if gather_rows else inp.float()
    y = torch.einsum("pd,pod->po", rows, w.float()[topk_ids.reshape(-1).long()])
    if fuse_act:
        half = y.shape[1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    if pair_weights is not None:
        y = y * pair_weights.float()[:, None]
    return y.to(inp.dtype)


if HAS_TRITON:

    @triton.jit
    def _expert_gemm_kernel(
        inp_ptr, w_ptr, out_ptr, sorted_ptr, bexp_ptr, pw_ptr,
        N, D, P, HALF,
        s_im, s_id, s_we, s_wn, s_wd, s_om, s_on,
        ROW_DIV: tl.constexpr, FUSE_ACT: tl.constexpr, HAS_PW: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)  # n tiles of one block are neighbours: they share the block's input rows
        b = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < 0:
            return
        pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rows = pairs // ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_nc = tl.where(mask_n, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = inp_ptr + rows[:, None] * s_im + offs_k[None, :] * s_id  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + e.to(tl.int64) * s_we + offs_nc[None, :] * s_wn + offs_k[:, None] * s_wd  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FUSE_ACT:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                wt = tl.load(w_ptrs)
            else:
                mask_k = k0 + offs_k < D
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
            acc += tl.dot(a, wt, input_precision=PRECISION)
            if FUSE_ACT:
                if EVEN_K:
                    wu = tl.load(w_ptrs + HALF * s_wn)
                else:
                    wu = tl.load(w_ptrs + HALF * s_wn, mask=mask_k[:, None], other=0.0)
                acc_up += tl.dot(a, wu, input_precision=PRECISION)
            a_ptrs += BLOCK_K * s_id
            w_ptrs += BLOCK_K * s_wd
        if FUSE_ACT:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if HAS_PW:
            acc = acc * tl.load(pw_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * s_om + offs_n[None, :] * s_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def expert_gemm(
    inp: torch.Tensor,
    w: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor],
    num_pairs: int,
    top_k: int,
    out: torch.Tensor,
    gather_rows: bool,
    pair_weights: torch.Tensor | None = None,
    fuse_act: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Grouped GEMM over expert-aligned pairs (semantics: expert_gemm_ref, written into `out`):
        for each block b of config.block_m entries of sorted_pair_ids with e = block_expert[b] >= 0:
            for each valid pair p in the block: row = inp[p // K] if gather_rows else inp[p]
                out[p] = (w[e] @ row) [silu(gate) * up if fuse_act] [* pair_weights[p]]
    inp: [T, D] (gather_rows: the token rows, no x[pair_tok] copy) or [P, D] (per pair)
    w: [E, O, D] (any strides) · align: moe_align(topk_ids, E, config.block_m) · num_pairs: P = T*K · top_k: K
    out: [P, O] (or [P, O/2] with fuse_act) · pair_weights: [P] or None · returns out
    """
    require_triton()
    cfg = config or pick_config(num_pairs, fuse_act)
    sorted_ids, block_expert = align
    D = inp.shape[1]
    O = w.shape[1]
    N = O // 2 if fuse_act else O
    assert w.shape[2] == D and out.shape == (num_pairs, N), (inp.shape, w.shape, out.shape)
    assert sorted_ids.shape[0] == block_expert.shape[0] * cfg.block_m, "align was made with another block_m"
    grid = (triton.cdiv(N, cfg.block_n), block_expert.shape[0])
    _expert_gemm_kernel[grid](
        inp, w, out, sorted_ids, block_expert, pair_weights if pair_weights is not None else out,
        N, D, num_pairs, N,
        inp.stride(0), inp.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ROW_DIV=top_k if gather_rows else 1, FUSE_ACT=fuse_act, HAS_PW=pair_weights is not None,
        EVEN_K=D % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=dot_precision(inp.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------- activation, combine


def silu_and_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(gu[:, :I]) * gu[:, I:] in fp32, rounded once · gu: [P, 2I] · returns [P, I]."""
    half = gu.shape[1] // 2
    g = gu.float()
    return (F.silu(g[:, :half]) * g[:, half:]).to(gu.dtype)


def moe_combine_ref(o: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t] = sum_k topk_weights[t, k] * o[t*K + k] in fp32 over the k with a weight != 0 (the row
    of a weight-0 pair is never read: a pair left out of the alignment has no row), rounded once to o.dtype
    o: [T*K, H] · topk_weights: [T, K] · returns [T, H]."""
    T, K = topk_weights.shape
    w = topk_weights.float()[:, :, None]
    return torch.where(w != 0, o.view(T, K, -1).float() * w, 0.0).sum(1).to(o.dtype)


if HAS_TRITON:
    from moelora.kernels.quant.fp8_triton import store_group_quant

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, d_ptr, out_ptr, q_ptr, qs_ptr, I, s_gm, s_gn, s_dm, s_dn, s_om, s_on, s_qm,
                             s_qsm, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr = 0):
        p = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(gu_ptr + p * s_gm + offs * s_gn, mask=mask, other=0.0)
        u = tl.load(gu_ptr + p * s_gm + (offs + I) * s_gn, mask=mask, other=0.0)
        if HAS_DELTA:  # gu + delta rounded once to gu's dtype, as gu.add_(delta) would store it
            g = (g.to(tl.float32) + tl.load(d_ptr + p * s_dm + offs * s_dn, mask=mask, other=0.0)).to(g.dtype)
            u = (u.to(tl.float32) + tl.load(d_ptr + p * s_dm + (offs + I) * s_dn, mask=mask, other=0.0)).to(u.dtype)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + p * s_om + offs * s_on, y, mask=mask)
        if QUANT_GROUP > 0:  # the down projection's FP8 input, from the rounded output (no quantization launch)
            store_group_quant(tl.where(mask, y.to(tl.float32), 0.0), q_ptr + p * s_qm, qs_ptr + p * s_qsm,
                              tl.program_id(1) * BLOCK, I, 448.0, QUANT_GROUP, BLOCK)

    @triton.jit
    def _combine_kernel(o_ptr, d_ptr, w_ptr, out_ptr, H, s_op, s_oh, s_dp, s_dh, s_wt, s_wk, s_ot, s_oh2,
                        K: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            wk = tl.load(w_ptr + t * s_wt + k * s_wk).to(tl.float32)
            ok = tl.load(o_ptr + (t * K + k) * s_op + offs * s_oh, mask=mask, other=0.0)
            if HAS_DELTA:  # o + delta rounded once to o's dtype, as o.add_(delta) would store it
                dk = tl.load(d_ptr + (t * K + k) * s_dp + offs * s_dh, mask=mask, other=0.0)
                ok = (ok.to(tl.float32) + dk).to(ok.dtype)
            # a weight-0 pair adds nothing, whatever its row holds (a pair left out of the alignment: never written)
            acc += tl.where(wk != 0.0, wk * ok.to(tl.float32), 0.0)
        tl.store(out_ptr + t * s_ot + offs * s_oh2, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _delta_strides(delta: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(pointer argument, row stride, column stride) of an optional delta shaped like `like`, fp32 or like's dtype."""
    if delta is None:
        return like, 0, 0
    if delta.shape != like.shape or delta.dtype not in (torch.float32, like.dtype):
        raise ValueError(f"LoRA delta: expected fp32 or {like.dtype} {tuple(like.shape)}, found {delta.dtype} "
                         f"{tuple(delta.shape)}")
    return delta, delta.stride(0), delta.stride(1)


def silu_and_mul(gu: torch.Tensor, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
                 quant_group: int | None = None) -> torch.Tensor:
    """silu_and_mul_ref in one launch · gu: [P, 2I] · out: [P, I] (made when None) · returns out.
    delta: [P, 2I] fp32 (or gu's dtype) or None: the activation of gu + delta, the sum rounded once to gu's dtype
    first (the numbers of gu.add_(delta) then silu_and_mul, one launch and no write of the sum).
    quant_group: also quantize out per row and group as quantize_act_group(out, quant_group) would, in the same
    launch, and attach it to out (fp8_triton.attach_act_quant: an FP8 down projection reads it); skipped when
    I is not a multiple of the group."""
    require_triton()
    from moelora.kernels.quant.fp8_triton import act_quant_buffers, act_quant_ok, attach_act_quant

    P, two_i = gu.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty(P, inter, dtype=gu.dtype, device=gu.device)
    d, sdm, sdn = _delta_strides(delta, gu)
    block = min(1024, max(16, triton.next_power_of_2(inter)))
    quant = act_quant_ok(inter, quant_group, block) and P > 0
    q, qs = act_quant_buffers(out, quant_group) if quant else (out, out)
    if P:
        _silu_and_mul_kernel[(P, triton.cdiv(inter, block))](gu, d, out, q, qs, inter, gu.stride(0), gu.stride(1),
                                                             sdm, sdn, out.stride(0), out.stride(1), q.stride(0),
                                                             qs.stride(0), HAS_DELTA=delta is not None, BLOCK=block,
                                                             QUANT_GROUP=quant_group if quant else 0)
    if quant:
        attach_act_quant(out, q, qs, quant_group)
    return out


def moe_combine(o: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None,
                delta: torch.Tensor | None = None) -> torch.Tensor:
    """moe_combine_ref in one launch (deterministic: a fixed k order, no atomics).
    o: [T*K, H] · topk_weights: [T, K] · out: [T, H] (made in o.dtype when None) · returns out.
    delta: [T*K, H] fp32 (or o's dtype) or None: combines o + delta, each sum rounded once to o's dtype first (the
    numbers of o.add_(delta) then moe_combine; a weight-0 pair adds nothing, whatever its delta row holds)."""
    require_triton()
    T, K = topk_weights.shape
    H = o.shape[1]
    if out is None:
        out = torch.empty(T, H, dtype=o.dtype, device=o.device)
    d, sdp, sdh = _delta_strides(delta, o)
    block = min(1024, max(16, triton.next_power_of_2(H)))
    if T:
        _combine_kernel[(T, triton.cdiv(H, block))](o, d, topk_weights, out, H, o.stride(0), o.stride(1), sdp, sdh,
                                                    topk_weights.stride(0), topk_weights.stride(1),
                                                    out.stride(0), out.stride(1), K=K,
                                                    HAS_DELTA=delta is not None, BLOCK=block)
    return out


# -------------------------------------------------------------------------------------------- routing


if HAS_TRITON:

    @triton.jit
    def _route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t, s_e,
                           K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        x = tl.load(logits_ptr + t * s_t + offs * s_e, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.exp(x - tl.max(x, axis=0))
        x = tl.where(mask, x, 0.0)
        probs = x / tl.sum(x, axis=0)
        cur = tl.where(mask, probs, -1.0)  # probabilities are >= 0: masked lanes never win
        offs_k = tl.arange(0, BLOCK_K)
        w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for k in tl.static_range(K):
            best = tl.max(cur, axis=0)
            idx = tl.min(tl.where(cur == best, offs, BLOCK_E), axis=0)  # lowest index among ties
            w = tl.where(offs_k == k, best, w)
            ids = tl.where(offs_k == k, idx.to(tl.int64), ids)
            cur = tl.where(offs == idx, -2.0, cur)
        if RENORM:
            w = w / tl.sum(w, axis=0)
        tl.store(w_ptr + t * K + offs_k, w.to(w_ptr.dtype.element_ty), mask=offs_k < K)
        tl.store(ids_ptr + t * K + offs_k, ids, mask=offs_k < K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route_topk_ref in one launch: p = softmax(logits) (fp32); (w, ids) = topk(p, K) in decreasing p
    (ties: the lowest expert id first); if renormalize: w /= w.sum(-1); w rounded once to out_dtype.
    router_logits: [T, E] · returns topk_weights [T, K] out_dtype, topk_ids [T, K] int64."""
    require_triton()
    T, E = router_logits.shape
    w = torch.empty(T, top_k, dtype=out_dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_topk_kernel[(T,)](router_logits, w, ids, E, router_logits.stride(0), router_logits.stride(1),
                                 K=top_k, BLOCK_E=max(16, triton.next_power_of_2(E)),
                                 BLOCK_K=max(2, triton.next_power_of_2(top_k)), RENORM=renormalize,
                                 num_warps=1 if E <= 256 else 4)
    return w, ids


# --------------------------------------------------------------------------------- the whole base path


_FAST = {"enabled": os.environ.get("MOELORA_FUSED_MOE", "1") != "0", "cpu": False,
         "quantized": os.environ.get("MOELORA_FUSED_MOE_QUANT", "1") != "0"}


def set_fast_path(enabled: bool = True, on_cpu: bool = False, quantized: bool | None = None) -> None:
    """enabled: fused_moe_pairs uses this file's kernels for the base GEMMs on CUDA (False: moe._ExpertGemm,
    the torch._grouped_mm path; also MOELORA_FUSED_MOE=0). on_cpu: also on CPU tensors under
    TRITON_INTERPRET=1 (tests only). quantized: also for quantized stacks that offer `expert_gemm` on this
    alignment (FP8: fp8_triton.fp8_expert_gemm) — their GEMMs with this path's alignment, activation and
    combine (5 launches per layer instead of ~20). On by default (1.28x the decode tokens/s at batch 64 on
    the H200); off with MOELORA_FUSED_MOE_QUANT=0. None: unchanged."""
    _FAST["enabled"], _FAST["cpu"] = bool(enabled), bool(on_cpu)
    if quantized is not None:
        _FAST["quantized"] = bool(quantized)


def fast_path_ok(x: torch.Tensor, w_gate_up, w_down=None) -> bool:
    """The Triton base path: CUDA 16-bit inputs and plain weight tensors of x's dtype, or (set_fast_path(
    quantized=True)) quantized stacks whose `fast_path` is True (they run their own GEMM on this path's
    alignment); CPU inputs only when set_fast_path(on_cpu=True) under the interpreter."""
    from moelora.kernels._triton import interpreting

    if not (HAS_TRITON and _FAST["enabled"]):
        return False
    for w in (w_gate_up, w_down if w_down is not None else w_gate_up):
        if not isinstance(w, torch.Tensor):
            if not (_FAST["quantized"] and getattr(w, "fast_path", False)):
                return False
        elif w.dtype != x.dtype or w.device != x.device:
            return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16)
    return _FAST["cpu"] and interpreting()


def routing_kernel_ok(router_logits: torch.Tensor) -> bool:
    """route_topk (Triton) for CUDA logits when the fast path is enabled; otherwise route_topk_ref."""
    return HAS_TRITON and _FAST["enabled"] and router_logits.is_cuda and router_logits.shape[1] <= 4096


def lora_epilogue_ok(w) -> bool:
    """Whether TritonExperts' GEMM for expert stack w adds a routed LoRA expand in its epilogue (lora=): quantized
    stacks whose `lora_epilogue` is true (FP8: fp8_expert_gemm); plain weight tensors do not."""
    return bool(getattr(w, "lora_epilogue", False))


class TritonExperts:
    """The base expert GEMMs of one MoE layer for fused_moe_pairs (same interface as moe._ExpertGemm:
    gemm(inp, w) -> [P, O]), plus the activation and the combine. The alignment is computed once here
    and serves both projections. inp may be per token ([T, D]: rows read as p // K, no gather copy)
    or per pair ([P, D]); with K == 1 the two are the same."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, config: GemmConfig | None = None,
                 align_stream: "torch.cuda.Stream | None" = None) -> None:
        """align_stream: the alignment launched on that stream (moe_align's stream), else on the current one."""
        self.T, self.K = topk_ids.shape
        self.P = self.T * self.K
        self.topk_ids = topk_ids
        self.cfg = config or pick_config(self.P)
        self.align = moe_align(topk_ids, num_experts, self.cfg.block_m, align_stream)
        self.act_quant_group: int | None = None  # set by a quantized gate_up GEMM whose stack quantizes inputs

    def __call__(self, inp: torch.Tensor, w, fuse_act: bool = False, lora=None) -> torch.Tensor:
        """inp: [T, D] or [P, D] · w: [E, O, D], or a quantized stack with expert_gemm(inp, topk_ids, align,
        gather_rows, block_m) · returns [P, O] (fuse_act: silu(gate) * up, [P, O/2]) · lora: an
        Fp8LoRAEpilogue for a stack whose lora_epilogue is true (its expand added in the GEMM's epilogue)."""
        gather = inp.shape[0] != self.P
        if lora is not None and not lora_epilogue_ok(w):
            raise ValueError(f"TritonExperts: lora= needs an expert stack with a LoRA epilogue (FP8); found "
                             f"{type(w).__name__}")
        if not isinstance(w, torch.Tensor):  # quantized: its GEMM on this alignment, then the activation kernel
            self.act_quant_group = getattr(w, "act_quant_group", None)  # the activation quantizes for the down GEMM
            y = (w.expert_gemm(inp, self.topk_ids, self.align, gather, self.cfg.block_m) if lora is None else
                 w.expert_gemm(inp, self.topk_ids, self.align, gather, self.cfg.block_m, lora=lora))
            return silu_and_mul(y, quant_group=self.act_quant_group) if fuse_act else y
        n = w.shape[1] // 2 if fuse_act else w.shape[1]
        out = torch.empty(self.P, n, dtype=inp.dtype, device=inp.device)
        cfg = halved_n(self.cfg) if fuse_act else self.cfg
        return expert_gemm(inp, w, self.align, self.P, self.K, out, gather, fuse_act=fuse_act, config=cfg)

    def act(self, gu: torch.Tensor, activation: str, delta: torch.Tensor | None = None) -> torch.Tensor:
        """act(g[:, :I]) * g[:, I:], g = gu (+ delta, rounded once to gu's dtype) · gu: [P, 2I] · delta: [P, 2I]
        fp32 or None · returns [P, I] (one launch for silu, the delta read in it)."""
        if activation == "silu":
            return silu_and_mul(gu, delta=delta, quant_group=self.act_quant_group)
        from moelora.kernels.moe.experts import act_and_mul

        return act_and_mul(gu if delta is None else gu.add_(delta), activation)

    def combine(self, o: torch.Tensor, topk_weights: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_weights[t, k] * (o[t*K + k] (+ delta[t*K + k], rounded once to o's dtype)) · o: [P, H]
        delta: [P, H] fp32 or None · returns [T, H] in o.dtype. Inside defer_moe_combine: a placeholder instead,
        not computed, carrying (o, topk_weights, delta) for the RMSNorm that reads it next (take_moe_combine)."""
        if _DEFER_COMBINE[0]:
            out = torch.empty(self.T, o.shape[1], dtype=o.dtype, device=o.device)
            out.moe_combine = (o, topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous(), delta)
            return out
        return moe_combine(o, topk_weights, delta=delta)


# ------------------------------------------------------------------------ the combine deferred to the next norm

_DEFER_COMBINE = [False]  # inside defer_moe_combine
_COMBINE_TO_NORM = [_env_choice("MOELORA_MOE_COMBINE_TO_NORM", "1", ("0", "1"))[0] == "1"]


def set_moe_combine_to_norm(enabled: bool) -> None:
    """MoEBlock hands its routed experts' combine to the RMSNorm that reads its output next (the next layer's input
    norm, or the final norm), which computes it as it loads its input: one launch less a MoE layer (on by default:
    +0.4-0.8% at batch 64; MOELORA_MOE_COMBINE_TO_NORM=0 turns it off). Only on the Triton fast
    path, for blocks without a shared expert or forward hooks (tensor / expert parallelism add an all-reduce
    there); the same bits either way."""
    _COMBINE_TO_NORM[0] = bool(enabled)


def moe_combine_to_norm() -> bool:
    return _COMBINE_TO_NORM[0]


@contextlib.contextmanager
def defer_moe_combine(enabled: bool = True):
    """Inside: TritonExperts.combine returns a placeholder [T, H] carrying its inputs (take_moe_combine) instead of
    launching moe_combine. The caller must hand the result to a consumer that takes it (RMSNorm.add_norm does):
    the placeholder's memory holds nothing."""
    before = _DEFER_COMBINE[0]
    _DEFER_COMBINE[0] = bool(enabled)
    try:
        yield
    finally:
        _DEFER_COMBINE[0] = before


def take_moe_combine(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The (o, topk_weights, delta) a deferred combine put on its placeholder y (removed from it), or None."""
    c = getattr(y, "moe_combine", None)
    if c is not None:
        del y.moe_combine
    return c


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """moe.fused_moe_ref without LoRA, in 4 launches (align, gate_up GEMM + SiLU-and-mul, down GEMM, combine):
        out[t] = sum_k topk_weights[t, k] * W_d[e] (silu(W_g[e] x_t) * (W_u[e] x_t)),  e = topk_ids[t, k]
    x: [T, H] · w_gate_up: [E, 2I, H] · w_down: [E, H, I] · topk_weights, topk_ids: [T, K] · returns [T, H]
    """
    E = w_gate_up.shape[0]
    experts = TritonExperts(topk_ids, E, config)
    if activation == "silu":
        act = experts(x, w_gate_up, fuse_act=True)  # [P, I]
    else:
        act = experts.act(experts(x, w_gate_up), activation)
    o = experts(act, w_down)  # [P, H]
    return experts.combine(o, topk_weights)
