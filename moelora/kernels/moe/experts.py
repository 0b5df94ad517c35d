"""Routed experts: top-k routing and the expert MLPs, with per-slot LoRA on gate_up and down.

Expert weights follow transformers >= 5: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertLoRAArgs:
    """LoRA buffers of one MoE layer plus the batch's token -> slot map.

    gate_up_a: [2, S, E, R, H] (slice 0 = gate, 1 = up; each its own A) · gate_up_b: [S, E, 2I, R] (gate rows first)
    gate_up_scaling: [2, S] fp32 · gate_up_ranks: [2, S] int32
    down_a: [1, S, E, R, I] · down_b: [S, E, H, R] · down_scaling: [1, S] · down_ranks: [1, S] int32
    token_slots: [T] int32, -1 = no adapter
    """

    token_slots: torch.Tensor
    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    gate_up_scaling: torch.Tensor
    gate_up_ranks: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    down_scaling: torch.Tensor
    down_ranks: torch.Tensor
    gate_up_offsets: torch.Tensor | None = None  # [3] int32 (0, I, 2I) on the device; made here when None
    down_offsets: torch.Tensor | None = None  # [2] int32 (0, H)
    # [2, S] int32 (LoRAWeights.a_src): the slice whose A copy the fused kernel reads; None: each its own
    gate_up_a_src: torch.Tensor | None = None
    active_slots: torch.Tensor | None = None  # [L] int32: the batch's slot groups (SlotGroups.active_slots), or None


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: p = softmax(logits) in fp32; (w, ids) = topk(p, top_k); if renormalize: w /= w.sum(-1);
    w rounded once to out_dtype
    router_logits: [T, E] · returns topk_weights [T, K] out_dtype, topk_ids [T, K] int64
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    lora: ExpertLoRAArgs | None = None,
) -> torch.Tensor:
    """Semantics, for token t, its k-th expert e = topk_ids[t, k], slot s = token_slots[t]:
        gu = W_gu[e] x_t                                   # [2I]
        if s >= 0: gu[:I] += sc_g[s] * B_g[s,e] A_g[s,e] x_t ; gu[I:] += sc_u[s] * B_u[s,e] A_u[s,e] x_t
        a = act(gu[:I]) * gu[I:]                           # delta added before the activation
        o = W_d[e] a ; if s >= 0: o += sc_d[s] * B_d[s,e] A_d[s,e] a
        out_t += topk_weights[t, k] * o                    # the down delta is weighted like the base
    A pair with e = -1 (another rank's expert under expert parallelism) adds nothing.
    x: [T, H] · w_gate_up: [E, 2I, H] · w_down: [E, H, I] · topk_weights: [T, K] · topk_ids: [T, K]
    returns [T, H] in x.dtype
    """
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    act = _ACTIVATIONS[activation]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    slots = lora.token_slots.long() if lora is not None else None
    gu_ranks = lora.gate_up_ranks.tolist() if lora is not None else None
    d_ranks = lora.down_ranks.tolist() if lora is not None else None
    for e in torch.unique(topk_ids).tolist():
        if e < 0:  # a pair another rank's expert takes (expert parallelism): it adds nothing here
            continue
        tok, kpos = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[tok]  # [m, H]
        gu = xe @ w_gate_up[e].T  # [m, 2I]
        if lora is not None:
            b_halves = [lora.gate_up_b[:, :, :inter], lora.gate_up_b[:, :, inter:]]
            _expert_lora(gu, xe, slots[tok], e, lora.gate_up_a, b_halves, lora.gate_up_scaling, gu_ranks, inter)
        a = act(gu[:, :inter]) * gu[:, inter:]  # [m, I]
        o = a @ w_down[e].T  # [m, H]
        if lora is not None:
            _expert_lora(o, a, slots[tok], e, lora.down_a, [lora.down_b], lora.down_scaling, d_ranks, H)
        out.index_add_(0, tok, o.float() * topk_weights[tok, kpos, None].float())
    return out.to(x.dtype)


def _expert_lora(y, x, slots, e, a, b, scaling, ranks, width) -> None:
    """y[:, i*width:(i+1)*width] += scaling[i, s] * x @ a[i, s, e, :r].T @ b[i][s, e, :, :r].T for each slot s."""
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        for i in range(a.shape[0]):
            r = ranks[i][s]
            if r:
                h = x[rows] @ a[i, s, e, :r].T  # [m_s, r]
                y[rows, i * width : (i + 1) * width] += (h @ b[i][s, e, :, :r].T) * scaling[i, s].to(y.dtype)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def act_and_mul(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gu[:, :I]) * gu[:, I:] in fp32, rounded once to gu's dtype · gu: [P, 2I] · returns [P, I]."""
    inter = gu.shape[1] // 2
    return (_ACTIVATIONS[activation](gu[:, :inter].float()) * gu[:, inter:].float()).to(gu.dtype)


OVERLAP_MAX_PAIRS = 4096  # side-stream overlap only for decode-sized batches (its fp32 delta buffers are [P, 2I])


def fused_moe_pairs(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    lora: ExpertLoRAArgs | None,
    shrink,
    expand,
    plan=None,
    side_stream=None,
) -> torch.Tensor:
    """The same function as fused_moe_ref, computed over (token, k) pairs the way the GPU path runs it:
    base gate_up per pair, LoRA gate_up delta (shrink/expand kernels) before the activation, base down
    per pair, LoRA down delta, then the router-weighted sum over k (which weights the down delta too).
    shrink, expand: moe_lora_shrink/expand (Triton) or their references; plan: a function
    (topk_ids, token_slots, E, max_loras) -> alignment passed to the kernels as `align` (computed once per layer).
    side_stream: a CUDA stream; when given (and P <= OVERLAP_MAX_PAIRS) each LoRA chain (shrink, then expand
    into a delta [P, O]) runs on it while the main stream runs the base expert GEMM; the main stream joins
    before adding the delta (gu + delta rounds once): on the Triton fast path the activation and combine kernels
    read the delta and add it themselves (no extra pass). The delta is in the activations' dtype by default
    (set_lora_delta_dtype; PEFT's bf16 LoRA output is rounded so too), and then the serial path (no side stream)
    computes the same delta on the main stream: the side stream only moves work. With fp32 deltas the serial path
    adds in place (y + delta in fp32, rounded once: the same values).
    set_fused_lora(True) (kernels/_triton.py), P <= GEMV_MAX_PAIRS and shrink the Triton kernel or its reference:
    each projection's LoRA delta is one fused launch (moe_lora_fused[_ref]; store mode into delta when overlapping);
    with set_grouped_lora(True) too, from GROUPED_MIN_PAIRS pairs, the grouped kernel (moe_lora_grouped: one
    alignment by (slot, expert) a layer, made where the first delta runs and shared by gate_up and down).
    x: [T, H] · w_gate_up: [E, 2I, H] · w_down: [E, H, I] · topk_weights, topk_ids: [T, K] · returns [T, H]
    """
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    K = topk_ids.shape[1]
    P = T * K
    inter = two_i // 2
    from moelora.kernels.moe.experts_triton import TritonExperts, fast_path_ok  # Triton base path (fused_moe_triton.py)

    fast_ok = fast_path_ok(x, w_gate_up, w_down)
    if fast_ok and lora is None and activation == "silu":
        fast = TritonExperts(topk_ids, E)
        return fast.combine(fast(fast(x, w_gate_up, fuse_act=True), w_down), topk_weights)
    overlap = side_stream is not None and lora is not None and P <= OVERLAP_MAX_PAIRS
    fused = None  # set_fused_lora(True), decode-sized P: shrink + expand in one launch (moe_lora_fused_triton.py)
    if lora is not None:
        from moelora.kernels._triton import fused_lora, grouped_lora

        if fused_lora():
            from moelora.kernels.moe_lora.fused_triton import fused_for
            from moelora.kernels.moe_lora.chain_triton import GEMV_MAX_PAIRS

            fused = fused_for(shrink) if P <= GEMV_MAX_PAIRS else None
            if fused is not None and grouped_lora():  # pairs grouped by (slot, expert): A and B read once a group
                from moelora.kernels.moe_lora.grouped_triton import grouped_for

                fused = grouped_for(fused, topk_ids, lora.token_slots, E, lora.gate_up_a.shape[1]) or fused
            elif fused is None and P > GEMV_MAX_PAIRS:  # prefill: the grouped kernel (set_grouped_prefill)
                from moelora.kernels.moe_lora.fused_triton import moe_lora_fused
                from moelora.kernels.moe_lora.grouped_triton import grouped_prefill, grouped_prefill_for

                if grouped_prefill() and fused_for(shrink) is moe_lora_fused:
                    from moelora.kernels.moe_lora.grouped_triton import prefill_lora_epilogue, prefill_lora_epilogue_for

                    if (prefill_lora_epilogue() and fast_ok and not overlap and activation == "silu"
                            and prefill_lora_epilogue_for(w_gate_up) and prefill_lora_epilogue_for(w_down)):
                        return _experts_lora_epilogue(x, w_gate_up, w_down, topk_weights, topk_ids, lora, E,
                                                      prefill_lora_epilogue())
                    fused = grouped_prefill_for(topk_ids, lora.token_slots, E, lora.gate_up_a.shape[1])
    from moelora.kernels._triton import lora_delta_dtype, moe_lora_early, moe_lora_early_mode

    gu_parts = None if lora is None else (
        lora.gate_up_a, lora.gate_up_b, lora.gate_up_offsets, lora.gate_up_ranks, lora.gate_up_scaling, inter,
        lora.gate_up_a_src)
    # set_moe_lora_early: gate_up's LoRA kernel needs only x and the routing, not the experts' alignment: issued
    # on the side stream right after the alignment's launch, waiting only for what the alignment waits for (mode
    # "2": the alignment itself on a stream of a higher priority than the side stream's, so it gets an SM first)
    early = fast_ok and overlap and fused is not None and moe_lora_early()
    astream = None
    if early and moe_lora_early_mode() == "2":  # the alignment on a stream above the side stream's priority
        from moelora.kernels.streams import align_stream_above

        astream = align_stream_above(side_stream)
        early = astream is not None  # a GPU without a priority above the side stream's: the plain order (mode 1 lost)
    if early:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
    fast = TritonExperts(topk_ids, E, align_stream=astream) if fast_ok else None  # the alignment (one launch)
    early_gu = None
    if early:
        early_gu = torch.empty(P, two_i, dtype=lora_delta_dtype(x.dtype), device=x.device)
        gu_parts = _with_offsets(gu_parts, x.device)  # on the main stream, before the side stream waits
        side_stream.wait_event(ready)
        with torch.cuda.stream(side_stream):
            _launch_fused(fused, x, gu_parts, False, topk_ids, lora.token_slots, E, early_gu)
    pair_exp = topk_ids.reshape(-1)
    pair_tok = torch.arange(T, device=x.device).repeat_interleave(K) if fast is None else None
    gemm = fast or _ExpertGemm(pair_exp, E)
    kw = {}
    if lora is not None and plan is not None:
        kw["align"] = plan(topk_ids, lora.token_slots, E, lora.gate_up_a.shape[1])

    def project(inp, w, per_pair, parts):
        """(y, delta): y = base GEMM of one projection [P, O] with its LoRA delta added, delta None; or, when
        overlapping on the fast path, y the base GEMM alone and delta its LoRA delta [P, O] fp32, for the
        consumer (activation or combine) to add (rounded once, as y.add_(delta)). parts = (a, b, offsets,
        ranks, scaling, slice width, a_src or None) or None. The delta runs on the side stream when overlapping."""
        y_in = inp if per_pair or fast is not None else inp[pair_tok]  # the Triton GEMM reads x[p // K] itself
        if parts is None:
            return gemm(y_in, w), None
        if not per_pair and early_gu is not None:  # its LoRA already issued on the side stream (set_moe_lora_early)
            y = gemm(y_in, w)
            torch.cuda.current_stream(x.device).wait_stream(side_stream)  # the join
            return y, early_gu
        parts = _with_offsets(parts, x.device)  # before any fork
        a, b, offs, ranks, scaling, width, a_src = parts
        n, R = a.shape[0], a.shape[3]
        src = {} if a_src is None else {"a_src": a_src}  # the fused kernels only (the values are the same)
        h = None if fused is not None else torch.empty(P, n, R, dtype=torch.float32, device=x.device)  # [P, n, R]
        delta_dtype = lora_delta_dtype(x.dtype)
        # serial with fp32 deltas: the expand adds into y itself (rounded once). Otherwise a delta buffer
        # (fp32, or the activations' dtype: set_lora_delta_dtype), made on main before any fork, that the consumer
        # adds: the same arithmetic with and without the side stream, which only moves work
        if not overlap and delta_dtype == torch.float32:
            y = gemm(y_in, w)
            if fused is not None:
                fused(inp, a, b, offs, ranks, scaling, topk_ids, lora.token_slots, E, y, per_pair, **src)
            else:
                h.zero_()
                shrink(inp, a, ranks, topk_ids, lora.token_slots, E, h, per_pair, **kw)
                expand(h, b, offs, ranks, scaling, topk_ids, lora.token_slots, E, y, **kw)
            return y, None
        from moelora.kernels.streams import fork, join

        # zero-filled off the fast path: there y.add_(delta) and the weighted sum read every row, also those of
        # pairs on another rank's expert (e = -1), which the LoRA kernels leave untouched; the fast path's
        # activation and combine never read those rows
        delta = (torch.empty if fast is not None else torch.zeros)(P, w.shape[1], dtype=delta_dtype, device=x.device)
        main = fork(side_stream) if overlap else None
        with torch.cuda.stream(side_stream) if overlap else contextlib.nullcontext():
            if fused is not None:  # store mode writes every entry of delta: no zero-fill, no h
                _launch_fused(fused, inp, parts, per_pair, topk_ids, lora.token_slots, E, delta)
            else:
                delta.zero_()
                h.zero_()
                shrink(inp, a, ranks, topk_ids, lora.token_slots, E, h, per_pair, **kw)
                expand(h, b, offs, ranks, scaling, topk_ids, lora.token_slots, E, delta, **kw)
        y = gemm(y_in, w)
        if overlap:
            join(main, side_stream)
        if fast is None:
            return y.add_(delta), None  # y + delta (fp32, or already rounded to y's dtype), rounded once
        return y, delta  # the fast path's activation / combine kernel adds it (same rounding, no extra pass)

    gu, gu_delta = project(x, w_gate_up, False, gu_parts)  # [P, 2I], LoRA delta before the activation
    d_parts = None if lora is None else (
        lora.down_a, lora.down_b, lora.down_offsets, lora.down_ranks, lora.down_scaling, H, None)
    d_early = None  # set_moe_lora_early_down: down's LoRA on the side stream from gu + its delta, issued now
    if early_gu is not None and activation == "silu" and _early_down_ok(fused):
        d_early = _down_lora_from_gate_up(fused, gu, gu_delta, d_parts, topk_ids, lora.token_slots, E, side_stream)
    # [P, I], computed in fp32 and rounded once on both paths (as silu_and_mul): a quantized down projection
    # re-quantizes it, and a bf16 rounding difference there flips FP8 roundings (~1% apart at Qwen3 shapes)
    act = fast.act(gu, activation, gu_delta) if fast is not None else act_and_mul(gu, activation)
    if d_early is not None:
        o = gemm(act, w_down)
        torch.cuda.current_stream(x.device).wait_stream(side_stream)  # the join
        return fast.combine(o, topk_weights, d_early)
    o, o_delta = project(act, w_down, True, d_parts)  # [P, H]
    if fast is not None:
        return fast.combine(o, topk_weights, o_delta)
    out = (o.view(T, K, H).float() * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)


def _experts_lora_epilogue(x: torch.Tensor, w_gate_up, w_down, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           lora: ExpertLoRAArgs, E: int, mode: int = 1) -> torch.Tensor:
    """fused_moe_pairs at prefill with set_prefill_lora_epilogue, on the fast path's expert stacks with a LoRA
    epilogue (FP8): per projection the grouped shrink writes each pair's h (moe_lora_grouped_shrink, on one
    prefill_align grouping a layer), and the expert GEMM adds the expand in its epilogue (fp8_expert_gemm(lora=):
    mode 1 over all slots, 2 over lora.active_slots' groups, 3 those with the metadata loaded before the K steps; 2
    and 3 without active_slots: 1); no delta buffer, the activation and the combine plain.
    x: [T, H] · returns [T, H]."""
    from moelora.kernels.quant.fp8_triton import Fp8LoRAEpilogue
    from moelora.kernels.moe.experts_triton import TritonExperts
    from moelora.kernels.moe_lora.grouped_triton import PREFILL_BLOCK_M, moe_lora_grouped_shrink, prefill_align

    T, K = topk_ids.shape
    P = T * K
    inter = w_gate_up.shape[1] // 2
    H = x.shape[1]
    fast = TritonExperts(topk_ids, E)
    align = prefill_align(topk_ids, lora.token_slots, E, lora.gate_up_a.shape[1])
    pair_slots = lora.token_slots.repeat_interleave(K)  # [P]: the epilogue's rows are the pairs

    def epilogue(inp, parts, per_pair) -> Fp8LoRAEpilogue:
        a, b, offs, ranks, scaling, width, a_src = _with_offsets(parts, x.device)
        bounds = tuple(i * width for i in range(a.shape[0] + 1))  # on the host: the experts' slices are equal
        h = torch.empty(a.shape[0], P, a.shape[3], dtype=torch.float32, device=x.device)  # [n, P, R]
        moe_lora_grouped_shrink(inp, a, ranks, topk_ids, lora.token_slots, E, h, per_pair, align, PREFILL_BLOCK_M,
                                a_src=a_src)
        return Fp8LoRAEpilogue(h, b, offs, ranks, scaling, pair_slots, lora.active_slots if mode in (2, 3) else None,
                               slice_bounds=bounds, prefetch=mode == 3)

    gu_lora = epilogue(x, (lora.gate_up_a, lora.gate_up_b, lora.gate_up_offsets, lora.gate_up_ranks,
                           lora.gate_up_scaling, inter, lora.gate_up_a_src), False)
    act = fast(x, w_gate_up, fuse_act=True, lora=gu_lora)  # [P, I], its LoRA inside gate_up (silu_and_mul after
    # it, quantizing for the down GEMM)
    d_lora = epilogue(act, (lora.down_a, lora.down_b, lora.down_offsets, lora.down_ranks, lora.down_scaling, H,
                            None), True)
    return fast.combine(fast(act, w_down, lora=d_lora), topk_weights)


def _early_down_ok(fused) -> bool:
    """set_moe_lora_early_down applies: on, and `fused` the per-pair kernel or its reference (they take act_in)."""
    from moelora.kernels._triton import moe_lora_early_down
    from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref

    return moe_lora_early_down() and fused in (moe_lora_fused, moe_lora_fused_ref)


def _down_lora_from_gate_up(fused, gu: torch.Tensor, gu_delta: torch.Tensor, parts, topk_ids: torch.Tensor,
                            token_slots: torch.Tensor, E: int, side_stream) -> torch.Tensor:
    """The down projection's LoRA delta [P, H] (store mode) issued on side_stream once everything on the main
    stream so far (the gate_up GEMM and its join) is done, reading gu [P, 2I] and gu_delta [P, 2I] and computing the
    activation itself (moe_lora_fused(act_in=True)), so it runs beside the activation kernel. The caller joins
    before the combine reads the delta. parts = the down projection's (a, b, offsets, ranks, scaling, H, None)."""
    from moelora.kernels._triton import lora_delta_dtype
    from moelora.kernels.streams import fork

    a, b, offs, ranks, scaling, width, _ = _with_offsets(parts, gu.device)  # before the fork
    delta = torch.empty(gu.shape[0], b.shape[2], dtype=lora_delta_dtype(gu.dtype), device=gu.device)
    fork(side_stream)
    with torch.cuda.stream(side_stream):
        fused(gu, a, b, offs, ranks, scaling, topk_ids, token_slots, E, delta, True, store=True, act_in=True,
              act_delta=gu_delta)
    return delta


def _with_offsets(parts, device: torch.device):
    """parts with its slice offsets made when None (equal slices of `width`): on the current stream, so call it
    before a fork (nothing the side stream uses may be allocated on it under graph capture)."""
    a, b, offs, ranks, scaling, width, a_src = parts
    if offs is None:
        offs = torch.tensor([i * width for i in range(a.shape[0] + 1)], dtype=torch.int32, device=device)
    return a, b, offs, ranks, scaling, width, a_src


def _launch_fused(fused, inp: torch.Tensor, parts, per_pair: bool, topk_ids: torch.Tensor, token_slots: torch.Tensor,
                  E: int, delta: torch.Tensor) -> None:
    """One projection's routed-expert LoRA delta by the fused kernel in store mode (every entry of delta written).
    parts = (a, b, offsets, ranks, scaling, width, a_src or None), offsets made beforehand (_with_offsets)."""
    a, b, offs, ranks, scaling, width, a_src = parts
    kw = {} if a_src is None else {"a_src": a_src}
    fused(inp, a, b, offs, ranks, scaling, topk_ids, token_slots, E, delta, per_pair, store=True, **kw)


class _ExpertGemm:
    """y[p] = inp[p] @ w[pair_exp[p]].T for all pairs: one grouped GEMM (torch._grouped_mm: bf16 on a
    GPU that has it; no host synchronisation) or a loop over the experts present (any dtype, any device)."""

    def __init__(self, pair_exp: torch.Tensor, num_experts: int) -> None:
        self.pair_exp, self.E = pair_exp, num_experts
        self.scratch: dict = {}  # what a quantized weight's GEMM shares between gate_up and down (its alignment)
        self.grouped = pair_exp.is_cuda and hasattr(torch, "_grouped_mm")
        self.order: torch.Tensor | None = None  # made at the first bf16 grouped GEMM (quantized stacks need none)

    def _sort(self) -> None:
        self.order = torch.argsort(self.pair_exp)
        counts = torch.zeros(self.E, dtype=torch.int32, device=self.pair_exp.device)
        counts.scatter_add_(0, self.pair_exp, torch.ones_like(self.pair_exp, dtype=torch.int32))
        self.offs = torch.cumsum(counts, 0, dtype=torch.int32)

    def __call__(self, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """inp: [P, D] · w: [E, O, D] · returns [P, O]."""
        if not isinstance(w, torch.Tensor):  # a quantized stack (layers/fp8.py, layers/nvfp4.py) runs its own GEMM
            return w.grouped_mm(inp, self.pair_exp, self.E, self.scratch)
        if self.grouped and inp.dtype == torch.bfloat16:
            if self.order is None:
                self._sort()
            y_sorted = torch._grouped_mm(inp[self.order], w.transpose(1, 2), offs=self.offs)  # [P, O]
            y = torch.empty_like(y_sorted)
            y[self.order] = y_sorted
            return y
        y = torch.empty(inp.shape[0], w.shape[1], dtype=inp.dtype, device=inp.device)
        for e in torch.unique(self.pair_exp).tolist():
            p = (self.pair_exp == e).nonzero().squeeze(1)
            y[p] = inp[p] @ w[e].T
        return y
