"""Routed experts: the expert MLPs over the top-k routing, with per-slot LoRA on gate_up and down. fused_moe_ref is
the semantics (the oracle every path is tested against); fused_moe_pairs computes it over (token, k) pairs the way
the GPU runs it, with the kernels an ExpertKernels (chosen once, RoutedExperts.configure) names:

    base GEMMs:  TritonExperts (Triton: one alignment, GEMMs reading token rows in place, activation and combine
                 kernels) where fast_path_ok, else _ExpertGemm (torch._grouped_mm or a loop over the experts)
    LoRA deltas: kernels.lora.pick(routing) (moe_lora/backend.py: per-pair, grouped, grouped prefill, reference),
                 or the FP8 expert GEMM's epilogue at prefill (EpilogueLoRA)

Expert weights follow transformers >= 5: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from moelora.kernels.moe.act_triton import ACTIVATIONS, act_and_mul
from moelora.kernels.moe.experts_triton import TritonExperts, fast_path_ok, lora_epilogue_ok
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.backend import EpilogueLoRA, MoELoRAKernels
from moelora.kernels.moe_lora.config import MoELoRAConfig
from moelora.kernels.streams import align_stream_above, fork, join

OVERLAP_MAX_PAIRS = 4096  # side-stream overlap only for decode-sized batches (its delta buffers are [P, 2I])


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
    # [2, S] int32 (LoRAWeights.a_src): the slice whose A copy the LoRA kernels read; None: each its own
    gate_up_a_src: torch.Tensor | None = None
    active_slots: torch.Tensor | None = None  # [L] int32: the batch's slot groups (SlotGroups.active_slots), or None

    def kernel_args(self, topk_ids: torch.Tensor, num_experts: int, inter: int,
                    hidden: int) -> tuple[Routing, ProjLoRA, ProjLoRA]:
        """(routing, gate_up's LoRA, down's LoRA) as the LoRA kernels take them; slice offsets made where None (on
        the current stream: call it before any fork). topk_ids: [T, K] · inter, hidden: the slices' widths."""
        routing = Routing(topk_ids, self.token_slots, num_experts, self.gate_up_a.shape[1], self.active_slots)
        gate_up = ProjLoRA.build(self.gate_up_a, self.gate_up_b, self.gate_up_ranks, self.gate_up_scaling, inter,
                                 self.gate_up_offsets, self.gate_up_a_src)
        down = ProjLoRA.build(self.down_a, self.down_b, self.down_ranks, self.down_scaling, hidden, self.down_offsets)
        return routing, gate_up, down


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


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", lora: ExpertLoRAArgs | None = None) -> torch.Tensor:
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
    act = ACTIVATIONS[activation]
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


@dataclass(frozen=True)
class ExpertKernels:
    """How the routed experts run, chosen once (RoutedExperts.configure; tests build their own).
    triton: the Triton base path (TritonExperts) where the stacks allow it (fast_path_ok); else _ExpertGemm.
    lora: the LoRA family (Triton kernels or the torch reference) and its size threshold (MoELoRAKernels).
    early: overlapping on the Triton path, gate_up's LoRA kernel is issued on the side stream beside the experts'
    alignment (it reads x and the routing only), the alignment on a stream above the side stream's priority (so its
    one program is placed before the LoRA kernel's CTAs); a GPU without such a priority keeps the plain order.
    early_down: with early and a backend that reads gate_up's output (act_in), down's LoRA is issued as soon as the
    gate_up GEMM is done, beside the activation kernel.
    prefill_epilogue: above DECODE_MAX_PAIRS pairs, on stacks whose GEMM has a LoRA epilogue (FP8), not overlapping,
    SiLU: the expand inside the expert GEMM (EpilogueLoRA), no delta buffers."""

    triton: bool = False
    lora: MoELoRAKernels = field(default_factory=MoELoRAKernels)
    early: bool = True
    early_down: bool = True
    prefill_epilogue: bool = True

    @classmethod
    def from_config(cls, cfg: MoELoRAConfig, triton: bool) -> "ExpertKernels":
        """The Triton kernels (base and LoRA) or the references, cfg's choices."""
        return cls(triton, MoELoRAKernels(triton, cfg.grouped_min_pairs), cfg.early, cfg.early_down,
                   cfg.prefill_epilogue)

    def epilogue_ok(self, num_pairs: int, fast: bool, overlap: bool, activation: str, w_gate_up, w_down) -> bool:
        """Whether this layer call takes the FP8 expert GEMM's LoRA epilogue (prefill_epilogue above)."""
        return (self.prefill_epilogue and self.lora.triton and self.lora.prefill(num_pairs) and fast and not overlap
                and activation == "silu" and lora_epilogue_ok(w_gate_up) and lora_epilogue_ok(w_down))


