"""Block-scaled FP8 (e4m3) in the DeepSeek-V3 / Qwen3-FP8 convention: torch references.

Weights: one fp32 scale per (block_n x block_k) block, stored as `weight_scale_inv` with
    w[n, k] ~= w_fp8[n, k] * scale_inv[n // block_n, k // block_k]
Activations: one scale per token per group of block_k channels (dynamic, computed per call):
    x[t, k] ~= x_fp8[t, k] * x_scale[t, k // block_k]
The block-scaled product y = x @ w.T is computed from both dequantized operands (fp32 accumulation);
the Triton kernels (fp8_triton.py) have the same semantics.

Error bound (round to nearest, e4m3 = 3 mantissa bits): each quantized element has a relative error
|d| <= u |v| with u = 2^-4 (half of the relative step 2^-3), plus at most 2^-10 * scale for values in the
subnormal range (below 2^-6 * scale). Elementwise, for y = sum_k x_k w_k:
    |y_fp8 - y| <= sum_k (ex_k |w_k| + |x_k| ew_k + ex_k ew_k),  ex = u|x| + 2^-10 s_x, ew likewise
(`fp8_error_bound`). When the rounding errors are uncorrelated (random data), the relative Frobenius
error is about the RMS of the per-product relative error: ||y_fp8 - y||_F / ||y||_F <= sqrt(2) * 2^-4 ~ 0.088.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
FP8_UNIT_ROUNDOFF = 2.0**-4
FP8_SUBNORMAL_HALF_STEP = 2.0**-10  # half the subnormal spacing 2^-9
FP8_RMS_BOUND = 2.0**0.5 * FP8_UNIT_ROUNDOFF  # the relative Frobenius bound for uncorrelated rounding errors
DEFAULT_BLOCK = (128, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols] (each block's scale repeated over the block)."""
    bn, bk = block
    s = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return s[..., :rows, :cols]


def quantize_weight_block(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics, per block b of block_n rows x block_k cols (the last ones may be partial):
        scale_inv[b] = max(|w[b]|) / 448 (1 for an all-zero block) ; w_fp8[b] = e4m3(w[b] / scale_inv[b])
    w: [..., N, K] (a linear weight, or an expert stack [E, N, K]) · returns (w_fp8 [..., N, K] float8_e4m3fn,
    scale_inv [..., ceil(N/bn), ceil(K/bk)] fp32)
    """
    *lead, N, K = w.shape
    bn, bk = block
    nb, kb = _cdiv(N, bn), _cdiv(K, bk)
    wp = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    wp[..., :N, :K] = w.float()
    blocks = wp.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    w_fp8 = q.view(*lead, nb * bn, kb * bk)[..., :N, :K].to(FP8_DTYPE).contiguous()
    return w_fp8, scale_inv.contiguous()


def dequantize_weight_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w[..., n, k] = w_fp8[..., n, k] * scale_inv[..., n // bn, k // bk]
    w_fp8: [..., N, K] · scale_inv: [..., ceil(N/bn), ceil(K/bk)] · returns [..., N, K] in dtype
    """
    N, K = w_fp8.shape[-2:]
    expect = (*w_fp8.shape[:-2], _cdiv(N, block[0]), _cdiv(K, block[1]))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(f"weight_scale_inv: expected shape {list(expect)} for a weight of shape {list(w_fp8.shape)} "
                         f"and block {list(block)}, found {list(scale_inv.shape)}")
    return (w_fp8.float() * _expand_blocks(scale_inv.float(), N, K, block)).to(dtype)


def quantize_act_group_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics, per token t and channel group g (group channels; the last may be partial):
        x_scale[t, g] = max(max(|x[t, g]|) / 448, 1e-12 / 448) ; x_fp8[t, g] = e4m3(x[t, g] / x_scale[t, g])
    x: [T, K] · returns (x_fp8 [T, K] float8_e4m3fn, x_scale [T, ceil(K/group)] fp32)
    """
    T, K = x.shape
    G = _cdiv(K, group)
    xp = torch.zeros(T, G * group, dtype=torch.float32, device=x.device)
    xp[:, :K] = x.float()
    g = xp.view(T, G, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [T, G]
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(T, G * group)[:, :K]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize_act_group(x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x[t, k] = x_fp8[t, k] * x_scale[t, k // group] (fp32) · x_fp8: [T, K] · x_scale: [T, ceil(K/group)]"""
    K = x_fp8.shape[1]
    return x_fp8.float() * x_scale.float().repeat_interleave(group, dim=1)[:, :K]


def fp8_block_matmul_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics (W8A8, dynamic per-token-group activation scales):
        xq, xs = quantize_act_group(x, block_k)
        y = deq(xq, xs) @ deq(w_fp8, w_scale_inv).T (+ bias)       # fp32 accumulation
    x: [T, K] · w_fp8: [N, K] float8 · w_scale_inv: [ceil(N/bn), ceil(K/bk)] fp32 · returns [T, N] in x.dtype
    """
    xq, xs = quantize_act_group_ref(x, block[1])
    y = dequantize_act_group(xq, xs, block[1]) @ dequantize_weight_block(w_fp8, w_scale_inv, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_grouped_matmul_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, pair_exp: torch.Tensor,
                           block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """Semantics: y[p] = fp8_block_matmul_ref(x[p:p+1], w_fp8[pair_exp[p]], w_scale_inv[pair_exp[p]])
    x: [P, K] · w_fp8: [E, N, K] · w_scale_inv: [E, ceil(N/bn), ceil(K/bk)] · pair_exp: [P] · returns [P, N] x.dtype
    """
    xq, xs = quantize_act_group_ref(x, block[1])
    return grouped_matmul_dequantized(dequantize_act_group(xq, xs, block[1]), w_fp8, w_scale_inv, pair_exp, block, x.dtype)


def grouped_matmul_dequantized(xd: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, pair_exp: torch.Tensor,
                               block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """y[p] = xd[p] @ deq(w_fp8[pair_exp[p]]).T in fp32 · xd: [P, K] · returns [P, N] in out_dtype."""
    y = torch.empty(xd.shape[0], w_fp8.shape[1], dtype=out_dtype, device=xd.device)
    for e in torch.unique(pair_exp).tolist():
        p = (pair_exp == e).nonzero().squeeze(1)
        y[p] = (xd[p].float() @ dequantize_weight_block(w_fp8[e], w_scale_inv[e], block).T).to(out_dtype)
    return y


def fp8_error_bound(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """The elementwise bound on |fp8_block_matmul_ref(x, quantize(w)) - x @ w.T| stated in the module doc.
    x: [T, K] · w: [N, K] (unquantized) · returns [T, N] fp32"""
    u, sub = FP8_UNIT_ROUNDOFF, FP8_SUBNORMAL_HALF_STEP
    _, xs = quantize_act_group_ref(x, block[1])
    _, ws = quantize_weight_block(w, block)
    xa, wa = x.float().abs(), w.float().abs()
    ex = u * xa + sub * xs.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]
    ew = u * wa + sub * _expand_blocks(ws, *w.shape, block)
    return ex @ wa.T + xa @ ew.T + ex @ ew.T
