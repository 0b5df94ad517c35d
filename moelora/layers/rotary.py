"""Rotary embedding: inverse frequencies from transformers' rope initialisers (every static rope type)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moelora.kernels._triton import HAS_TRITON
from moelora.kernels.attention.rotary import apply_rotary_ref, rotary_cos_sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope_type: str, rope_theta: float, hf_config: Any, device: torch.device | str) -> None:
        super().__init__()
        if rope_type == "default" or hf_config is None:
            inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)
        self.fused_ok = HAS_TRITON and head_dim % 2 == 0  # the GPU's fused q/k-norm + rotary kernel applies

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D] · k: [T, Hkv, D] · positions: [T]."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_scaling)
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