def fused_moe_pairs(x: torch.Tensor, w_gate_up, w_down, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    activation: str, lora: ExpertLoRAArgs | None, kernels: ExpertKernels,
                    side_stream: "torch.cuda.Stream | None" = None) -> torch.Tensor:
    """fused_moe_ref's function over (token, k) pairs: base gate_up per pair, its LoRA delta added before the
    activation, base down per pair, its LoRA delta, then the router-weighted sum over k (which weights the down delta
    too), with the kernels `kernels` names. w_gate_up, w_down: [E, 2I, H] / [E, H, I] tensors or quantized stacks
    (layers/fp8.py, layers/nvfp4.py). side_stream: a CUDA stream; when given (and P <= OVERLAP_MAX_PAIRS) each
    projection's LoRA delta runs on it while the main stream runs the base expert GEMM, joined before the delta is
    read. A delta is a buffer in the activations' dtype (PEFT's bf16 LoRA output is rounded so too) that the
    consumer adds (on the Triton path the activation and combine kernels read it: no extra pass); the serial path
    computes the same buffer on the main stream, so the side stream only moves work. fp32 activations off the side
    stream: the kernel adds the delta into the GEMM's output itself (the same values, one rounding).
    x: [T, H] · topk_weights, topk_ids: [T, K] · returns [T, H] (or, inside act_triton.defer_moe_combine on the
    Triton path, a placeholder the next RMSNorm computes)
    """
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    K = topk_ids.shape[1]
    P = T * K
    fast_ok = kernels.triton and fast_path_ok(x, w_gate_up, w_down)
    if fast_ok and lora is None and activation == "silu":
        fast = TritonExperts(topk_ids, E)
        return fast.combine(fast(fast(x, w_gate_up, fuse_act=True), w_down), topk_weights)
    overlap = side_stream is not None and lora is not None and P <= OVERLAP_MAX_PAIRS
    gu_lora = d_lora = backend = routing = None
    if lora is not None:
        routing, gu_lora, d_lora = lora.kernel_args(topk_ids, E, two_i // 2, H)  # offsets made before any fork
        if kernels.epilogue_ok(P, fast_ok, overlap, activation, w_gate_up, w_down):
            return _experts_lora_epilogue(x, w_gate_up, w_down, topk_weights, routing, gu_lora, d_lora)
        backend = kernels.lora.pick(routing)  # (before any fork: what its side-stream launches write is made here)
    # early: gate_up's LoRA kernel needs only x and the routing, not the experts' alignment: issued on the side
    # stream right after the alignment's launch (which runs on a stream above the side stream's priority)
    astream = align_stream_above(side_stream) if fast_ok and overlap and kernels.early else None
    if astream is not None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
    fast = TritonExperts(topk_ids, E, align_stream=astream) if fast_ok else None  # the alignment (one launch)
    early_gu = None
    if astream is not None:
        early_gu = torch.empty(P, two_i, dtype=x.dtype, device=x.device)
        side_stream.wait_event(ready)
        with torch.cuda.stream(side_stream):
            backend.delta(x, gu_lora, routing, early_gu, x_per_pair=False, store=True)
    pair_tok = torch.arange(T, device=x.device).repeat_interleave(K) if fast is None else None
    gemm = fast or _ExpertGemm(topk_ids.reshape(-1), E)

    def project(inp: torch.Tensor, w, per_pair: bool, plora: ProjLoRA | None):
        """(y, delta): y = base GEMM of one projection [P, O] with its LoRA delta added, delta None; or, on the fast
        path, y the base GEMM alone and delta its LoRA delta [P, O] for the consumer (activation or combine) to add
        (rounded once, as y.add_(delta)). The delta runs on the side stream when overlapping."""
        y_in = inp if per_pair or fast is not None else inp[pair_tok]  # the Triton GEMM reads x[p // K] itself
        if plora is None:
            return gemm(y_in, w), None
        if not per_pair and early_gu is not None:  # its LoRA already issued on the side stream (early)
            y = gemm(y_in, w)
            torch.cuda.current_stream(x.device).wait_stream(side_stream)  # the join
            return y, early_gu
        if not overlap and x.dtype == torch.float32:  # serial fp32: the kernel adds into y itself (rounded once)
            y = gemm(y_in, w)
            backend.delta(inp, plora, routing, y, x_per_pair=per_pair, store=False)
            return y, None
        # made on main before any fork; zero-filled off the fast path: there y.add_(delta) and the weighted sum read
        # every row, also those of pairs on another rank's expert (e = -1), which the LoRA kernels leave untouched;
        # the fast path's activation and combine never read those rows
        delta = (torch.empty if fast is not None else torch.zeros)(P, w.shape[1], dtype=x.dtype, device=x.device)
        main = fork(side_stream) if overlap else None
        with torch.cuda.stream(side_stream) if overlap else contextlib.nullcontext():
            backend.delta(inp, plora, routing, delta, x_per_pair=per_pair, store=True)  # every entry written
        y = gemm(y_in, w)
        if overlap:
            join(main, side_stream)
        if fast is None:
            return y.add_(delta), None  # y + delta (already rounded to y's dtype), rounded once
        return y, delta  # the fast path's activation / combine kernel adds it (same rounding, no extra pass)

    gu, gu_delta = project(x, w_gate_up, False, gu_lora)  # [P, 2I], LoRA delta before the activation
    d_early = None  # early_down: down's LoRA on the side stream from gu + its delta, issued now
    if early_gu is not None and activation == "silu" and kernels.early_down and backend.act_in:
        d_early = torch.empty(P, H, dtype=x.dtype, device=x.device)
        fork(side_stream)  # after the gate_up GEMM and its join
        with torch.cuda.stream(side_stream):
            backend.delta(gu, d_lora, routing, d_early, x_per_pair=True, store=True, act_in=True, act_delta=gu_delta)
    # [P, I], computed in fp32 and rounded once on both paths (as silu_and_mul): a quantized down projection
    # re-quantizes it, and a bf16 rounding difference there flips FP8 roundings (~1% apart at Qwen3 shapes)
    act = fast.act(gu, activation, gu_delta) if fast is not None else act_and_mul(gu, activation)
    if d_early is not None:
        o = gemm(act, w_down)
        torch.cuda.current_stream(x.device).wait_stream(side_stream)  # the join
        return fast.combine(o, topk_weights, d_early)
    o, o_delta = project(act, w_down, True, d_lora)  # [P, H]
    if fast is not None:
        return fast.combine(o, topk_weights, o_delta)
    out = (o.view(T, K, H).float() * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)


def _experts_lora_epilogue(x: torch.Tensor, w_gate_up, w_down, topk_weights: torch.Tensor, routing: Routing,
                           gate_up: ProjLoRA, down: ProjLoRA) -> torch.Tensor:
    """fused_moe_pairs at prefill on expert stacks with a LoRA epilogue (FP8), the Triton path, SiLU: per projection
    the grouped shrink writes each pair's h and the expert GEMM adds the expand in its epilogue (EpilogueLoRA); no
    delta buffer, the activation and the combine plain. x: [T, H] · returns [T, H]."""
    fast = TritonExperts(routing.topk_ids, w_gate_up.shape[0])
    epi = EpilogueLoRA()
    # [P, I]: the LoRA inside gate_up, silu_and_mul after it (quantizing for the down GEMM)
    act = fast(x, w_gate_up, fuse_act=True, lora=epi.epilogue(x, gate_up, routing, x_per_pair=False))
    return fast.combine(fast(act, w_down, lora=epi.epilogue(act, down, routing, x_per_pair=True)), topk_weights)


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
        return expert_matmul_loop(inp, w, self.pair_exp)


def expert_matmul_loop(inp: torch.Tensor, w: torch.Tensor, pair_exp: torch.Tensor) -> torch.Tensor:
    """y[p] = inp[p] @ w[pair_exp[p]].T, a loop over the experts present (any dtype, any device).
    inp: [P, D] · w: [E, O, D] · pair_exp: [P] · returns [P, O] in inp.dtype"""
    y = torch.empty(inp.shape[0], w.shape[1], dtype=inp.dtype, device=inp.device)
    for e in torch.unique(pair_exp).tolist():
        p = (pair_exp == e).nonzero().squeeze(1)
        y[p] = inp[p] @ w[e].T
    return y
