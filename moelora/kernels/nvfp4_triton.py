"""Triton weight-only NVFP4 GEMMs (references: nvfp4.py): the packed e2m1 weights are decoded and scaled in
registers, tile by tile, and multiplied with the activations in their own dtype (Hopper has no FP4 tensor
cores). One kernel for the dense linear and the routed experts' grouped GEMM over (token, k) pairs, which
shares fp8_triton's alignment (rows grouped by expert, padded to BLOCK_M; no host synchronisation)."""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, require_triton
from moelora.kernels.nvfp4 import GROUP, dequantize_nvfp4

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _nvfp4_gemm_kernel(
        a_ptr, w_ptr, s_ptr, s2_ptr, c_ptr, bias_ptr, ids_ptr, bexp_ptr,
        M, N, K,
        sam, sak, swe, swn, swk, sse, ssn, ssk, s2e, s2n, scm, scn,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] output tile. Per K step the packed bytes [BLOCK_N, BLOCK_K / 2] are read once
        (contiguous), and each nibble plane becomes e4m3 bits with a few byte operations: an e2m1 code s|ee|m is
        the e4m3 value s|0ee0|m00 (= the e2m1 value x 2^-6, e = 0 landing on e4m3's subnormals), so the hardware
        FP8 conversion decodes it and the 2^6 goes into the group scale. The even elements (low nibbles) and the
        odd ones (high nibbles) are two dots against the activations' even and odd columns."""
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 16  # e4m3 scales per row and K step (one per 16 elements)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        if GROUPED:
            e = tl.load(bexp_ptr + pid_m)
            if e < 0:
                return
            rows = tl.load(ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = e.to(tl.int64)
        else:
            rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = 0
        mask_m = rows < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_j = tl.arange(0, HALF)  # byte (element pair) within the K step
        offs_g = tl.arange(0, GROUPS)
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + e * swe + offs_n[:, None].to(tl.int64) * swn
        s_rows = s_ptr + e * sse + offs_n[:, None].to(tl.int64) * ssn
        a_rows = a_ptr + rows[:, None] * sam
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            jj = k0 // 2 + offs_j  # [HALF] byte columns
            gg = k0 // 16 + offs_g  # [GROUPS] scale columns
            kk = k0 + offs_k  # [BLOCK_K] activation columns
            if EVEN_K:  # no K mask: the loads vectorize
                byte = tl.load(w_rows + jj[None, :] * swk, mask=mask_n[:, None], other=0)  # [BN, HALF] u8
                sc = tl.load(s_rows + gg[None, :] * ssk, mask=mask_n[:, None], other=0.0)  # [BN, GROUPS] e4m3
                a = tl.load(a_rows + kk[None, :] * sak, mask=mask_m[:, None], other=0.0)  # [BM, BLOCK_K]
            else:
                byte = tl.load(w_rows + jj[None, :] * swk, mask=mask_n[:, None] & (jj < K // 2)[None, :], other=0)
                sc = tl.load(s_rows + gg[None, :] * ssk, mask=mask_n[:, None] & (gg < K // 16)[None, :], other=0.0)
                a = tl.load(a_rows + kk[None, :] * sak, mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
            lo = ((byte & 7) << 2) | ((byte & 8) << 4)  # element 2j: e4m3 bits of the low nibble
            hi = ((byte >> 2) & 28) | (byte & 128)  # element 2j + 1: the high nibble
            sc = sc.to(tl.float32) * 64.0  # the 2^6 of the e4m3 encoding folded in
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))  # per byte
            w_lo = (lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(a.dtype)  # exact
            w_hi = (hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(a.dtype)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))  # [BM, HALF] each: columns 2j and 2j + 1
            acc += tl.dot(a_even, tl.trans(w_lo), input_precision=PRECISION)
            acc += tl.dot(a_odd, tl.trans(w_hi), input_precision=PRECISION)
        acc *= tl.load(s2_ptr + e * s2e + offs_n * s2n, mask=mask_n, other=0.0)[None, :]  # the per-row global scale
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + rows[:, None] * scm + offs_n[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Launch configuration (scripts/bench_nvfp4_gemm.py sweeps it): block_n output columns a program (fewer when N is
# smaller), block_k elements per K step (block_k / 2 packed bytes a row; K need only be a multiple of 16: masked).
# dense_block_m: rows a program in the dense linear, 0 = the batch up to 64 rows (each weight tile read once).
CONFIG = dict(block_n=64, block_k=128, num_warps=4, num_stages=3, dense_block_m=0)


def _block_m(rows: int) -> int:
    return 16 if rows <= 512 else 64


def _dense_block_m(rows: int) -> int:
    if CONFIG["dense_block_m"]:
        return CONFIG["dense_block_m"]
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def _launch(x, packed, scale, scale_2, out, bias, ids, bexp, block_m: int, grid_m: int) -> None:
    M, K = x.shape
    N = packed.shape[-2]
    if packed.shape[-1] * 2 != K or scale.shape[-1] * GROUP != K:
        raise ValueError(f"NVFP4 GEMM: input width {K} does not match packed weight {list(packed.shape)} and "
                         f"scale {list(scale.shape)}")
    w3 = packed if packed.dim() == 3 else packed.unsqueeze(0)
    s3 = scale if scale.dim() == 3 else scale.unsqueeze(0)
    g2 = scale_2 if scale_2.dim() == 2 else scale_2.unsqueeze(0)
    block_n = CONFIG["block_n"] if N >= CONFIG["block_n"] else max(16, triton.next_power_of_2(N))
    block_k = CONFIG["block_k"]
    grid = (grid_m, triton.cdiv(N, block_n))
    _nvfp4_gemm_kernel[grid](
        x, w3, s3, g2, out, bias if bias is not None else out,
        ids if ids is not None else out, bexp if bexp is not None else out,
        M, N, K, x.stride(0), x.stride(1), w3.stride(0), w3.stride(1), w3.stride(2),
        s3.stride(0), s3.stride(1), s3.stride(2), g2.stride(0), g2.stride(1), out.stride(0), out.stride(1),
        GROUPED=ids is not None, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics (nvfp4_linear_ref): y = x @ dequantize_nvfp4(packed, scale, scale_2).T (+ bias), fp32 accumulation
    x: [T, K] · packed: [N, K/2] uint8 · scale: [N, K/16] e4m3 · scale_2: [N] fp32 (per row) · returns [T, N] x.dtype
    """
    require_triton()
    T = x.shape[0]
    out = torch.empty(T, packed.shape[0], dtype=x.dtype, device=x.device)
    if T:
        bm = _dense_block_m(T)
        _launch(x, packed, scale, scale_2, out, bias, None, None, bm, triton.cdiv(T, bm))
    return out


def nvfp4_linear_ref(x, packed, scale, scale_2, bias=None) -> torch.Tensor:
    """nvfp4_linear's semantics in torch (fp32 products, result in x.dtype)."""
    y = x.float() @ dequantize_nvfp4(packed, scale, scale_2).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def nvfp4_grouped_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                       pair_exp: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Semantics: for p in range(P): y[p] = nvfp4_linear(x[p], packed[e], scale[e], scale_2[e]), e = pair_exp[p]
    x: [P, K] · packed: [E, N, K/2] uint8 · scale: [E, N, K/16] e4m3 · scale_2: [E, N] fp32 · pair_exp: [P]
    align: fp8_triton.fp8_grouped_align(pair_exp, E) (shared by gate_up and down) · returns [P, N] in x.dtype
    """
    from moelora.kernels.fp8_triton import fp8_grouped_align

    require_triton()
    P = x.shape[0]
    out = torch.empty(P, packed.shape[1], dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    bm = _block_m(P)
    sorted_ids, bexp = align if align is not None else fp8_grouped_align(pair_exp, packed.shape[0], bm)
    _launch(x, packed, scale, scale_2, out, None, sorted_ids, bexp, bm, bexp.shape[0])
    return out


def nvfp4_grouped_gemm_ref(x, packed, scale, scale_2, pair_exp, align=None) -> torch.Tensor:
    """nvfp4_grouped_gemm's semantics in torch."""
    y = torch.empty(x.shape[0], packed.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(pair_exp).tolist():
        p = (pair_exp == e).nonzero().squeeze(1)
        y[p] = nvfp4_linear_ref(x[p], packed[e], scale[e], scale_2[e])
    return y
