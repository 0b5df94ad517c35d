"""NVFP4 (ModelOpt layout) weights: torch references for packing, quantization and dequantization.

A weight w [..., N, K] is stored as
    weight         uint8 [..., N, K/2]   two e2m1 codes per byte: element 2j in the low nibble, 2j+1 in the high
    weight_scale   float8_e4m3fn [..., N, K/16]   one scale per 16 consecutive elements of a row
    weight_scale_2 fp32 (a scalar per checkpoint tensor; moelora keeps one per row, [..., N], so fused slices
                   with different global scales share one parameter)
    w[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2[n]
e2m1 code: bit 3 = sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6). Hopper has no FP4 tensor cores: moelora
runs NVFP4 weight-only (weights dequantized to the activation dtype before the GEMM).
"""

from __future__ import annotations

import torch

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _table(device) -> torch.Tensor:
    t = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return torch.cat([t, -t])  # [16]: code -> value


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., K/2] uint8 -> values [..., K] fp32 (low nibble first)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [..., K]
    return _table(packed.device)[codes]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., K] uint8 in [0, 16) -> [..., K/2] uint8 (element 2j low nibble, 2j+1 high)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive e2m1 magnitudes


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code for each value (clamped to +-6; ties to the smaller magnitude): [...] -> [...] uint8."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    idx = torch.bucketize(v.abs().float(), mids).to(torch.uint8)  # v == a midpoint -> the lower magnitude
    return idx + 8 * (v < 0).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's two-level scheme: scale_2 = amax(|w|) / (6 * 448) (a scalar);
    scale[n, g] = e4m3(amax(|w[n, g]|) / 6 / scale_2); code = e2m1(w / (scale * scale_2)).
    w: [..., N, K] with K % 16 == 0 · returns (packed [..., N, K/2] uint8, scale [..., N, K/16] e4m3, scale_2 [] fp32)
    """
    K = w.shape[-1]
    if K % GROUP:
        raise ValueError(f"NVFP4: the input dim must be a multiple of {GROUP}; weight shape {list(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax()
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    g = wf.view(*w.shape[:-1], K // GROUP, GROUP)
    s = (g.abs().amax(-1) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # [..., N, K/16]
    sf = s.float() * scale_2
    codes = round_to_e2m1(torch.where(sf[..., None] > 0, g / sf[..., None], torch.zeros_like(g)).flatten(-2))
    return pack_e2m1(codes), s, scale_2


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w = e2m1(packed) * scale * scale_2 · packed: [..., N, K/2] uint8 · scale: [..., N, K/16] e4m3
    scale_2: a scalar or [..., N] (per row) · returns [..., N, K] in dtype"""
    K = packed.shape[-1] * 2
    if tuple(scale.shape) != (*packed.shape[:-1], K // GROUP):
        raise ValueError(f"NVFP4 weight_scale: expected shape {[*packed.shape[:-1], K // GROUP]} for a packed weight "
                         f"of shape {list(packed.shape)}, found {list(scale.shape)}")
    s2 = scale_2.float()
    if s2.dim():
        s2 = s2[..., None]  # [..., N, 1]
    w = unpack_e2m1(packed) * scale.float().repeat_interleave(GROUP, dim=-1) * s2
    return w.to(dtype)
