"""The routed-expert LoRA's backends behind one interface, chosen once per family (MoELoRAKernels, from
RoutedExperts.configure: the Triton kernels, or the torch reference) and within it by the layer call's number of
(token, expert) pairs (`pick`):

- PerPairLoRA: moe_lora_fused (decode, up to DECODE_MAX_PAIRS pairs, below `grouped_min_pairs`);
- GroupedLoRA: moe_lora_grouped, pairs grouped by (slot, expert) (decode from `grouped_min_pairs`; prefill blocks
  above DECODE_MAX_PAIRS); one alignment a layer call, made at its first delta and shared by gate_up and down;
- ReferenceLoRA: moe_lora_fused_ref (the torch reference, any size: the CPU);
- EpilogueLoRA: at prefill on FP8 expert stacks, each pair's h by the grouped shrink, the expand in the FP8 expert
  GEMM's epilogue (Fp8LoRAEpilogue); chosen by the experts' orchestration (experts.ExpertKernels.epilogue_ok).

Every delta backend has `delta(x, lora, routing, y, *, x_per_pair, store, act_in=False, act_delta=None)` (the
semantics of moe_lora_fused) and `act_in` (whether it can read gate_up's output and compute the activation itself:
the down projection's LoRA issued before the activation kernel, moe_lora.early_down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels.moe.align_triton import lora_align_buffers
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref
from moelora.kernels.moe_lora.grouped_triton import (GROUPED_BLOCK_M, GROUPED_CONFIG, GROUPED_MAX_GROUPS,
                                                     PREFILL_BLOCK_M, PREFILL_CONFIG, grouped_align, grouped_ok,
                                                     moe_lora_grouped, moe_lora_grouped_shrink, prefill_align)
from moelora.kernels.quant.fp8_triton import Fp8LoRAEpilogue

# the most (token, expert) pairs of the decode kernels (256 tokens at top-8); above: the grouped kernel in prefill
# blocks of PREFILL_BLOCK_M pairs
DECODE_MAX_PAIRS = 2048


class PerPairLoRA:
    """moe_lora_fused: one program per (slice, pair, output split); A and B read per pair (from L2 when shared)."""

    act_in = True

    def delta(self, x: torch.Tensor, lora: ProjLoRA, routing: Routing, y: torch.Tensor, *, x_per_pair: bool,
              store: bool, act_in: bool = False, act_delta: torch.Tensor | None = None) -> None:
        moe_lora_fused(x, lora, routing, y, x_per_pair=x_per_pair, store=store, act_in=act_in, act_delta=act_delta)


class ReferenceLoRA:
    """moe_lora_fused_ref: the torch reference, at every size."""

    act_in = True

    def delta(self, x: torch.Tensor, lora: ProjLoRA, routing: Routing, y: torch.Tensor, *, x_per_pair: bool,
              store: bool, act_in: bool = False, act_delta: torch.Tensor | None = None) -> None:
        moe_lora_fused_ref(x, lora, routing, y, x_per_pair=x_per_pair, store=store, act_in=act_in,
                           act_delta=act_delta)


class GroupedLoRA:
    """moe_lora_grouped on one (slot, expert) alignment a layer call (grouped_align in GROUPED_BLOCK_M blocks at decode,
    into `buffers` that `pick` made before any fork; prefill_align in PREFILL_BLOCK_M blocks), run at the first delta
    on whatever stream runs it (the side stream when overlapping); the down projection's delta reuses it."""

    act_in = False

    def __init__(self, prefill: bool, buffers: tuple[torch.Tensor, ...] | None = None) -> None:
        self.prefill, self.buffers = prefill, buffers
        self.align: tuple[torch.Tensor, torch.Tensor] | None = None

    def delta(self, x: torch.Tensor, lora: ProjLoRA, routing: Routing, y: torch.Tensor, *, x_per_pair: bool,
              store: bool, act_in: bool = False, act_delta: torch.Tensor | None = None) -> None:
        if act_in or act_delta is not None:
            raise ValueError("GroupedLoRA: act_in is the per-pair kernel's (the caller checks backend.act_in)")
        r = routing
        if self.align is None:
            self.align = (prefill_align(r.topk_ids, r.token_slots, r.num_experts, r.max_loras) if self.prefill else
                          grouped_align(r.topk_ids, r.token_slots, r.num_experts, r.max_loras, self.buffers))
        block_m, config = (PREFILL_BLOCK_M, PREFILL_CONFIG) if self.prefill else (GROUPED_BLOCK_M, GROUPED_CONFIG)
        moe_lora_grouped(x, lora, routing, y, x_per_pair=x_per_pair, store=store, align=self.align, block_m=block_m,
                         config=config)


