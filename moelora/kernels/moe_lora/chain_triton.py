"""The (slot, expert) alignment of routed-expert LoRA pairs on the GPU without a sort (moe_lora_align_fast; the
reference and the semantics: chain.moe_lora_align), and the LoRA factors' strides as the kernels read them.

(The three-launch chain it served, a shrink into h [P, n, R] then an expand, in GEMV and tiled variants, lost to the
fused kernels at decode and at prefill and was removed: docs/experiments.md.)
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton
from moelora.kernels.moe_lora.chain import pair_virtual_experts

if HAS_TRITON:
    import triton
    import triton.language as tl


def moe_lora_align_fast(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int, max_loras: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_lora_align without a sort: counts per virtual expert, padded offsets, then one kernel that
    places each pair at offset[v] + atomic_add(fill[v], 1). The order of pairs inside a group is not
    fixed (it does not change any result: rows are computed independently); the groups, their
    padding and block_vexpert are exactly moe_lora_align's."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    V = max_loras * num_experts
    dev = topk_ids.device
    v = pair_virtual_experts(topk_ids, token_slots, num_experts, max_loras)  # [P]
    counts = torch.zeros(V + 1, dtype=torch.int32, device=dev).scatter_add_(0, v, torch.ones_like(v, dtype=torch.int32))
    padded = (counts[:V] + block_m - 1) // block_m * block_m
    cum = torch.cumsum(padded, 0)
    p_max = (P + min(V, P) * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((p_max,), P, dtype=torch.int32, device=dev)
    fill = torch.zeros(V, dtype=torch.int32, device=dev)
    block = 256
    _align_scatter_kernel[(triton.cdiv(P, block),)](v, cum, padded, fill, sorted_ids, P, V, BLOCK=block)
    block_start = torch.arange(0, p_max, block_m, device=dev)
    bv = torch.searchsorted(cum, block_start, right=True)
    block_vexpert = torch.where(block_start < cum[-1], bv, torch.full_like(bv, -1)).to(torch.int32)
    return sorted_ids, block_vexpert


if HAS_TRITON:

    @triton.jit
    def _align_scatter_kernel(v_ptr, cum_ptr, padded_ptr, fill_ptr, out_ptr, P, V, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < P
        v = tl.load(v_ptr + offs, mask=mask, other=V)
        valid = mask & (v < V)
        vc = tl.where(valid, v, 0)
        start = tl.load(cum_ptr + vc, mask=valid, other=0) - tl.load(padded_ptr + vc, mask=valid, other=0)
        pos = tl.atomic_add(fill_ptr + vc, 1, mask=valid)
        tl.store(out_ptr + start + pos, offs.to(tl.int32), mask=valid)


def a_strides(a: torch.Tensor) -> tuple[int, ...]:
    """[n, S, E|1, R, D]; an expert dim of 1 is read with stride 0 (shared outer)."""
    return a.stride(0), a.stride(1), 0 if a.shape[2] == 1 else a.stride(2), a.stride(3), a.stride(4)


def b_strides(b: torch.Tensor) -> tuple[int, ...]:
    """[S, E|1, O, R]."""
    return b.stride(0), 0 if b.shape[1] == 1 else b.stride(1), b.stride(2), b.stride(3)
