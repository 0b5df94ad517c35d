"""Triton RMSNorm (optionally fused with the residual add) and the fused per-head q/k RMSNorm + rotary.

One launch each instead of the 8 (norm) and ~20 (q/k norms + rotary) small torch ops of the references;
rounding follows the references step by step (statistics in fp32, each product rounded to the input dtype
where the reference rounds it), so outputs agree with them to the last bit up to fp32 summation order.
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, require_triton
from moelora.kernels.quant.fp8_act_triton import act_quant_buffers, act_quant_ok, attach_act_quant

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.quant.fp8_act_triton import store_group_quant

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, q_ptr, qs_ptr, D, sx, sr, sy, sro, sq, sqs, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr = 0,
                         d_ptr=None, sd=0, HAS_DELTA: tl.constexpr = False,
                         co_ptr=None, cw_ptr=None, cd_ptr=None, s_co=0, s_cwt=0, s_cd=0,
                         COMBINE_K: tl.constexpr = 0, COMBINE_DELTA: tl.constexpr = False):
        # COMBINE_K > 0 (a deferred routed-expert combine, moe.act_triton.defer_moe_combine): x is not read; its
        # row is moe_combine's, sum_k w[row, k] * (o[row * K + k] (+ delta, rounded once to o's dtype)) in fp32 over
        # the k of weight != 0, rounded once to o's dtype: the numbers moe_combine would have stored in x
        # HAS_DELTA (dense_lora.defer): the LoRA delta d [rows, D] of the layer that produced x (o_proj) added to
        # x first, rounded once: x = x + d, then the residual add
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        if COMBINE_K > 0:
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for k in tl.static_range(COMBINE_K):
                wk = tl.load(cw_ptr + row * s_cwt + k).to(tl.float32)
                ok = tl.load(co_ptr + (row * COMBINE_K + k) * s_co + offs, mask=mask, other=0.0)
                if COMBINE_DELTA:
                    dk = tl.load(cd_ptr + (row * COMBINE_K + k) * s_cd + offs, mask=mask, other=0.0)
                    ok = (ok.to(tl.float32) + dk.to(tl.float32)).to(ok.dtype)
                acc += tl.where(wk != 0.0, wk * ok.to(tl.float32), 0.0)
            x = acc.to(co_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(d_ptr + row * sd + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * sr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(ro_ptr + row * sro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
        n = (xf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (n * w).to(x.dtype)
        tl.store(y_ptr + row * sy + offs, y, mask=mask)
        if QUANT_GROUP > 0:  # the next FP8 GEMM's input, from the rounded output (no quantization launch)
            store_group_quant(tl.where(mask, y.to(tl.float32), 0.0), q_ptr + row * sq, qs_ptr + row * sqs, 0, D,
                              448.0, QUANT_GROUP, BLOCK)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, inv_ptr, Hq, Hkv, sqt, sqh, skt, skh, eps, scaling,
                             v_ptr, kc_ptr, vc_ptr, slot_ptr, svt, svh, sc_slot, sc_h,
                             HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr,
                             d_ptr=None, sdt=0, HAS_DELTA: tl.constexpr = False, HEADS: tl.constexpr = 4):
        # program (t, g): heads h = g * HEADS + i of token t (the q heads, then the k heads, then with WRITE_KV the
        # v heads), a [HEADS, BLOCK_H] tile a half; the token's cos and sin computed once for all of them
        # HAS_DELTA (dense_lora.defer): qkv_proj's LoRA delta d [T, (Hq + 2 Hkv) * D] (the qkv layout: head h of
        # the q, k, v heads in that order at columns h * D) added to each head as it is loaded, rounded once
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
        offs = tl.arange(0, BLOCK_H)
        cmask = (offs < HALF)[None, :]
        is_q = h < Hq
        is_k = (h >= Hq) & (h < Hq + Hkv)
        is_v = (h >= Hq + Hkv) & (h < Hq + 2 * Hkv) if WRITE_KV else h < 0
        base = tl.where(is_q, q_ptr + t * sqt + h * sqh, k_ptr + t * skt + (h - Hq) * skh)
        if WRITE_KV:
            base = tl.where(is_v, v_ptr + t * svt + (h - Hq - Hkv) * svh, base)
        lmask = (is_q | is_k | is_v)[:, None] & cmask
        ptr = base[:, None] + offs[None, :]  # [HEADS, BLOCK_H]
        x1 = tl.load(ptr, mask=lmask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=lmask, other=0.0)
        dt = x1.dtype
        if HAS_DELTA:
            d_head = (d_ptr + t * sdt + h * (2 * HALF))[:, None] + offs[None, :]
            x1 = (x1.to(tl.float32) + tl.load(d_head, mask=lmask, other=0.0).to(tl.float32)).to(dt)
            x2 = (x2.to(tl.float32) + tl.load(d_head + HALF, mask=lmask, other=0.0).to(tl.float32)).to(dt)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            written = ((offs * 0 + slot) >= 0)[None, :]  # a row of slot -1 is not written
            vmask = (is_v[:, None] & cmask) & written
            vdst = (vc_ptr + slot * sc_slot + (h - Hq - Hkv) * sc_h)[:, None] + offs[None, :]
            tl.store(vdst, x1.to(vc_ptr.dtype.element_ty), mask=vmask)  # the v heads: into the cache as they are
            tl.store(vdst + HALF, x2.to(vc_ptr.dtype.element_ty), mask=vmask)
        if NORM:  # per-head RMSNorm over both halves, as rms_norm_ref
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
            w_row = tl.where(is_q, qw_ptr, kw_ptr)[:, None] + offs[None, :]  # each head's norm weight
            w1 = tl.load(w_row, mask=lmask, other=0.0).to(tl.float32)
            w2 = tl.load(w_row + HALF, mask=lmask, other=0.0).to(tl.float32)
            x1 = ((f1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt)
            x2 = ((f2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt)
        pos = tl.load(pos_ptr + t).to(tl.float32)
        freq = pos * tl.load(inv_ptr + offs, mask=offs < HALF, other=0.0)
        c = (tl.cos(freq) * scaling).to(dt).to(tl.float32)[None, :]
        s = (tl.sin(freq) * scaling).to(dt).to(tl.float32)[None, :]
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # y = x * cos + rotate_half(x) * sin, each product rounded to the dtype as the reference does
        y1 = ((a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)).to(dt)
        y2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        qkmask = (is_q | is_k)[:, None] & cmask
        tl.store(ptr, y1, mask=qkmask)
        tl.store(ptr + HALF, y2, mask=qkmask)
        if WRITE_KV:  # the k heads: the rotated k into the cache too
            kmask = (is_k[:, None] & cmask) & written
            kdst = (kc_ptr + slot * sc_slot + (h - Hq) * sc_h)[:, None] + offs[None, :]
            tl.store(kdst, y1.to(kc_ptr.dtype.element_ty), mask=kmask)
            tl.store(kdst + HALF, y2.to(kc_ptr.dtype.element_ty), mask=kmask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quant_group: int | None = None, delta: torch.Tensor | None = None,
             combine: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor,
             torch.Tensor | None]:
    """Semantics (rms_norm_ref, with an optional LoRA delta and residual add first):
        if delta is not None: x = (x + delta)                       # in x.dtype (the producing layer's output)
        if residual is not None: x = residual = (x + residual)      # in x.dtype, returned as the new residual
        y = weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)
    x, residual: [..., D] (last dim contiguous) · weight: [D] · returns (y [..., D], new residual or None)
    quant_group: also quantize y [rows, D] per row and group as quantize_act_group(y, quant_group) would, in the
    same launch, attached to y (fp8_act_triton.attach_act_quant: the next FP8 GEMM reads it); skipped when D is not
    a multiple of the group.
    delta: [..., D] like x (last dim contiguous), the deferred LoRA delta of the layer that produced x
    (dense_lora.defer).
    combine = (o [rows * K, D], topk_weights [rows, K], o_delta [rows * K, D] or None): x is the placeholder of a
    deferred routed-expert combine (moe.act_triton.defer_moe_combine) and is not read; each row of it is
    computed here as moe_combine(o, topk_weights, delta=o_delta) would have stored it (the same bits), in x.dtype.
    """
    require_triton()
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, D)
        ro = torch.empty_like(y)
    else:
        r2 = ro = y  # unused
    block = triton.next_power_of_2(D)
    quant = act_quant_ok(D, quant_group, block) and rows > 0
    q, qs = act_quant_buffers(y, quant_group) if quant else (y, y)
    extra = {}
    if delta is not None:
        d2 = delta.reshape(-1, delta.shape[-1])
        if tuple(d2.shape) != (rows, D) or d2.stride(-1) != 1:
            raise ValueError(f"rms_norm: delta must be [{rows}, {D}] like x with a contiguous last dim, found "
                             f"{tuple(delta.shape)} strides {delta.stride()}")
        extra.update(d_ptr=d2, sd=d2.stride(0), HAS_DELTA=True)
    if combine is not None:
        o, cw, cd = combine
        K = cw.shape[1] if cw.dim() == 2 else 0
        if (o.dtype != x.dtype or cw.shape[0] != rows or tuple(o.shape) != (rows * K, D) or o.stride(1) != 1
                or cw.stride(1) != 1 or (cd is not None and (tuple(cd.shape) != (rows * K, D) or cd.stride(1) != 1))):
            raise ValueError(f"rms_norm: combine expects o [{rows} * K, {D}] of {x.dtype}, topk_weights [{rows}, K] "
                             f"and delta like o (last dims contiguous); found o {tuple(o.shape)} {o.dtype}, "
                             f"topk_weights {tuple(cw.shape)}, delta {None if cd is None else tuple(cd.shape)}")
        extra.update(co_ptr=o, cw_ptr=cw, cd_ptr=o if cd is None else cd, s_co=o.stride(0), s_cwt=cw.stride(0),
                     s_cd=0 if cd is None else cd.stride(0), COMBINE_K=K, COMBINE_DELTA=cd is not None)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, y, ro, q, qs, D, x2.stride(0), r2.stride(0), y.stride(0),
                                  ro.stride(0), q.stride(0), qs.stride(0), eps, HAS_RES=residual is not None,
                                  BLOCK=block, QUANT_GROUP=quant_group if quant else 0, **extra)
    out = y.view(x.shape)
    if quant and x.dim() == 2:
        attach_act_quant(out, q, qs, quant_group)
    return out, (ro.view(x.shape) if residual is not None else None)


QK_ROPE_HEADS = 4  # heads a program of _qk_norm_rope_kernel (one a program: 3.7 us a layer at batch 64, 9.6 at 256)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                 kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 delta: torch.Tensor | None = None) -> None:
    """In place, per token t and head h (neox rotary on the two halves), as rms_norm_ref then apply_rotary_ref:
        if delta: q[t, h] = q[t, h] + delta_q[t, h] ; k, v likewise   (in the dtype; qkv_proj's deferred LoRA delta)
        if weights: q[t, h] = rms_norm(q[t, h], q_weight) ; k[t, h] = rms_norm(k[t, h], k_weight)
        c, s = cos(positions[t] * inv_freq) * attention_scaling, sin(...) * attention_scaling   (fp32, then dtype)
        x = cat(x1, x2) -> cat(x1 * c - x2 * s, x2 * c + x1 * s)   for x in q[t, h], k[t, h]
    kv_write = (v, k_cache, v_cache, slot_mapping) or None: then also, in the same launch, the cache writes of
    attention.write_kv_ref with the rotated k (a row with slot_mapping[t] < 0 is not written).
    q: [T, Hq, D] · k: [T, Hkv, D] (last dim contiguous; views into the qkv output are fine) · positions: [T]
    q_weight, k_weight: [D] or both None · inv_freq: [D/2] fp32
    v: [T, Hkv, D] (last dim contiguous) · k_cache, v_cache: [NB, BS, Hkv, D] contiguous · slot_mapping: [T] int
    delta: [T, (Hq + 2 Hkv) * D] (q, k, v heads side by side, the qkv output's layout; last dim contiguous), only
    with kv_write (v gets its delta on the cache write: the v passed in is left as it is)
    """
    require_triton()
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"qk_norm_rope: q and k need a contiguous head dim, got strides {q.stride()} and {k.stride()}")
    if k.dtype != q.dtype or (kv_write is not None and kv_write[0].dtype != q.dtype):
        raise ValueError(f"qk_norm_rope: q, k and v must share a dtype (views of one qkv output), found q {q.dtype}, "
                         f"k {k.dtype}, v {None if kv_write is None else kv_write[0].dtype}")
    norm = q_weight is not None
    heads = Hq + Hkv
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        want = (Hkv, D)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(c.shape[2:]) != want or not c.is_contiguous():
                raise ValueError(f"qk_norm_rope: {name} must be contiguous [blocks, block_size, {Hkv}, {D}], "
                                 f"found {tuple(c.shape)} strides {c.stride()}")
        if tuple(v.shape) != (T, Hkv, D) or v.stride(2) != 1:
            raise ValueError(f"qk_norm_rope: v must be [{T}, {Hkv}, {D}] with a contiguous head dim, found {tuple(v.shape)}")
        heads += Hkv
        kv_args = (v, k_cache, v_cache, slot_mapping, v.stride(0), v.stride(1), Hkv * D, D)
    else:
        kv_args = (q, q, q, positions, 0, 0, 0, 0)
    extra = {}
    if delta is not None:
        want_d = (T, (Hq + 2 * Hkv) * D)
        if kv_write is None or tuple(delta.shape) != want_d or delta.stride(1) != 1:
            raise ValueError(f"qk_norm_rope: delta must be {list(want_d)} with a contiguous last dim and come with "
                             f"kv_write, found {tuple(delta.shape)} strides {delta.stride()}, kv_write "
                             f"{'given' if kv_write is not None else 'None'}")
        extra = dict(d_ptr=delta, sdt=delta.stride(0), HAS_DELTA=True)
    if T:
        _qk_norm_rope_kernel[(T, triton.cdiv(heads, QK_ROPE_HEADS))](
            q, k, q_weight if norm else inv_freq, k_weight if norm else inv_freq, positions, inv_freq,
            Hq, Hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps, attention_scaling, *kv_args,
            HALF=D // 2, BLOCK_H=triton.next_power_of_2(D // 2), NORM=norm, WRITE_KV=kv_write is not None, **extra,
            HEADS=QK_ROPE_HEADS, num_warps=2,
        )
