"""The routed experts' pairs p = t * K + k grouped by expert (moe_align: the base expert GEMMs' blocks), or by virtual
expert slot * E + e (moe_lora_align_triton: the grouped routed-expert LoRA kernel's), with static sizes and no
host synchronisation (CUDA-graph safe). Reference: moe_align_ref; moe_lora.chain.moe_lora_align for the LoRA's."""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, pdl_args, require_triton
from moelora.kernels.streams import launched_on

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter


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
        PDL: tl.constexpr = False,
    ):
        # one program, P <= BLOCK_P: sort the keys e * BLOCK_P + p (stable by construction; pairs on no local
        # expert get e = E and sort last), then pair i of the sorted order goes to i + shift[e], shift[e] =
        # (padded start of e's group) - (pairs on experts below e); shift goes through global scratch.
        # HAS_SLOTS: group by virtual expert slot * NUM_EXPERTS + expert instead (E = max_loras * NUM_EXPERTS),
        # slot = slots[p // TOP_K]; a pair of slot -1 or expert -1 is left out
        pdl_enter(PDL)
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
    def _chunk_groups(ids_ptr, slots_ptr, pp, P, E, TOP_K, NUM_EXPERTS, HAS_SLOTS: tl.constexpr):
        # the group of each pair pp: its expert, or with slots its virtual expert slot * NUM_EXPERTS + expert; -1
        # (in no group) past P, for expert -1 or outside [0, E), and for slot -1
        e = tl.load(ids_ptr + pp, mask=pp < P, other=-1).to(tl.int32)
        if HAS_SLOTS:
            sl = tl.load(slots_ptr + pp // TOP_K, mask=pp < P, other=-1).to(tl.int32)
            e = tl.where((sl >= 0) & (e >= 0) & (e < NUM_EXPERTS), sl * NUM_EXPERTS + e, -1)
        return tl.where((e >= 0) & (e < E), e, -1)

    @triton.jit
    def _align_count_kernel(ids_ptr, slots_ptr, counts_ptr, sorted_ptr, P, P_MAX, FILL, E, TOP_K, NUM_EXPERTS,
                            BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SLOTS: tl.constexpr,
                            PDL: tl.constexpr = False):
        # program c: counts[c, e] = #pairs of chunk c in group e; pads sorted_ids[c*FILL : (c+1)*FILL] with P
        pdl_enter(PDL)
        c = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        offs_p = tl.arange(0, BLOCK_P)
        pp = c * BLOCK_P + offs_p
        e = _chunk_groups(ids_ptr, slots_ptr, pp, P, E, TOP_K, NUM_EXPERTS, HAS_SLOTS)
        hit = (e[:, None] == offs_e[None, :]).to(tl.int32)
        tl.store(counts_ptr + c * BLOCK_E + offs_e, tl.sum(hit, axis=0))
        for f0 in range(c * FILL, (c + 1) * FILL, BLOCK_P):
            ff = f0 + offs_p
            tl.store(sorted_ptr + ff, tl.zeros((BLOCK_P,), tl.int32) + P, mask=(ff < (c + 1) * FILL) & (ff < P_MAX))

    @triton.jit
    def _align_offsets_kernel(counts_ptr, base_ptr, bexp_ptr, C, NUM_BLOCKS,
                              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
                              PDL: tl.constexpr = False):
        # one program: base[c, e] = pairs of e in chunks before c (c < C), base[C, e] = start of e's group; block -> expert
        pdl_enter(PDL)
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
    def _align_place_kernel(ids_ptr, slots_ptr, base_ptr, sorted_ptr, P, C, E, TOP_K, NUM_EXPERTS,
                            BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SLOTS: tl.constexpr,
                            PDL: tl.constexpr = False):
        # program c: each pair of chunk c goes to base[C, e] + base[c, e] + (its rank among the chunk's pairs of e)
        pdl_enter(PDL)
        c = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        pp = c * BLOCK_P + tl.arange(0, BLOCK_P)
        valid = pp < P
        e = _chunk_groups(ids_ptr, slots_ptr, pp, P, E, TOP_K, NUM_EXPERTS, HAS_SLOTS)
        hit = (e[:, None] == offs_e[None, :]).to(tl.int32)
        base = tl.load(base_ptr + c * BLOCK_E + offs_e) + tl.load(base_ptr + C * BLOCK_E + offs_e)
        dest = tl.sum(hit * (base[None, :] + tl.cumsum(hit, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + dest, pp.to(tl.int32), mask=valid & (tl.sum(hit, axis=1) > 0))  # id -1: left out


# one program sorts every pair and counts them over every group (O(pairs x groups) in one SM: 143 µs at 2,048 pairs
# over 8 x 128 (slot, expert) groups, H100); above this many pairs three launches spread the work over chunks of pairs
ALIGN_ONE_PROGRAM_MAX_PAIRS = 512
LORA_ALIGN_MAX_GROUPS = 8192  # virtual experts (max_loras x E) a program's count holds


def _align(ids: torch.Tensor, slots: torch.Tensor | None, top_k: int, num_experts: int, max_loras: int,
           block_m: int, stream: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align / moe_lora_align_triton: the pairs of ids [P] grouped (by expert; with slots [P / top_k], by
    virtual expert slot * num_experts + expert over num_experts * max_loras groups) in blocks of block_m.
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS: one launch of one program (_moe_align_kernel: tl.sort of the pairs by
    group, a histogram for the group sizes); more: count per chunk of pairs (C programs), offsets (1 program),
    placement (C programs). Both stable inside each group. stream: see moe_align."""
    P = ids.shape[0]
    groups = num_experts * max_loras
    p_max = max_padded_pairs(P, groups, block_m)
    n_blocks = p_max // block_m
    dev = ids.device
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    sl = slots if slots is not None else ids
    pdl = pdl_args(dev)
    if P <= ALIGN_ONE_PROGRAM_MAX_PAIRS:
        block_e1 = triton.next_power_of_2(groups + 1)
        shift = torch.empty(block_e1, dtype=torch.int32, device=dev)  # scratch
        with launched_on(stream):
            _moe_align_kernel[(1,)](ids, sl, sorted_ids, block_expert, shift, P, groups, p_max, n_blocks, top_k,
                                    num_experts, BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(P)),
                                    BLOCK_E=block_e1, HAS_SLOTS=slots is not None, num_warps=4 if P <= 512 else 8,
                                    **pdl)
        return sorted_ids, block_expert
    block_e = max(16, triton.next_power_of_2(groups))
    block_p = max(16, min(256, 16384 // block_e))
    C = triton.cdiv(P, block_p)
    counts = torch.empty(C, block_e, dtype=torch.int32, device=dev)
    base = torch.empty(C + 1, block_e, dtype=torch.int32, device=dev)
    with launched_on(stream):
        _align_count_kernel[(C,)](ids, sl, counts, sorted_ids, P, p_max, triton.cdiv(p_max, C), groups, top_k,
                                  num_experts, BLOCK_P=block_p, BLOCK_E=block_e, HAS_SLOTS=slots is not None,
                                  num_warps=4, **pdl)
        _align_offsets_kernel[(1,)](counts, base, block_expert, C, n_blocks,
                                    BLOCK_M=block_m, BLOCK_C=max(16, 8192 // block_e), BLOCK_E=block_e, num_warps=8, **pdl)
        _align_place_kernel[(C,)](ids, sl, base, sorted_ids, P, C, groups, top_k, num_experts, BLOCK_P=block_p,
                                  BLOCK_E=block_e, HAS_SLOTS=slots is not None, num_warps=4, **pdl)
    return sorted_ids, block_expert


def moe_lora_align_triton(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora.moe_lora_align on the device (same groups, order and padding: stable), for max_loras * E <
    LORA_ALIGN_MAX_GROUPS (checked here); no atomics, no host sync (_align).
    topk_ids: [T, K] · token_slots: [T] int · returns sorted_pair_ids [P_max] int32, block_vexpert int32."""
    require_triton()
    V = num_experts * max_loras
    if V >= LORA_ALIGN_MAX_GROUPS:
        raise ValueError(f"moe_lora_align_triton: {V} virtual experts (max_loras x experts); at most "
                         f"{LORA_ALIGN_MAX_GROUPS - 1}")
    return _align(topk_ids.reshape(-1), token_slots, topk_ids.shape[1], num_experts, max_loras, block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              stream: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_ref on the device: no atomics (stable inside each group), no host sync (_align).
    stream: launch on this CUDA stream instead (its priority places the program; moe_lora.early): it
    waits for the current stream's work so far, the current stream waits for the launches; the outputs are
    allocated on the current stream. None: the current stream.
    topk_ids: [T, K] int · returns sorted_pair_ids [p_max] int32 (pad = T*K), block_expert [p_max/block_m] int32
    """
    require_triton()
    return _align(topk_ids.reshape(-1), None, 1, num_experts, 1, block_m, stream)
