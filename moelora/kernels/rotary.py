"""Rotary position embedding, neox style (rotate the two halves)."""

import torch


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int · inv_freq: [D/2] fp32 · returns cos, sin: [T, D] fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics: y = x * cos + rotate_half(x) * sin, per head.
    x: [T, Hn, D] · cos, sin: [T, D] (cast to x.dtype first, as transformers does) · returns [T, Hn, D]
    """
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
