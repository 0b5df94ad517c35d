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


def apply_rotary_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Rotary on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's weights lay them out; the result comes
    out de-interleaved (rotated even lanes first, then rotated odd lanes), as transformers' DeepSeek-V3 returns
    it. Only dot products of rotated vectors are used, and q and k are permuted alike, so the layout is free.
    Semantics, with x1 = x[..., 0::2], x2 = x[..., 1::2], c, s = cos, sin [..., :D/2]:
        y = cat(x1 * c - x2 * s, x2 * c + x1 * s)
    computed in fp32 and cast back when fp32 (DeepSeek-V2's complex product), else in x.dtype (V3).
    x: [T, Hn, D] · cos, sin: [T, D] (halves repeated, from rotary_cos_sin) · returns [T, Hn, D] in x.dtype
    """
    dt = torch.float32 if fp32 else x.dtype
    half = x.shape[-1] // 2
    c = cos[:, None, :half].to(dt)
    s = sin[:, None, :half].to(dt)
    x1, x2 = x[..., 0::2].to(dt), x[..., 1::2].to(dt)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
