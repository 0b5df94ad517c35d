"""The routed experts' pairs p = t * K + k grouped by expert (moe_align: the base expert GEMMs' blocks), or by virtual
expert slot * E + e (moe_lora_align_one_program: the grouped routed-expert LoRA kernel's), with static sizes and no
host synchronisation (CUDA-graph safe). Reference: moe_align_ref; moe_lora.chain.moe_lora_align for the LoRA's."""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton
from moelora.kernels.streams import launched_on

if HAS_TRITON:
    import triton
    import triton.language as tl


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
        # one program, P <= BLOCK_P. The experts' groups (no HAS_SLOTS): shift[e] starts at the padded start of e's
        # group and each pair takes the next place of its group by an atomic add on it (the order inside a group is
        # the atomics'; no sort). HAS_SLOTS: group by virtual expert slot * NUM_EXPERTS + expert instead (E =
        # max_loras * NUM_EXPERTS, slot = slots[p // TOP_K]; a pair of slot -1 or expert -1 is left out), stable:
        # sort the keys e * BLOCK_P + p (pairs on no group get e = E and sort last), then pair i of the sorted order
        # goes to i + shift[e], shift[e] = (padded start of e's group) - (pairs in groups below e)
        offs = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)  # BLOCK_E > E: bin E holds the pairs left out (and the slots past P)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        if HAS_SLOTS:
            sl = tl.load(slots_ptr + offs // TOP_K, mask=offs < P, other=-1).to(tl.int32)
            e = tl.where((sl >= 0) & (e >= 0) & (e < NUM_EXPERTS), sl * NUM_EXPERTS + e, -1)
        e = tl.where((e >= 0) & (e < E), e, E)
        counts = tl.where(offs_e < E, tl.histogram(e, BLOCK_E), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if HAS_SLOTS:
            s = tl.sort(e * BLOCK_P + offs)  # [BLOCK_P]
            se, sp = s // BLOCK_P, s % BLOCK_P
            tl.store(shift_ptr + offs_e, tl.cumsum(padded, axis=0) - padded - (tl.cumsum(counts, axis=0) - counts))
        else:
            se, sp = e, offs
            tl.store(shift_ptr + offs_e, tl.cumsum(padded, axis=0) - padded)  # each group's next free place
        for p0 in range(0, P_MAX, BLOCK_P):  # padding everywhere first
            tl.store(sorted_ptr + p0 + offs, tl.zeros((BLOCK_P,), tl.int32) + P, mask=p0 + offs < P_MAX)
        for b0 in range(0, NUM_BLOCKS, BLOCK_P):  # blocks of no expert: -1
            tl.store(bexp_ptr + b0 + offs, tl.zeros((BLOCK_P,), tl.int32) - 1, mask=b0 + offs < NUM_BLOCKS)
        tl.debug_barrier()  # shift and the fills land before the loads and stores below (other threads)
        keep = se < E
        if HAS_SLOTS:
            dest = offs + tl.load(shift_ptr + se, mask=keep, other=0)
        else:
            dest = tl.atomic_add(shift_ptr + se, tl.zeros((BLOCK_P,), tl.int32) + 1, mask=keep, sem="relaxed",
                                 scope="cta")
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


ALIGN_ONE_PROGRAM_MAX_PAIRS = 2048  # above: three launches spread over chunks of pairs (one program's sort grows)


def _align_one_program(ids: torch.Tensor, slots: torch.Tensor | None, top_k: int, num_experts: int, max_loras: int,
                       P: int, block_m: int, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                       stream: "torch.cuda.Stream | None" = None, shift: torch.Tensor | None = None):
    """One launch of _moe_align_kernel over groups [0, num_experts * max_loras) (virtual experts with slots);
    with slots: stable (a sort), else each group's pairs in any order; stream: see moe_align; shift: the scratch
    (lora_align_buffers'), None: made here."""
    groups = num_experts * max_loras
    block_e1 = triton.next_power_of_2(groups + 1)
    shift = torch.empty(block_e1, dtype=torch.int32, device=ids.device) if shift is None else shift
    with launched_on(stream):
        _moe_align_kernel[(1,)](ids, slots if slots is not None else ids, sorted_ids, block_expert, shift, P, groups,
                                sorted_ids.shape[0], block_expert.shape[0], top_k, num_experts,
                                BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_E=block_e1,
                                HAS_SLOTS=slots is not None, num_warps=4 if P <= 512 else 8)
    return sorted_ids, block_expert


LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS = 8192  # virtual experts (max_loras x E) the one-program alignment takes


def lora_align_buffers(num_pairs: int, num_experts: int, max_loras: int, block_m: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What moe_lora_align_one_program writes: (sorted_pair_ids [P_max], block_vexpert, its scratch) int32, allocated
    on the current stream (a caller running the alignment on a side stream makes them before the fork)."""
    p_max = max_padded_pairs(num_pairs, num_experts * max_loras, block_m)
    return (torch.empty(p_max, dtype=torch.int32, device=device),
            torch.empty(p_max // block_m, dtype=torch.int32, device=device),
            torch.empty(triton.next_power_of_2(num_experts * max_loras + 1), dtype=torch.int32, device=device))


def moe_lora_align_one_program(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                               block_m: int, buffers: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora.moe_lora_align (same groups, order and padding: stable) in one launch of one program, for
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS and max_loras * E < LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS (checked here).
    topk_ids: [T, K] · token_slots: [T] int · buffers: lora_align_buffers' (None: made here) · returns
    sorted_pair_ids [P_max] int32, block_vexpert int32."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    V = num_experts * max_loras
    if P > ALIGN_ONE_PROGRAM_MAX_PAIRS or V >= LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS:
        raise ValueError(f"moe_lora_align_one_program: {P} pairs over {V} virtual experts; at most "
                         f"{ALIGN_ONE_PROGRAM_MAX_PAIRS} pairs and {LORA_ALIGN_ONE_PROGRAM_MAX_GROUPS - 1} groups")
    sorted_ids, bvex, shift = buffers or lora_align_buffers(P, num_experts, max_loras, block_m, topk_ids.device)
    return _align_one_program(topk_ids.reshape(-1), token_slots, K, num_experts, max_loras, P, block_m, sorted_ids,
                              bvex, shift=shift)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              stream: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_ref on the device, no host sync, up to the order of the pairs inside each expert's group (what
    each block computes does not depend on it: a GEMM row is one pair's).
    P <= ALIGN_ONE_PROGRAM_MAX_PAIRS: one launch of one program (a histogram for the group sizes, then each pair
    placed by an atomic add on its group's cursor: any order inside a group; a sort of the pairs took 3.9 us at
    batch 64 and 16.8 at 256 on an H100); larger P: count per chunk of pairs (C programs), offsets (1 program),
    placement (C programs), stable.
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
    if P <= ALIGN_ONE_PROGRAM_MAX_PAIRS:  # decode: one program placing every pair
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

