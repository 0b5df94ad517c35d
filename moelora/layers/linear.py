"""Linear layers whose output may carry per-slot LoRA deltas (fused slices: qkv, gate_up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.adapters.metadata import LoRABatch
from moelora.kernels.lora import lora_expand_ref, lora_shrink_ref
from moelora.layers.lora import LoRAWeights, slot_has_lora


class LoRALinear(nn.Module):
    """y = x W^T (+ bias) + for each slice i: scaling[i, s] * B_i[s] A_i[s] x, s = the token's slot.

    weight: [sum(out_features), in_features]; the slices sit in order along the output dim.
    """

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = list(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(sum(out_features), dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.lora: LoRAWeights | None = None

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoRAWeights:
        self.lora = LoRAWeights(
            self.in_features, self.out_features, max_loras, max_lora_rank,
            dtype=self.weight.dtype, device=self.weight.device,
        )
        return self.lora

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # [T, sum(O)]
        if lora is not None and lora.has_lora and slot_has_lora(self.lora, lora.slot_ids):
            w = self.lora
            h = torch.zeros(w.num_slices, x.shape[0], w.max_lora_rank, dtype=x.dtype, device=x.device)  # [n, T, R]
            lora_shrink_ref(x, w.a, lora.token_slots, w.ranks, h)
            lora_expand_ref(h, w.b, lora.token_slots, w.scaling, w.ranks, y)
        return y