class EpilogueLoRA:
    """At prefill on FP8 expert stacks: per projection the grouped shrink writes each pair's h (moe_lora_grouped_shrink,
    every slice in one program, on one prefill_align grouping a layer call), and the expert GEMM adds the expand in its
    epilogue (fp8_expert_gemm(lora=): the batch's slot groups, their metadata loaded before the K steps); no delta
    buffer, the activation and the combine plain."""

    def __init__(self) -> None:
        self.align: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pair_slots: torch.Tensor | None = None

    def epilogue(self, x: torch.Tensor, lora: ProjLoRA, routing: Routing, *, x_per_pair: bool) -> Fp8LoRAEpilogue:
        """The Fp8LoRAEpilogue of one projection over pairs p = t * K + k (its rows), h computed here.
        x: [T, D] or [T*K, D]."""
        r = routing
        if self.align is None:
            self.align = prefill_align(r.topk_ids, r.token_slots, r.num_experts, r.max_loras)
            self.pair_slots = r.token_slots.repeat_interleave(r.topk_ids.shape[1])  # [P]: the epilogue's rows
        n, R = lora.a.shape[0], lora.a.shape[3]
        h = torch.empty(n, r.num_pairs, R, dtype=torch.float32, device=x.device)  # [n, P, R]
        moe_lora_grouped_shrink(x, lora, routing, h, x_per_pair=x_per_pair, align=self.align, block_m=PREFILL_BLOCK_M)
        bounds = tuple(i * lora.width for i in range(n + 1))  # on the host: the experts' slices are equal
        return Fp8LoRAEpilogue(h, lora.b, lora.offsets, lora.ranks, lora.scaling, self.pair_slots, r.active_slots,
                               slice_bounds=bounds, prefetch=True)


LoRABackend = PerPairLoRA | GroupedLoRA | ReferenceLoRA


@dataclass(frozen=True)
class MoELoRAKernels:
    """The routed-expert LoRA family, chosen once: triton (the Triton kernels; else the torch reference at every
    size) · grouped_min_pairs: from this many pairs (up to DECODE_MAX_PAIRS) decode batches take the grouped kernel."""

    triton: bool = False
    grouped_min_pairs: int = 2048

    @staticmethod
    def prefill(num_pairs: int) -> bool:
        """Whether a layer call of this many (token, expert) pairs takes the prefill kernels."""
        return num_pairs > DECODE_MAX_PAIRS

    def pick(self, routing: Routing) -> LoRABackend:
        """The backend of one layer call (a new object each call: a grouped one holds that call's alignment, at decode
        in buffers allocated here, on the stream that calls pick: before any fork to the side stream, streams.py)."""
        if not self.triton:
            return ReferenceLoRA()
        P, E, S = routing.num_pairs, routing.num_experts, routing.max_loras
        if self.prefill(P):
            return GroupedLoRA(prefill=True)
        if P >= self.grouped_min_pairs and grouped_ok(P, E, S) and E * S <= GROUPED_MAX_GROUPS:
            return GroupedLoRA(False, lora_align_buffers(P, E, S, GROUPED_BLOCK_M, routing.topk_ids.device))
        return PerPairLoRA()
