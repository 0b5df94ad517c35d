"""The two arguments objects of every routed-expert LoRA launcher: one projection's LoRA (`ProjLoRA`) and the batch's
routing (`Routing`). Pairs p = t * K + k (pair-major, as the experts lay out their intermediates)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProjLoRA:
    """One projection's routed-expert LoRA buffers (gate_up: n = 2 slices, gate then up; down: n = 1).
    a: [n, S, E|1, R, D] · b: [S, E|1, O, R] (the slices' rows concatenated) · offsets: [n+1] int32 on the device
    (slice i owns columns offsets[i]:offsets[i+1]) · ranks: [n, S] int32 · scaling: [n, S] fp32 · width: one slice's
    output width (the slices are equal) · a_src: [n, S] int32 or None (slice i of slot s reads the equal A copy of
    slice a_src[i, s]: LoRAWeights.a_src; the values are the same, fewer distinct bytes are read).
    An expert dim of 1 in a or b (stride 0 over experts) is the "shared outer" layout: one factor for all experts."""

    a: torch.Tensor
    b: torch.Tensor
    offsets: torch.Tensor
    ranks: torch.Tensor
    scaling: torch.Tensor
    width: int
    a_src: torch.Tensor | None = None

    @classmethod
    def build(cls, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, scaling: torch.Tensor, width: int,
              offsets: torch.Tensor | None = None, a_src: torch.Tensor | None = None) -> "ProjLoRA":
        """offsets made when None (equal slices of `width`) on the current stream: build before a fork (nothing the
        side stream uses may be allocated on it under graph capture)."""
        if offsets is None:
            offsets = torch.tensor([i * width for i in range(a.shape[0] + 1)], dtype=torch.int32, device=a.device)
        return cls(a, b, offsets, ranks, scaling, width, a_src)


@dataclass(frozen=True)
class Routing:
    """The batch's routing for the LoRA kernels. topk_ids: [T, K] (-1: another rank's expert under expert
    parallelism, no delta) · token_slots: [T] int32 (-1: no adapter) · num_experts: E of the model (virtual expert =
    slot * E + e) · max_loras: S · active_slots: [L] int32, the batch's slot groups (SlotGroups.active_slots), or None."""

    topk_ids: torch.Tensor
    token_slots: torch.Tensor
    num_experts: int
    max_loras: int
    active_slots: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()
