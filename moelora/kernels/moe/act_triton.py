"""The routed experts' activation (SiLU-and-mul, a LoRA delta added first) and router-weighted combine over k, one
launch each, with their torch references; and the combine handed to the next RMSNorm (defer_moe_combine)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moelora.kernels._triton import HAS_TRITON, pdl_args, require_triton
from moelora.kernels.quant.fp8_act_triton import act_quant_buffers, act_quant_ok, attach_act_quant

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    from moelora.kernels.quant.fp8_act_triton import store_group_quant

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def act_and_mul(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gu[:, :I]) * gu[:, I:] in fp32, rounded once to gu's dtype · gu: [P, 2I] · returns [P, I]."""
    inter = gu.shape[1] // 2
    return (ACTIVATIONS[activation](gu[:, :inter].float()) * gu[:, inter:].float()).to(gu.dtype)


def silu_and_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(gu[:, :I]) * gu[:, I:] in fp32, rounded once · gu: [P, 2I] · returns [P, I]."""
    half = gu.shape[1] // 2
    g = gu.float()
    return (F.silu(g[:, :half]) * g[:, half:]).to(gu.dtype)


def moe_combine_ref(o: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t] = sum_k topk_weights[t, k] * o[t*K + k] in fp32 over the k with a weight != 0 (the row
    of a weight-0 pair is never read: a pair left out of the alignment has no row), rounded once to o.dtype
    o: [T*K, H] · topk_weights: [T, K] · returns [T, H]."""
    T, K = topk_weights.shape
    w = topk_weights.float()[:, :, None]
    return torch.where(w != 0, o.view(T, K, -1).float() * w, 0.0).sum(1).to(o.dtype)


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, d_ptr, out_ptr, q_ptr, qs_ptr, I, s_gm, s_gn, s_dm, s_dn, s_om, s_on, s_qm,
                             s_qsm, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr = 0, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        p = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(gu_ptr + p * s_gm + offs * s_gn, mask=mask, other=0.0)
        u = tl.load(gu_ptr + p * s_gm + (offs + I) * s_gn, mask=mask, other=0.0)
        if HAS_DELTA:  # gu + delta rounded once to gu's dtype, as gu.add_(delta) would store it
            g = (g.to(tl.float32) + tl.load(d_ptr + p * s_dm + offs * s_dn, mask=mask, other=0.0)).to(g.dtype)
            u = (u.to(tl.float32) + tl.load(d_ptr + p * s_dm + (offs + I) * s_dn, mask=mask, other=0.0)).to(u.dtype)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + p * s_om + offs * s_on, y, mask=mask)
        if QUANT_GROUP > 0:  # the down projection's FP8 input, from the rounded output (no quantization launch)
            store_group_quant(tl.where(mask, y.to(tl.float32), 0.0), q_ptr + p * s_qm, qs_ptr + p * s_qsm,
                              tl.program_id(1) * BLOCK, I, 448.0, QUANT_GROUP, BLOCK)

    @triton.jit
    def _combine_kernel(o_ptr, d_ptr, w_ptr, out_ptr, H, s_op, s_oh, s_dp, s_dh, s_wt, s_wk, s_ot, s_oh2,
                        K: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            wk = tl.load(w_ptr + t * s_wt + k * s_wk).to(tl.float32)
            ok = tl.load(o_ptr + (t * K + k) * s_op + offs * s_oh, mask=mask, other=0.0)
            if HAS_DELTA:  # o + delta rounded once to o's dtype, as o.add_(delta) would store it
                dk = tl.load(d_ptr + (t * K + k) * s_dp + offs * s_dh, mask=mask, other=0.0)
                ok = (ok.to(tl.float32) + dk).to(ok.dtype)
            # a weight-0 pair adds nothing, whatever its row holds (a pair left out of the alignment: never written)
            acc += tl.where(wk != 0.0, wk * ok.to(tl.float32), 0.0)
        tl.store(out_ptr + t * s_ot + offs * s_oh2, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _delta_strides(delta: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(pointer argument, row stride, column stride) of an optional delta shaped like `like`, fp32 or like's dtype."""
    if delta is None:
        return like, 0, 0
    if delta.shape != like.shape or delta.dtype not in (torch.float32, like.dtype):
        raise ValueError(f"LoRA delta: expected fp32 or {like.dtype} {tuple(like.shape)}, found {delta.dtype} "
                         f"{tuple(delta.shape)}")
    return delta, delta.stride(0), delta.stride(1)


def silu_and_mul(gu: torch.Tensor, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
                 quant_group: int | None = None) -> torch.Tensor:
    """silu_and_mul_ref in one launch · gu: [P, 2I] · out: [P, I] (made when None) · returns out.
    delta: [P, 2I] fp32 (or gu's dtype) or None: the activation of gu + delta, the sum rounded once to gu's dtype
    first (the numbers of gu.add_(delta) then silu_and_mul, one launch and no write of the sum).
    quant_group: also quantize out per row and group as quantize_act_group(out, quant_group) would, in the same
    launch, and attach it to out (fp8_act_triton.attach_act_quant: an FP8 down projection reads it); skipped when
    I is not a multiple of the group."""
    require_triton()
    P, two_i = gu.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty(P, inter, dtype=gu.dtype, device=gu.device)
    d, sdm, sdn = _delta_strides(delta, gu)
    block = min(1024, max(16, triton.next_power_of_2(inter)))
    quant = act_quant_ok(inter, quant_group, block) and P > 0
    q, qs = act_quant_buffers(out, quant_group) if quant else (out, out)
    if P:
        _silu_and_mul_kernel[(P, triton.cdiv(inter, block))](gu, d, out, q, qs, inter, gu.stride(0), gu.stride(1),
                                                             sdm, sdn, out.stride(0), out.stride(1), q.stride(0),
                                                             qs.stride(0), HAS_DELTA=delta is not None, BLOCK=block,
                                                             QUANT_GROUP=quant_group if quant else 0, **pdl_args(gu.device))
    if quant:
        attach_act_quant(out, q, qs, quant_group)
    return out


def moe_combine(o: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None,
                delta: torch.Tensor | None = None) -> torch.Tensor:
    """moe_combine_ref in one launch (deterministic: a fixed k order, no atomics).
    o: [T*K, H] · topk_weights: [T, K] · out: [T, H] (made in o.dtype when None) · returns out.
    delta: [T*K, H] fp32 (or o's dtype) or None: combines o + delta, each sum rounded once to o's dtype first (the
    numbers of o.add_(delta) then moe_combine; a weight-0 pair adds nothing, whatever its delta row holds)."""
    require_triton()
    T, K = topk_weights.shape
    H = o.shape[1]
    if out is None:
        out = torch.empty(T, H, dtype=o.dtype, device=o.device)
    d, sdp, sdh = _delta_strides(delta, o)
    block = min(1024, max(16, triton.next_power_of_2(H)))
    if T:
        _combine_kernel[(T, triton.cdiv(H, block))](o, d, topk_weights, out, H, o.stride(0), o.stride(1), sdp, sdh,
                                                    topk_weights.stride(0), topk_weights.stride(1),
                                                    out.stride(0), out.stride(1), K=K,
                                                    HAS_DELTA=delta is not None, BLOCK=block, **pdl_args(o.device))
    return out



# ------------------------------------------------------------------------ the combine deferred to the next norm

_DEFER_COMBINE = [False]  # inside defer_moe_combine (a call's scope, not a switch: MoEBlock sets it per forward)


@contextlib.contextmanager
def defer_moe_combine(enabled: bool = True):
    """Inside: TritonExperts.combine returns a placeholder [T, H] carrying its inputs (take_moe_combine) instead of
    launching moe_combine. The caller must hand the result to a consumer that takes it (RMSNorm.add_norm does):
    the placeholder's memory holds nothing."""
    before = _DEFER_COMBINE[0]
    _DEFER_COMBINE[0] = bool(enabled)
    try:
        yield
    finally:
        _DEFER_COMBINE[0] = before


def combine_deferred() -> bool:
    """Whether defer_moe_combine is on here."""
    return _DEFER_COMBINE[0]


def take_moe_combine(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The (o, topk_weights, delta) a deferred combine put on its placeholder y (removed from it), or None."""
    c = getattr(y, "moe_combine", None)
    if c is not None:
        del y.moe_combine
    return c
