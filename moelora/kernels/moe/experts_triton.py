"""The routed experts' Triton base path (fused MoE): one alignment of the (token, k) pairs by expert
(align_triton), the grouped expert GEMMs reading their input rows by index and writing pair rows directly
(gemm_triton), SiLU-and-mul and the router-weighted combine (act_triton). No host synchronisation and static output
sizes (they depend only on T, K, E and the block size), so every launch can be captured in a CUDA graph.

Pairs: p = t * K + k (pair-major). Expert weights as transformers >= 5 stores them: gate_up [E, 2I, H] (gate rows
first), down [E, H, I]. Launches per MoE layer without LoRA: align (1; 3 above 2,048 pairs) + gate_up GEMM with
SiLU-and-mul fused (1) + down GEMM (1) + combine (1, or none when the next RMSNorm computes it).
"""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON, interpreting
from moelora.kernels.moe.act_triton import act_and_mul, combine_deferred, moe_combine, silu_and_mul
from moelora.kernels.moe.align_triton import moe_align
from moelora.kernels.moe.gemm_triton import GemmConfig, expert_gemm, halved_n, pick_config


def fast_path_ok(x: torch.Tensor, w_gate_up, w_down) -> bool:
    """Whether TritonExperts takes these stacks: plain weight tensors of x's dtype and device, or quantized stacks
    whose `fast_path` is true (they run their own GEMM on this path's alignment); x 16-bit on CUDA, or any dtype on
    the CPU under TRITON_INTERPRET=1 (tests). The caller chose the Triton path for its device (ExpertKernels)."""
    if not HAS_TRITON:
        return False
    for w in (w_gate_up, w_down):
        if not isinstance(w, torch.Tensor):
            if not getattr(w, "fast_path", False):
                return False
        elif w.dtype != x.dtype or w.device != x.device:
            return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16)
    return interpreting()


def lora_epilogue_ok(w) -> bool:
    """Whether TritonExperts' GEMM for expert stack w adds a routed LoRA expand in its epilogue (lora=): quantized
    stacks whose `lora_epilogue` is true (FP8: fp8_expert_gemm); plain weight tensors do not."""
    return bool(getattr(w, "lora_epilogue", False))


class TritonExperts:
    """The base expert GEMMs of one MoE layer for fused_moe_pairs (same interface as experts._ExpertGemm:
    gemm(inp, w) -> [P, O]), plus the activation and the combine. The alignment is computed once here
    and serves both projections. inp may be per token ([T, D]: rows read as p // K, no gather copy)
    or per pair ([P, D]); with K == 1 the two are the same."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, config: GemmConfig | None = None,
                 align_stream: "torch.cuda.Stream | None" = None) -> None:
        """align_stream: the alignment launched on that stream (moe_align's stream), else on the current one."""
        self.T, self.K = topk_ids.shape
        self.P = self.T * self.K
        self.topk_ids = topk_ids
        self.cfg = config or pick_config(self.P)
        self.align = moe_align(topk_ids, num_experts, self.cfg.block_m, align_stream)
        self.act_quant_group: int | None = None  # set by a quantized gate_up GEMM whose stack quantizes inputs

    def __call__(self, inp: torch.Tensor, w, fuse_act: bool = False, lora=None) -> torch.Tensor:
        """inp: [T, D] or [P, D] · w: [E, O, D], or a quantized stack with expert_gemm(inp, topk_ids, align,
        gather_rows, block_m) · returns [P, O] (fuse_act: silu(gate) * up, [P, O/2]) · lora: an
        Fp8LoRAEpilogue for a stack whose lora_epilogue is true (its expand added in the GEMM's epilogue)."""
        gather = inp.shape[0] != self.P
        if lora is not None and not lora_epilogue_ok(w):
            raise ValueError(f"TritonExperts: lora= needs an expert stack with a LoRA epilogue (FP8); found "
                             f"{type(w).__name__}")
        if not isinstance(w, torch.Tensor):  # quantized: its GEMM on this alignment, then the activation kernel
            self.act_quant_group = getattr(w, "act_quant_group", None)  # the activation quantizes for the down GEMM
            y = (w.expert_gemm(inp, self.topk_ids, self.align, gather, self.cfg.block_m) if lora is None else
                 w.expert_gemm(inp, self.topk_ids, self.align, gather, self.cfg.block_m, lora=lora))
            return silu_and_mul(y, quant_group=self.act_quant_group) if fuse_act else y
        n = w.shape[1] // 2 if fuse_act else w.shape[1]
        out = torch.empty(self.P, n, dtype=inp.dtype, device=inp.device)
        cfg = halved_n(self.cfg) if fuse_act else self.cfg
        return expert_gemm(inp, w, self.align, self.P, self.K, out, gather, fuse_act=fuse_act, config=cfg)

    def act(self, gu: torch.Tensor, activation: str, delta: torch.Tensor | None = None) -> torch.Tensor:
        """act(g[:, :I]) * g[:, I:], g = gu (+ delta, rounded once to gu's dtype) · gu: [P, 2I] · delta: [P, 2I]
        fp32 or None · returns [P, I] (one launch for silu, the delta read in it)."""
        if activation == "silu":
            return silu_and_mul(gu, delta=delta, quant_group=self.act_quant_group)
        return act_and_mul(gu if delta is None else gu.add_(delta), activation)

    def combine(self, o: torch.Tensor, topk_weights: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_weights[t, k] * (o[t*K + k] (+ delta[t*K + k], rounded once to o's dtype)) · o: [P, H]
        delta: [P, H] fp32 or None · returns [T, H] in o.dtype. Inside defer_moe_combine: a placeholder instead,
        not computed, carrying (o, topk_weights, delta) for the RMSNorm that reads it next (take_moe_combine)."""
        if combine_deferred():
            out = torch.empty(self.T, o.shape[1], dtype=o.dtype, device=o.device)
            out.moe_combine = (o, topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous(), delta)
            return out
        return moe_combine(o, topk_weights, delta=delta)


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu",
                     config: GemmConfig | None = None) -> torch.Tensor:
    """experts.fused_moe_ref without LoRA, in 4 launches (align, gate_up GEMM + SiLU-and-mul, down GEMM, combine):
        out[t] = sum_k topk_weights[t, k] * W_d[e] (silu(W_g[e] x_t) * (W_u[e] x_t)),  e = topk_ids[t, k]
    x: [T, H] · w_gate_up: [E, 2I, H] · w_down: [E, H, I] · topk_weights, topk_ids: [T, K] · returns [T, H]
    """
    E = w_gate_up.shape[0]
    experts = TritonExperts(topk_ids, E, config)
    if activation == "silu":
        act = experts(x, w_gate_up, fuse_act=True)  # [P, I]
    else:
        act = experts.act(experts(x, w_gate_up), activation)
    o = experts(act, w_down)  # [P, H]
    return experts.combine(o, topk_weights)
