"""MoE feed-forward: router, routed experts (+LoRA), optional shared expert; and the dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.config import ModelConfig
from moelora.kernels._triton import HAS_TRITON
from moelora.kernels.config import KernelConfig
from moelora.kernels.moe.act_triton import ACTIVATIONS, defer_moe_combine
from moelora.kernels.moe.experts import ExpertKernels, ExpertLoRAArgs, fused_moe_pairs, fused_moe_ref, route_topk_ref
from moelora.kernels.moe.router_triton import ROUTE_TOPK_MAX_E, make_counters, route_topk, router_topk, router_topk_ok
from moelora.kernels.streams import fork, join, side_stream
from moelora.layers.linear import LoRALinear
from moelora.layers.lora import LoRAWeights, lora_active


class DenseMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused as two slices of gate_up_proj."""

    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.inter = inter
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = LoRALinear(hidden, [inter, inter], False, dtype, device)
        self.down_proj = LoRALinear(inter, [hidden], False, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gu = self.gate_up_proj(x, lora)  # [T, 2I]
        return self.down_proj(self.act(gu[:, : self.inter]) * gu[:, self.inter :], lora)


class RoutedExperts(nn.Module):
    """gate_up_proj: [E, 2I, H] (gate rows first) · down_proj: [E, H, I], as transformers >= 5 stores them."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.act = num_experts, hidden, inter, act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype, device=device), requires_grad=False)
        self.gate_up_lora: LoRAWeights | None = None
        self.down_lora: LoRAWeights | None = None
        self.overlap = False  # GPU: the LoRA deltas on a side stream beside the base expert GEMMs
        self.quant = None  # quantized expert weights: layers/fp8.py Fp8State or layers/nvfp4.py Nvfp4State
        self.configure(KernelConfig())

    def configure(self, cfg: KernelConfig, triton: bool | None = None) -> None:
        """This layer's kernels from cfg, chosen once (ExpertKernels): the Triton ones (base path and LoRA) where its
        weights are on a CUDA device and Triton is installed, else the torch references. triton: forced (True on the
        CPU runs the Triton kernels under TRITON_INTERPRET=1: tests)."""
        self.kernel_config, self.forced_triton = cfg, triton
        if triton is None:
            triton = HAS_TRITON and self.gate_up_proj.is_cuda
        self.kernels = ExpertKernels.from_config(cfg.moe_lora, triton)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.configure(self.kernel_config, self.forced_triton)  # the kernels depend on the device (module.to ends here)
        return self

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        dt, dev = self.quant.act_dtype if self.quant else self.gate_up_proj.dtype, self.gate_up_proj.device
        self.gate_up_lora = LoRAWeights(self.hidden, [self.inter, self.inter], max_loras, max_lora_rank, self.num_experts, dt, dev)
        self.down_lora = LoRAWeights(self.inter, [self.hidden], max_loras, max_lora_rank, self.num_experts, dt, dev)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        args = None
        if lora_active(self.gate_up_lora, lora) or lora_active(self.down_lora, lora):
            gu, d = self.gate_up_lora, self.down_lora
            args = ExpertLoRAArgs(
                token_slots=lora.token_slots,
                gate_up_a=gu.a, gate_up_b=gu.b_cat, gate_up_scaling=gu.scaling, gate_up_ranks=gu.rank_tensor,
                down_a=d.a, down_b=d.b_cat, down_scaling=d.scaling, down_ranks=d.rank_tensor,
                gate_up_offsets=gu.slice_offsets, down_offsets=d.slice_offsets,
                gate_up_a_src=gu.a_src,  # a shared A (gate's and up's equal) read from one copy
                active_slots=lora.groups.active_slots,
            )
        if self.quant is not None:  # it builds its stacks' GEMM objects, then calls run
            return self.quant.experts(self, x, topk_weights, topk_ids, args)
        return self.run(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, args)

    def run(self, x: torch.Tensor, w_gate_up, w_down, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            args: ExpertLoRAArgs | None) -> torch.Tensor:
        """The experts on these stacks ([E, 2I, H] / [E, H, I] tensors or quantized stacks) with this layer's
        kernels: fused_moe_pairs (its LoRA deltas on the side stream when overlapping), or fused_moe_ref for plain
        tensors off the Triton path."""
        if not self.kernels.triton and isinstance(w_gate_up, torch.Tensor):
            return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, self.act, args)
        side = side_stream(x.device) if self.overlap and args is not None and x.is_cuda else None
        return fused_moe_pairs(x, w_gate_up, w_down, topk_weights, topk_ids, self.act, args, self.kernels, side)


class MoEBlock(nn.Module):
    """Router (`gate`, [E, H]) + routed experts + optional shared expert with a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, dtype, device)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, dtype, device)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = LoRALinear(cfg.hidden_size, [1], False, dtype, device)
        self.configure(KernelConfig())

    def configure(self, cfg: KernelConfig, triton: bool | None = None) -> None:
        """The router's kernels and the combine's place from cfg, chosen once: on the Triton path (the gate on a CUDA
        device with Triton; triton forces it, True on the CPU runs the kernels under TRITON_INTERPRET=1: tests) the
        router in one launch up to FUSED_ROUTER_MAX_T tokens (moe.fused_router; else F.linear + route_topk) and, in
        blocks without a shared expert, the combine computed by the next RMSNorm (moe.combine_to_norm); off it,
        F.linear + route_topk_ref."""
        self.kernel_config, self.forced_triton = cfg, triton
        if triton is None:
            triton = HAS_TRITON and self.gate.is_cuda
        self.fused_router = triton and cfg.moe.fused_router
        self.route = route_topk if triton and self.gate.shape[0] <= ROUTE_TOPK_MAX_E else route_topk_ref
        self.combine_to_norm = triton and cfg.moe.combine_to_norm
        if self.fused_router and self.gate.is_cuda and not torch.cuda.is_current_stream_capturing():
            make_counters(self.gate.device)  # before any graph capture (bench --ab reconfigures, then recaptures)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.configure(self.kernel_config, self.forced_triton)  # the router's kernels depend on the device
        return self

    def _shared(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        shared = self.shared_expert(x, lora)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x, lora)) * shared
        return shared

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        if self.fused_router and router_topk_ok(x, self.gate):  # the gate GEMM, softmax and top-k in one launch
            topk_weights, topk_ids, logits = router_topk(x, self.gate, self.top_k, self.renormalize, x.dtype)
        else:
            logits = F.linear(x, self.gate)  # [T, E]
            topk_weights, topk_ids = self.route(logits, self.top_k, self.renormalize, x.dtype)  # [T, K], x's dtype
        self.last_topk_ids = topk_ids  # a reference, for statistics (experts touched per step)
        self.last_router_logits = logits  # a reference, for tests (is a routing difference a near-tie?)
        if self.shared_expert is None:
            # the combine left to the next RMSNorm (DecoderLayer hands it this output), on the Triton path only, and
            # not under the all-reduce hooks of tensor / expert parallelism
            defer = (self.combine_to_norm and not self._forward_hooks and not self.experts._forward_hooks
                     and not self.experts._forward_pre_hooks)
            with defer_moe_combine(defer):
                return self.experts(x, topk_weights, topk_ids, lora)
        if not (self.experts.overlap and x.is_cuda):
            return self.experts(x, topk_weights, topk_ids, lora) + self._shared(x, lora)
        # the shared expert on the side stream while the routed experts run; the add after the join
        side = side_stream(x.device)
        main = fork(side)
        with torch.cuda.stream(side):
            shared = self._shared(x, lora)
        out = self.experts(x, topk_weights, topk_ids, lora)
        join(main, side)
        shared.record_stream(main)  # allocated on the side stream, read and freed on main
        return out + shared
