"""Triton weight-only NVFP4 GEMMs (references: nvfp4.py): the packed e2m1 weights are decoded and scaled in
registers, tile by tile, and multiplied with the activations in their own dtype (Hopper has no FP4 tensor
cores). One kernel for the dense linear (split-K at decode sizes) and the routed experts' grouped GEMM over
(token, k) pairs on an alignment (rows grouped by expert, padded to BLOCK_M; no host synchronisation): the
fused-MoE fast path's (nvfp4_expert_gemm, token rows read in place) or fp8_grouped_align's (nvfp4_grouped_gemm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, interpreting, require_triton
from moelora.kernels.quant.fp8_experts_triton import expert_block_m, expert_align_blocks, fp8_grouped_align
from moelora.kernels.quant.fp8_triton import dense_block_m
from moelora.kernels.quant.nvfp4 import GROUP, dequantize_nvfp4
from moelora.kernels.quant.split_k_triton import split_k_buffers

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.quant.split_k_triton import split_k_reduce  # the split-K epilogue both GEMMs share

    # Four packed bytes (eight e2m1 codes; byte i holds elements 2i, low nibble, and 2i + 1) -> the four low-nibble
    # and the four high-nibble elements as bf16 pairs, times their group scales ($5, $6: bf16 pairs). prmt spreads
    # bytes 0/1 (2/3) into the two 16-bit lanes; a nibble s|ee|m becomes the bf16 bits s|0000000ee|m000000, the
    # value x 2^-126 (ee = 0, m = 1: a bf16 subnormal, which fma.bf16x2 keeps), so one fma by 2^126 and one by the
    # scale give code x scale exactly (<= 6 significant bits).
    _E2M1X4_TO_BF16 = tl.constexpr("""{
    .reg .b32 t<2>, m<4>, s<4>, u, z;
    mov.b32 u, 0x7E807E80;
    mov.b32 z, 0x80008000;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    shl.b32 m0, t0, 6;
    and.b32 m0, m0, 0x01C001C0;
    shl.b32 s0, t0, 12;
    and.b32 s0, s0, 0x80008000;
    or.b32 m0, m0, s0;
    shl.b32 m1, t1, 6;
    and.b32 m1, m1, 0x01C001C0;
    shl.b32 s1, t1, 12;
    and.b32 s1, s1, 0x80008000;
    or.b32 m1, m1, s1;
    shl.b32 m2, t0, 2;
    and.b32 m2, m2, 0x01C001C0;
    shl.b32 s2, t0, 8;
    and.b32 s2, s2, 0x80008000;
    or.b32 m2, m2, s2;
    shl.b32 m3, t1, 2;
    and.b32 m3, m3, 0x01C001C0;
    shl.b32 s3, t1, 8;
    and.b32 s3, s3, 0x80008000;
    or.b32 m3, m3, s3;
    fma.rn.bf16x2 m0, m0, u, z;
    fma.rn.bf16x2 m1, m1, u, z;
    fma.rn.bf16x2 m2, m2, u, z;
    fma.rn.bf16x2 m3, m3, u, z;
    fma.rn.bf16x2 $0, m0, $5, z;
    fma.rn.bf16x2 $1, m1, $6, z;
    fma.rn.bf16x2 $2, m2, $5, z;
    fma.rn.bf16x2 $3, m3, $6, z;
    }""")

    @triton.jit
    def _nvfp4_gemm_kernel(
        a_ptr, w_ptr, s_ptr, s2_ptr, c_ptr, bias_ptr, ids_ptr, bexp_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        sam, sak, swe, swn, swk, sse, ssn, ssk, s2e, s2n, scm, scn,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        DECODE: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1, A_ROW_DIV: tl.constexpr = 1,
    ):
        """One [BLOCK_M, BLOCK_N] output tile. Per K step the packed bytes [BLOCK_N, BLOCK_K / 2] are read once
        (contiguous), and each nibble plane becomes e4m3 bits with a few byte operations: an e2m1 code s|ee|m is
        the e4m3 value s|0ee0|m00 (= the e2m1 value x 2^-6, e = 0 landing on e4m3's subnormals), so the hardware
        FP8 conversion decodes it and the 2^6 goes into the group scale. The even elements (low nibbles) and the
        odd ones (high nibbles) are two dots against the activations' even and odd columns.
        SPLIT_K > 1 (dense decode: few output tiles): split sk takes the K steps sk, sk + SPLIT_K, ..., stores its
        fp32 partial in ws[sk] and counts itself in cnt[tile]; the split arriving last adds the partials in order
        sk = 0, 1, ... (deterministic), writes the output and resets the counter (split_k_triton)."""
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 16  # e4m3 scales per row and K step (one per 16 elements)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        sk = tl.program_id(2)
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
        a_rows = a_ptr + (rows // A_ROW_DIV)[:, None] * sam  # A_ROW_DIV = top_k: token rows read in place
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(sk * BLOCK_K, K, BLOCK_K * SPLIT_K):
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
            sc_raw = sc
            sc = sc.to(tl.float32) * 64.0  # the 2^6 of the e4m3 encoding folded in
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))  # per byte
            if DECODE == 2:  # bf16 in inline PTX, four bytes a register (see _E2M1X4_TO_BF16)
                sb = tl.reshape(tl.broadcast_to(sc_raw.to(tl.float32).to(tl.bfloat16)[:, :, None], (BLOCK_N, GROUPS, 8)),
                                (BLOCK_N, HALF))
                w_lo, w_hi = tl.inline_asm_elementwise(_E2M1X4_TO_BF16, "=r,=r,=r,=r,r,r,r", [byte, sb],
                                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            elif DECODE == 0:  # products in fp32, then rounded (exactly) to the activations' dtype
                w_lo = (lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(a.dtype)
                w_hi = (hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(a.dtype)
            else:  # DECODE 1, in the activations' dtype: code x scale has <= 6 significant bits, exact in bf16 / fp16
                sc = sc.to(a.dtype)
                w_lo = lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(a.dtype) * sc
                w_hi = hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(a.dtype) * sc
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))  # [BM, HALF] each: columns 2j and 2j + 1
            acc += tl.dot(a_even, tl.trans(w_lo), input_precision=PRECISION)
            acc += tl.dot(a_odd, tl.trans(w_hi), input_precision=PRECISION)
        if SPLIT_K > 1:
            acc, last = split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, sk,
                                       pid_m * tl.num_programs(1) + pid_n, SPLIT_K)
            if not last:
                return
        acc *= tl.load(s2_ptr + e * s2e + offs_n * s2n, mask=mask_n, other=0.0)[None, :]  # the per-row global scale
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + rows[:, None] * scm + offs_n[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Nvfp4GemmConfig:
    """A launch of _nvfp4_gemm_kernel, for a launcher's `config=` (sweeps, tests; None: DENSE_CONFIG /
    GROUPED_CONFIG): block_n output columns a program (fewer when N is smaller); block_k elements a K step (K need
    only be a multiple of 16: masked); decode 0 the scale applied in fp32, 1 in the activations' dtype, 2 inline
    PTX (bf16 activations on a GPU only; 1 elsewhere): the same weights each way; dense only: block_m rows a
    program (0: the batch up to 64 rows, each weight tile decoded once), split_k (0: as nvfp4_split_k picks)."""

    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    decode: int = 2
    block_m: int = 0
    split_k: int = 0


# the sweep's best on the H200 (scripts/bench_nvfp4_gemm.py, Qwen3-30B-A3B shapes, CUDA-graph timing): experts
# 128-wide with the PTX decode (gate_up / down at 64 tokens 108 / 54 us); dense 16-row blocks, 64-wide, split-K as
# nvfp4_split_k picks (qkv / o_proj at 64 tokens 17 / 13 us)
GROUPED_CONFIG = Nvfp4GemmConfig(block_n=128)
DENSE_CONFIG = Nvfp4GemmConfig(block_n=64, block_m=16)
SPLIT_K_TARGET_PROGRAMS = 264  # dense split-K: the fewest splits reaching this many programs (2 per SM of an H200)


def nvfp4_split_k(tiles: int, k_steps: int) -> int:
    """K splits of a dense GEMM with `tiles` output tiles and `k_steps` K steps: the smallest power of two <= 8
    that reaches SPLIT_K_TARGET_PROGRAMS programs, keeping >= 2 K steps a split (decode: a handful of output
    tiles, each a long serial decode loop otherwise)."""
    splits = 1
    while splits < 8 and tiles * splits < SPLIT_K_TARGET_PROGRAMS and k_steps >= splits * 4:
        splits *= 2
    return splits


def _decode_mode(decode: int, x: torch.Tensor) -> int:
    """The inline-PTX decode (2) needs bf16 activations on a GPU (no interpreter): 1 otherwise."""
    return 1 if decode == 2 and (x.dtype != torch.bfloat16 or not x.is_cuda or interpreting()) else decode


def _launch(x, packed, scale, scale_2, out, bias, ids, bexp, block_m: int, grid_m: int, cfg: Nvfp4GemmConfig,
            a_row_div: int = 1) -> None:
    M, K = out.shape[0], x.shape[1]
    N = packed.shape[-2]
    if packed.shape[-1] * 2 != K or scale.shape[-1] * GROUP != K:
        raise ValueError(f"NVFP4 GEMM: input width {K} does not match packed weight {list(packed.shape)} and "
                         f"scale {list(scale.shape)}")
    w3 = packed if packed.dim() == 3 else packed.unsqueeze(0)
    s3 = scale if scale.dim() == 3 else scale.unsqueeze(0)
    g2 = scale_2 if scale_2.dim() == 2 else scale_2.unsqueeze(0)
    block_n = cfg.block_n if N >= cfg.block_n else max(16, triton.next_power_of_2(N))
    block_k = cfg.block_k
    grid_n = triton.cdiv(N, block_n)
    split_k = 1  # grouped: never split
    if ids is None:  # dense: split K when few output tiles (decode)
        split_k = cfg.split_k or nvfp4_split_k(grid_m * grid_n, triton.cdiv(K, block_k))
    split_k, ws, cnt = split_k_buffers(out, grid_m * grid_n, split_k)
    _nvfp4_gemm_kernel[(grid_m, grid_n, split_k)](
        x, w3, s3, g2, out, bias if bias is not None else out,
        ids if ids is not None else out, bexp if bexp is not None else out, ws, cnt,
        M, N, K, x.stride(0), x.stride(1), w3.stride(0), w3.stride(1), w3.stride(2),
        s3.stride(0), s3.stride(1), s3.stride(2), g2.stride(0), g2.stride(1), out.stride(0), out.stride(1),
        GROUPED=ids is not None, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        DECODE=_decode_mode(cfg.decode, x), SPLIT_K=split_k, A_ROW_DIV=a_row_div, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                 bias: torch.Tensor | None = None, config: Nvfp4GemmConfig | None = None) -> torch.Tensor:
    """Semantics (nvfp4_linear_ref): y = x @ dequantize_nvfp4(packed, scale, scale_2).T (+ bias), fp32 accumulation
    x: [T, K] · packed: [N, K/2] uint8 · scale: [N, K/16] e4m3 · scale_2: [N] fp32 (per row) · returns [T, N] x.dtype
    config: the launch forced (sweeps, tests; None: DENSE_CONFIG)
    """
    cfg = config or DENSE_CONFIG
    require_triton()
    T = x.shape[0]
    out = torch.empty(T, packed.shape[0], dtype=x.dtype, device=x.device)
    if T:
        bm = cfg.block_m or dense_block_m(T)
        _launch(x, packed, scale, scale_2, out, bias, None, None, bm, triton.cdiv(T, bm), cfg)
    return out


def nvfp4_linear_ref(x, packed, scale, scale_2, bias=None, config=None) -> torch.Tensor:
    """nvfp4_linear's semantics in torch (fp32 products, result in x.dtype)."""
    y = x.float() @ dequantize_nvfp4(packed, scale, scale_2).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def nvfp4_grouped_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                       pair_exp: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor] | None = None,
                       config: Nvfp4GemmConfig | None = None) -> torch.Tensor:
    """Semantics: for p in range(P): y[p] = nvfp4_linear(x[p], packed[e], scale[e], scale_2[e]), e = pair_exp[p]
    x: [P, K] · packed: [E, N, K/2] uint8 · scale: [E, N, K/16] e4m3 · scale_2: [E, N] fp32 · pair_exp: [P]
    align: fp8_grouped_align(pair_exp, E) (shared by gate_up and down) · config: the launch forced (None:
    GROUPED_CONFIG) · returns [P, N] in x.dtype
    """
    require_triton()
    P = x.shape[0]
    out = torch.empty(P, packed.shape[1], dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    bm = expert_block_m(P)
    sorted_ids, bexp = align if align is not None else fp8_grouped_align(pair_exp, packed.shape[0], bm)
    _launch(x, packed, scale, scale_2, out, None, sorted_ids, bexp, bm, bexp.shape[0], config or GROUPED_CONFIG)
    return out


def nvfp4_expert_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                      topk_ids: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor], gather_rows: bool,
                      block_m: int, config: Nvfp4GemmConfig | None = None) -> torch.Tensor:
    """The grouped GEMM on the routed-expert fast path's alignment (fused_moe_triton.moe_align), token rows read
    in place. Semantics (nvfp4_expert_gemm_ref), pairs p = t * K + k, e = topk_ids.flatten()[p]:
        y[p] = nvfp4_linear(x[p // K] if gather_rows else x[p], packed[e], scale[e], scale_2[e])
    x: [T, D] (gather_rows) or [P, D] · packed: [E, N, D/2] uint8 · scale: [E, N, D/16] e4m3 · scale_2: [E, N]
    topk_ids: [T, K] · align: moe_align(topk_ids, E, block_m) · config: the launch forced (None: GROUPED_CONFIG)
    returns [P, N] in x.dtype. CUDA-graph safe."""
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    sorted_ids, bexp = expert_align_blocks("nvfp4_expert_gemm", align, block_m)
    out = torch.empty(P, packed.shape[1], dtype=x.dtype, device=x.device)
    if P:
        _launch(x, packed, scale, scale_2, out, None, sorted_ids, bexp, block_m, bexp.shape[0],
                config or GROUPED_CONFIG, a_row_div=K if gather_rows else 1)
    return out


def nvfp4_expert_gemm_ref(x, packed, scale, scale_2, topk_ids, align, gather_rows, block_m,
                          config=None) -> torch.Tensor:
    """nvfp4_expert_gemm's semantics in torch (align and block_m are ignored: rows are matched by topk_ids)."""
    T, K = topk_ids.shape
    rows = torch.arange(T * K, device=x.device)
    return nvfp4_grouped_gemm_ref(x[rows // K if gather_rows else rows], packed, scale, scale_2, topk_ids.reshape(-1))


def nvfp4_grouped_gemm_ref(x, packed, scale, scale_2, pair_exp, align=None, config=None) -> torch.Tensor:
    """nvfp4_grouped_gemm's semantics in torch."""
    y = torch.empty(x.shape[0], packed.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(pair_exp).tolist():
        p = (pair_exp == e).nonzero().squeeze(1)
        y[p] = nvfp4_linear_ref(x[p], packed[e], scale[e], scale_2[e])
    return y
