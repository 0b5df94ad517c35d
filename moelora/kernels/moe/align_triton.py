"""The routed experts' pairs p = t * K + k grouped by expert (moe_align: the base expert GEMMs' blocks), or by
virtual expert slot * E + e (moe_lora_align_triton: the grouped routed-expert LoRA kernel's, one program a slot),
with static sizes and no host synchronisation (CUDA-graph safe). Reference: moe_align_ref; moe_lora.chain.moe_lora_align for the LoRA's."""

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
    def _moe_align_kernel(ids_ptr, sorted_ptr, bexp_ptr, shift_ptr, P, E, P_MAX, NUM_BLOCKS,
                          BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
        # one program, P <= BLOCK_P: sort the keys e * BLOCK_P + p (stable by construction; pairs on no local
        # expert get e = E and sort last), then pair i of the sorted order goes to i + shift[e], shift[e] =
        # (padded start of e's group) - (pairs on experts below e); shift goes through global scratch
        pdl_enter(PDL)
        offs = tl.arange(0, BLOCK_P)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, E)
        for p0 in range(0, P_MAX, BLOCK_P):  # padding everywhere first
            tl.store(sorted_ptr + p0 + offs, tl.zeros((BLOCK_P,), tl.int32) + P, mask=p0 + offs < P_MAX)
        for b0 in range(0, NUM_BLOCKS, BLOCK_P):  # blocks of no expert: -1
            tl.store(bexp_ptr + b0 + offs, tl.zeros((BLOCK_P,), tl.int32) - 1, mask=b0 + offs < NUM_BLOCKS)
        _place_sorted(e, offs, 0, 0, shift_ptr, sorted_ptr, bexp_ptr, E, BLOCK_M, BLOCK_P, BLOCK_E)

    @triton.jit
    def _place_sorted(e, offs, base, group0, shift_ptr, sorted_ptr, bexp_ptr, E, BLOCK_M: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
        # the pairs offs with experts e (E: left out) to their places: expert e's group starts at base + the padded
        # sizes of the groups below it, in increasing pair order; block -> group0 + e. shift_ptr: BLOCK_E scratch
        offs_e = tl.arange(0, BLOCK_E)  # BLOCK_E > E: bin E holds the pairs left out (and the slots past P)
        srt = tl.sort(e * BLOCK_P + offs)  # [BLOCK_P]
        se, sp = srt // BLOCK_P, srt % BLOCK_P
        counts = tl.where(offs_e < E, tl.histogram(e, BLOCK_E), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = base + tl.cumsum(padded, axis=0) - padded
        tl.store(shift_ptr + offs_e, starts - (tl.cumsum(counts, axis=0) - counts))
        tl.debug_barrier()  # shift and the caller's fills land before the loads and stores below (other threads)
        keep = se < E
        dest = offs + tl.load(shift_ptr + se, mask=keep, other=0)
        tl.store(sorted_ptr + dest, sp, mask=keep)
        # every block of a group holds at least one real pair, so this writes each used block's group
        tl.store(bexp_ptr + dest // BLOCK_M, group0 + se, mask=keep)

    @triton.jit
    def _slot_experts(ids_ptr, slots_ptr, offs, P, E, TOP_K, s):
        # the expert of each pair p = offs of slot s (slots[p // TOP_K] == s, expert in [0, E)); E for the others
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        sl = tl.load(slots_ptr + offs // TOP_K, mask=offs < P, other=-1).to(tl.int32)
        return tl.where((sl == s) & (e >= 0) & (e < E), e, E)

    @triton.jit
    def _lora_align_count_kernel(ids_ptr, slots_ptr, totals_ptr, sorted_ptr, bexp_ptr, P, E, TOP_K, P_MAX,
                                 NUM_BLOCKS, FILL_P, FILL_B, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                                 BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
        # program s: totals[s] = the padded size of slot s's groups (its pairs counted by expert, each count rounded
        # up to BLOCK_M); its share of sorted_ids filled with P and of block_vexpert with -1 (placed over later)
        pdl_enter(PDL)
        s = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)
        e = _slot_experts(ids_ptr, slots_ptr, offs, P, E, TOP_K, s)
        counts = tl.where(offs_e < E, tl.histogram(e, BLOCK_E), 0)
        tl.store(totals_ptr + s, tl.sum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, axis=0))
        for f0 in range(s * FILL_P, (s + 1) * FILL_P, BLOCK_P):
            ff = f0 + offs
            tl.store(sorted_ptr + ff, tl.zeros((BLOCK_P,), tl.int32) + P, mask=(ff < (s + 1) * FILL_P) & (ff < P_MAX))
        for f0 in range(s * FILL_B, (s + 1) * FILL_B, BLOCK_P):
            ff = f0 + offs
            tl.store(bexp_ptr + ff, tl.zeros((BLOCK_P,), tl.int32) - 1,
                     mask=(ff < (s + 1) * FILL_B) & (ff < NUM_BLOCKS))

    @triton.jit
    def _lora_align_place_kernel(ids_ptr, slots_ptr, totals_ptr, shift_ptr, sorted_ptr, bexp_ptr, P, E, TOP_K, S,
                                 BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                                 BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
        # program s: slot s's groups start after the slots below it (totals); its pairs sorted by expert and placed
        pdl_enter(PDL)
        s = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        offs_s = tl.arange(0, BLOCK_S)
        base = tl.sum(tl.load(totals_ptr + offs_s, mask=offs_s < s, other=0), axis=0)
        e = _slot_experts(ids_ptr, slots_ptr, offs, P, E, TOP_K, s)
        _place_sorted(e, offs, base, s * E, shift_ptr + s * BLOCK_E, sorted_ptr, bexp_ptr, E, BLOCK_M, BLOCK_P,
                      BLOCK_E)

    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, P, P_MAX, FILL,
                            BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
        # program c: counts[c, e] = #pairs of chunk c on expert e; pads sorted_ids[c*FILL : (c+1)*FILL] with P
        pdl_enter(PDL)
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
    def _align_place_kernel(ids_ptr, base_ptr, sorted_ptr, P, C, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                            PDL: tl.constexpr = False):
        # program c: each pair of chunk c goes to base[C, e] + base[c, e] + (its rank among the chunk's pairs of e)
        pdl_enter(PDL)
        c = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        pp = c * BLOCK_P + tl.arange(0, BLOCK_P)
        valid = pp < P
        e = tl.load(ids_ptr + pp, mask=valid, other=-1).to(tl.int32)
        hit = (e[:, None] == offs_e[None, :]).to(tl.int32)
        base = tl.load(base_ptr + c * BLOCK_E + offs_e) + tl.load(base_ptr + C * BLOCK_E + offs_e)
        dest = tl.sum(hit * (base[None, :] + tl.cumsum(hit, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + dest, pp.to(tl.int32), mask=valid & (tl.sum(hit, axis=1) > 0))  # id -1: left out


ALIGN_ONE_PROGRAM_MAX_PAIRS = 2048  # above: three launches spread over chunks of pairs (one program's sort grows)
LORA_ALIGN_MAX_PAIRS = 2048  # one program a slot sorts every pair
LORA_ALIGN_MAX_EXPERTS = 1024  # a program's histogram holds the experts (and one bin for the pairs left out)


def _align_one_program(ids: torch.Tensor, num_experts: int, P: int, block_m: int, sorted_ids: torch.Tensor,
                       block_expert: torch.Tensor, stream: "torch.cuda.Stream | None" = None):
    """One launch of _moe_align_kernel; stream: see moe_align."""
    block_e1 = triton.next_power_of_2(num_experts + 1)
    shift = torch.empty(block_e1, dtype=torch.int32, device=ids.device)  # scratch
    with launched_on(stream):
        _moe_align_kernel[(1,)](ids, sorted_ids, block_expert, shift, P, num_experts, sorted_ids.shape[0],
                                block_expert.shape[0], BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(P)),
                                BLOCK_E=block_e1, num_warps=4 if P <= 512 else 8, **pdl_args(ids.device))
    return sorted_ids, block_expert


def moe_lora_align_triton(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora.moe_lora_align on the device (same groups slot * E + e, order and padding: stable), for
    P <= LORA_ALIGN_MAX_PAIRS and num_experts < LORA_ALIGN_MAX_EXPERTS (checked here). Two launches of max_loras
    programs, each sorting and counting its slot's pairs by expert (O(pairs x experts) a program, beside the others):
    the first sums each slot's padded size, the second places the pairs after the slots below.
    topk_ids: [T, K] · token_slots: [T] int (-1: no adapter) · returns sorted_pair_ids [P_max] int32 (pad P),
    block_vexpert [P_max / block_m] int32 (-1: unused)."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    if P > LORA_ALIGN_MAX_PAIRS or num_experts >= LORA_ALIGN_MAX_EXPERTS:
        raise ValueError(f"moe_lora_align_triton: {P} pairs over {num_experts} experts; at most "
                         f"{LORA_ALIGN_MAX_PAIRS} pairs and {LORA_ALIGN_MAX_EXPERTS - 1} experts")
    dev = topk_ids.device
    p_max = max_padded_pairs(P, num_experts * max_loras, block_m)
    n_blocks = p_max // block_m
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    bvex = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    block_p = max(16, triton.next_power_of_2(P))
    block_e = triton.next_power_of_2(num_experts + 1)
    totals = torch.empty(max_loras, dtype=torch.int32, device=dev)
    shift = torch.empty(max_loras, block_e, dtype=torch.int32, device=dev)  # scratch
    ids = topk_ids.reshape(-1)
    warps = 4 if P <= 512 else 8
    _lora_align_count_kernel[(max_loras,)](ids, token_slots, totals, sorted_ids, bvex, P, num_experts, K, p_max,
                                           n_blocks, triton.cdiv(p_max, max_loras), triton.cdiv(n_blocks, max_loras),
                                           BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e, num_warps=warps,
                                           **pdl_args(dev))
    _lora_align_place_kernel[(max_loras,)](ids, token_slots, totals, shift, sorted_ids, bvex, P, num_experts, K,
                                           max_loras, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e,
                                           BLOCK_S=max(16, triton.next_power_of_2(max_loras)), num_warps=warps,
                                           **pdl_args(dev))
    return sorted_ids, bvex


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              stream: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_ref on the device: no atomics (stable inside each group), no host sync.
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS: one launch of one program (tl.sort of the pairs by expert, a histogram for the
    group sizes); larger P: count per chunk of pairs (C programs), offsets (1 program), placement (C programs).
    stream: launch on this CUDA stream instead (its priority places the program; moe_lora.early): it
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
    if P <= ALIGN_ONE_PROGRAM_MAX_PAIRS:  # decode: one sort of all pairs
        return _align_one_program(ids, num_experts, P, block_m, sorted_ids, block_expert, stream)
    C = triton.cdiv(P, block_p)
    counts = torch.empty(C, block_e, dtype=torch.int32, device=dev)
    base = torch.empty(C + 1, block_e, dtype=torch.int32, device=dev)
    with launched_on(stream):
        _align_count_kernel[(C,)](ids, counts, sorted_ids, P, p_max, triton.cdiv(p_max, C),
                                  BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4, **pdl_args(dev))
        _align_offsets_kernel[(1,)](counts, base, block_expert, C, n_blocks,
                                    BLOCK_M=block_m, BLOCK_C=max(16, 8192 // block_e), BLOCK_E=block_e, num_warps=8,
                                    **pdl_args(dev))
        _align_place_kernel[(C,)](ids, base, sorted_ids, P, C, BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4,
                                  **pdl_args(dev))
    return sorted_ids, block_expert

