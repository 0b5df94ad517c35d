"""FP8 activation quantization (reference: fp8.py quantize_act_group_ref): one e4m3 scale per row and group of
channels, by its own launch (quantize_act_group) or by the kernel producing the activations (store_group_quant in
its epilogue, the result attached to its output with attach_act_quant), so that an FP8 GEMM reads e4m3 input."""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, pdl_args, require_triton
from moelora.kernels.quant.fp8 import FP8_DTYPE, FP8_MAX

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    @triton.jit
    def e4m3_groups(vg, FP8_MAX_C: tl.constexpr):
        """The one e4m3 group quantization every kernel uses (quantize_act_group's numbers): vg [G, GROUP] fp32, one
        group a row -> (q [G, GROUP] fp32 in [-FP8_MAX, FP8_MAX], to be cast to e4m3 by the store; scale [G] =
        max(amax, 1e-12) / FP8_MAX)."""
        scale = tl.maximum(tl.max(tl.abs(vg), axis=1), 1e-12) / FP8_MAX_C
        return tl.clamp(vg / scale[:, None], -FP8_MAX_C, FP8_MAX_C), scale

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, sxt, sqt, sst, FP8_MAX_C: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, BLOCK)
        mask = (offs < K) & (tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_ptr + t * sxt + offs, mask=mask, other=0.0).to(tl.float32)
        q, scale = e4m3_groups(tl.reshape(x, (1, BLOCK)), FP8_MAX_C)  # one group: [1, BLOCK], [1]
        tl.store(q_ptr + t * sqt + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + t * sst + g + tl.arange(0, 1), scale)

    @triton.jit
    def store_group_quant(v, q_row_ptr, s_row_ptr, offs0, N, FP8_MAX_C: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr):
        """Producer-side activation quantization (a @triton.jit helper for other kernels' epilogues): v [BLOCK]
        fp32, the values of columns offs0 .. offs0 + BLOCK of one row (0 past N; BLOCK and offs0 multiples of
        GROUP) -> q_row[cols] = e4m3(v / scale), s_row[col // GROUP] = scale, the numbers of quantize_act_group."""
        qg, scale = e4m3_groups(tl.reshape(v, (BLOCK // GROUP, GROUP)), FP8_MAX_C)  # scale: [BLOCK // GROUP]
        q = tl.reshape(qg, (BLOCK,))
        cols = offs0 + tl.arange(0, BLOCK)
        tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=cols < N)
        groups = offs0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(s_row_ptr + groups, scale, mask=groups * GROUP < N)


def quantize_act_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (quantize_act_group_ref):
        x_scale[t, g] = max(max(|x[t, g*group:(g+1)*group]|), 1e-12) / 448 ; x_fp8 = e4m3(x / x_scale per group)
    x: [T, K] (row stride free, unit column stride) · returns (x_fp8 [T, K] float8_e4m3fn, x_scale [T, ceil(K/group)] fp32)
    """
    require_triton()
    T, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    G = triton.cdiv(K, group)
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T:
        _act_quant_kernel[(T, G)](x, q, s, K, x.stride(0), q.stride(0), s.stride(0), FP8_MAX_C=FP8_MAX,
                                  GROUP=group, BLOCK=triton.next_power_of_2(group), **pdl_args(x.device))
    return q, s


def act_quant_buffers(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs for a producer kernel that quantizes its own output x [T, K] (store_group_quant): x_fp8 [T, K]
    float8_e4m3fn and x_scale [T, K / group] fp32. Attach them with attach_act_quant."""
    T, K = x.shape
    return (torch.empty(T, K, dtype=FP8_DTYPE, device=x.device),
            torch.empty(T, K // group, dtype=torch.float32, device=x.device))


def attach_act_quant(x: torch.Tensor, x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
    """Mark x as already quantized (quantize_act_group(x, group) == (x_fp8, x_scale)): an FP8 GEMM reading x then
    skips its own quantization launch. The mark lives on this tensor object (a view or copy does not carry it);
    x must not be changed in place afterwards. Returns x."""
    x.fp8_act = (x_fp8, x_scale, group)
    return x


def act_quant_ok(K: int, group: int | None, block: int) -> bool:
    """Whether a producer kernel of tile `block` can quantize a K-wide output in groups of `group` (otherwise the
    GEMM reading it quantizes it by quantize_act_group)."""
    return bool(group) and K % group == 0 and block % group == 0


def fp8_prequantize(x: torch.Tensor, group: int, x_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, K], x_scale [T, ceil(K/group)]) for an FP8 GEMM reading x [T, K]: x itself when it is float8 (with
    the x_scale given), its producer's quantization (attach_act_quant), else quantize_act_group(x, group) now (one
    launch; measured faster than quantizing inside the GEMM at every batch size)."""
    if x.dtype == FP8_DTYPE:
        return x, x_scale
    mark = getattr(x, "fp8_act", None)
    if mark is not None and mark[2] == group:
        return mark[0], mark[1]
    return quantize_act_group(x, group)
