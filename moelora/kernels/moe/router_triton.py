"""The MoE router on the GPU: route_topk (softmax and top-k of given logits, one launch) and router_topk (the gate
GEMM, softmax and top-k in one launch at decode sizes; MoEConfig.fused_router). References: experts.route_topk_ref,
router_topk_ref.

router_topk: the gate GEMM is split over (token block, K split, expert block) programs, each storing its fp32
partial; the program arriving last for a token block (an arrival counter per token block, as split_k_reduce) adds the
partials in split order (deterministic), rounds the logits to x's dtype (as F.linear returns them), and does
route_topk's softmax and top-k for its rows (H200, batch 64: 7.0 µs a layer against 8.2 for three kernels).
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, dot_precision, pdl_args, require_triton
from moelora.kernels.moe.experts import route_topk_ref

FUSED_ROUTER_MAX_T = 256  # rows; above it F.linear + route_topk (the partials grow with T, the launch gains nothing)
FUSED_ROUTER_MAX_E = 512  # experts: one program holds a token block's whole row of logits
ROUTE_TOPK_MAX_E = 4096  # route_topk holds a row of logits in one program
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_N_COUNTERS = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels._triton import pdl_enter

    @triton.jit
    def _router_topk_kernel(x_ptr, g_ptr, ws_ptr, cnt_ptr, lg_ptr, w_ptr, ids_ptr, T, E, H, K_PER_SPLIT,
                            s_xt, s_xh, s_ge, s_gh, s_lt, s_le,
                            TOP_K: tl.constexpr, KS: tl.constexpr, EB: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_K: tl.constexpr, RENORM: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_e = tl.program_id(2)
        rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = rows < T
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        mask_e = offs_e < E
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        k0 = pid_s * K_PER_SPLIT
        for kk in range(0, K_PER_SPLIT, BLOCK_H):
            offs_h = k0 + kk + tl.arange(0, BLOCK_H)
            mask_h = (offs_h < H) & (kk + tl.arange(0, BLOCK_H) < K_PER_SPLIT)
            xa = tl.load(x_ptr + rows[:, None] * s_xt + offs_h[None, :] * s_xh,
                         mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # [BLOCK_T, BLOCK_H]
            ga = tl.load(g_ptr + offs_e[None, :] * s_ge + offs_h[:, None] * s_gh,
                         mask=mask_e[None, :] & mask_h[:, None], other=0.0)  # [BLOCK_H, BLOCK_E]
            acc = tl.dot(xa, ga, acc, input_precision=PRECISION)
        # this program's partial to ws[pid_s, rows, offs_e] ([KS, T, E] fp32), then count it in the token block
        tl.store(ws_ptr + pid_s * T * E + rows[:, None] * E + offs_e[None, :], acc,
                 mask=mask_t[:, None] & mask_e[None, :])
        tl.debug_barrier()  # every thread's partial stored before the count (the atomic is acq_rel, gpu scope)
        last = tl.atomic_add(cnt_ptr + pid_t, 1) == KS * EB - 1
        if last:
            offs = tl.arange(0, BLOCK_EP)
            mask = offs < E
            m2 = mask_t[:, None] & mask[None, :]
            tile = ws_ptr + rows[:, None] * E + offs[None, :]
            z = tl.zeros((BLOCK_T, BLOCK_EP), dtype=tl.float32)
            for j in range(KS):  # in split order: the same sum every launch
                z += tl.load(tile + j * T * E, mask=m2, other=0.0, cache_modifier=".cg")
            lg = z.to(lg_ptr.dtype.element_ty)  # the logits as F.linear returns them (x's dtype)
            tl.store(lg_ptr + rows[:, None] * s_lt + offs[None, :] * s_le, lg, mask=m2)
            v = tl.where(mask[None, :], lg.to(tl.float32), float("-inf"))
            v = tl.exp(v - tl.max(v, axis=1)[:, None])
            v = tl.where(mask[None, :], v, 0.0)
            probs = v / tl.sum(v, axis=1)[:, None]
            cur = tl.where(mask[None, :], probs, -1.0)  # probabilities are >= 0: masked lanes never win
            offs_k = tl.arange(0, BLOCK_K)
            w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
            for k in tl.static_range(TOP_K):
                best = tl.max(cur, axis=1)  # [BLOCK_T]
                idx = tl.min(tl.where(cur == best[:, None], offs[None, :], BLOCK_EP), axis=1)  # lowest id of ties
                w = tl.where(offs_k[None, :] == k, best[:, None], w)
                ids = tl.where(offs_k[None, :] == k, idx[:, None].to(tl.int64), ids)
                cur = tl.where(offs[None, :] == idx[:, None], -2.0, cur)
            if RENORM:
                w = w / tl.sum(w, axis=1)[:, None]
            mk = mask_t[:, None] & (offs_k[None, :] < TOP_K)
            out = rows[:, None] * TOP_K + offs_k[None, :]
            tl.store(w_ptr + out, w.to(w_ptr.dtype.element_ty), mask=mk)
            tl.store(ids_ptr + out, ids, mask=mk)
            tl.store(cnt_ptr + pid_t, 0)  # for the next launch (stream order, graph replays)


def _config(T: int, E: int, H: int, force: tuple[int, int, int, int, int] | None = None
            ) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, KS, BLOCK_E, BLOCK_H, num_warps): 16-token blocks, 8 K splits; up to 128 tokens expert blocks of
    64 and one K tile of 256 a split, above it expert blocks of 128 and K tiles of 128 (the H200 sweep's best).
    force: entries that are not 0 replace the chosen ones (router_topk's launch=)."""
    bt, ks, be, bh, nw = force or (0, 0, 0, 0, 0)
    for name, v in (("block_t", bt), ("block_e", be), ("block_h", bh)):
        if v and (v < 16 or v & (v - 1)):
            raise ValueError(f"router_topk launch: {name} must be 0 or a power of two >= 16, got {v}")
    if ks < 0 or nw not in (0, 1, 2, 4, 8):
        raise ValueError(f"router_topk launch: splits >= 0 and num_warps 0, 1, 2, 4 or 8; got {ks}, {nw}")
    bt = bt or 16
    bh = bh or (256 if T <= 128 else 128)
    be = min(be or (64 if T <= 128 else 128), max(16, triton.next_power_of_2(E)))
    ks = ks or max(1, min(8, H // 256))
    return bt, ks, be, bh, nw or 4


def _counters(device: torch.device) -> torch.Tensor | None:
    """Arrival counters, one per token block, left at zero by every launch; made eagerly only (inside a CUDA-graph
    capture a zero-fill is only recorded: a capture that finds none gets None and the caller falls back)."""
    cnt = _COUNTERS.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = torch.zeros(_N_COUNTERS, dtype=torch.int32, device=device)
        _COUNTERS[device] = cnt
    return cnt


def router_topk_ok(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether router_topk takes this call: x [T, H] and gate of one dtype, 1..FUSED_ROUTER_MAX_T rows, at most
    FUSED_ROUTER_MAX_E experts, and the counters made (not first inside a graph capture). The caller chose the Triton
    path for its device (MoEBlock.configure)."""
    if not (HAS_TRITON and x.dim() == 2 and gate.dtype == x.dtype and 0 < x.shape[0] <= FUSED_ROUTER_MAX_T):
        return False
    return gate.shape[0] <= FUSED_ROUTER_MAX_E and _counters(x.device) is not None


def make_counters(device: torch.device) -> None:
    """The arrival counters of `device`, made now (eagerly: before any CUDA-graph capture)."""
    _counters(device)


def router_topk(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
                out_dtype: torch.dtype | None = None, launch: tuple[int, int, int, int, int] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Semantics (router_topk_ref): logits = x @ gate.T summed in fp32, rounded to x's dtype (F.linear's output);
    p = softmax(logits) in fp32; (w, ids) = topk(p, top_k) in decreasing p (ties: the lowest expert id first);
    if renormalize: w /= w.sum(-1); w rounded once to out_dtype (default x's dtype).
    x: [T, H] · gate: [E, H] (x's dtype) · returns topk_weights [T, top_k], topk_ids [T, top_k] int64,
    logits [T, E] x's dtype. launch: (BLOCK_T, splits, BLOCK_E, BLOCK_H, num_warps) forced where not 0 (sweeps,
    tests; the same results up to fp32 summation order)."""
    require_triton()
    T, H = x.shape
    E, Hg = gate.shape
    if Hg != H or gate.dtype != x.dtype or top_k > E:
        raise ValueError(f"router_topk: expected gate [E, {H}] of {x.dtype} and top_k <= E; found gate "
                         f"{tuple(gate.shape)} {gate.dtype}, top_k {top_k}")
    out_dtype = out_dtype or x.dtype
    w = torch.empty(T, top_k, dtype=out_dtype, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    logits = torch.empty(T, E, dtype=x.dtype, device=x.device)
    if T == 0:
        return w, ids, logits
    cnt = _counters(x.device)
    bt, ks, be, bh, nw = _config(T, E, H, launch)
    tb = triton.cdiv(T, bt)
    if cnt is None or tb > cnt.numel():
        raise RuntimeError(f"router_topk: no arrival counters for {tb} token blocks (router_topk_ok first)")
    k_per_split = triton.cdiv(triton.cdiv(H, ks), bh) * bh
    ks = triton.cdiv(H, k_per_split)
    eb = triton.cdiv(E, be)
    ws = torch.empty(ks, T, E, dtype=torch.float32, device=x.device)
    _router_topk_kernel[(tb, ks, eb)](
        x, gate, ws, cnt, logits, w, ids, T, E, H, k_per_split,
        x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), logits.stride(0), logits.stride(1),
        TOP_K=top_k, KS=ks, EB=eb, BLOCK_T=bt, BLOCK_E=be, BLOCK_EP=max(16, triton.next_power_of_2(E)),
        BLOCK_H=bh, BLOCK_K=max(2, triton.next_power_of_2(top_k)), RENORM=renormalize,
        PRECISION=dot_precision(x.dtype), num_warps=nw, **pdl_args(x.device))
    return w, ids, logits


def router_topk_ref(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_topk's semantics in torch: logits in fp32 rounded to x's dtype, then moe.route_topk_ref."""
    logits = (x.float() @ gate.float().T).to(x.dtype)
    w, ids = route_topk_ref(logits, top_k, renormalize, out_dtype or x.dtype)
    return w, ids, logits


if HAS_TRITON:

    @triton.jit
    def _route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t, s_e,
                           K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        x = tl.load(logits_ptr + t * s_t + offs * s_e, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.exp(x - tl.max(x, axis=0))
        x = tl.where(mask, x, 0.0)
        probs = x / tl.sum(x, axis=0)
        cur = tl.where(mask, probs, -1.0)  # probabilities are >= 0: masked lanes never win
        offs_k = tl.arange(0, BLOCK_K)
        w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for k in tl.static_range(K):
            best = tl.max(cur, axis=0)
            idx = tl.min(tl.where(cur == best, offs, BLOCK_E), axis=0)  # lowest index among ties
            w = tl.where(offs_k == k, best, w)
            ids = tl.where(offs_k == k, idx.to(tl.int64), ids)
            cur = tl.where(offs == idx, -2.0, cur)
        if RENORM:
            w = w / tl.sum(w, axis=0)
        tl.store(w_ptr + t * K + offs_k, w.to(w_ptr.dtype.element_ty), mask=offs_k < K)
        tl.store(ids_ptr + t * K + offs_k, ids, mask=offs_k < K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route_topk_ref in one launch: p = softmax(logits) (fp32); (w, ids) = topk(p, K) in decreasing p
    (ties: the lowest expert id first); if renormalize: w /= w.sum(-1); w rounded once to out_dtype.
    router_logits: [T, E] · returns topk_weights [T, K] out_dtype, topk_ids [T, K] int64."""
    require_triton()
    T, E = router_logits.shape
    w = torch.empty(T, top_k, dtype=out_dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_topk_kernel[(T,)](router_logits, w, ids, E, router_logits.stride(0), router_logits.stride(1),
                                 K=top_k, BLOCK_E=max(16, triton.next_power_of_2(E)),
                                 BLOCK_K=max(2, triton.next_power_of_2(top_k)), RENORM=renormalize,
                                 num_warps=1 if E <= 256 else 4, **pdl_args(router_logits.device))
    return w, ids

