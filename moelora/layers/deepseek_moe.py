"""DeepSeek-V2/V3 MoE feed-forward: a grouped top-k router (with V3's score-correction bias), the routed
experts of moe.py (+LoRA, every layout) and ungated shared experts (a dense MLP, + LoRA), summed.

On a GPU the shared experts run on a side stream while the main stream runs the routed experts (`overlap`,
default on with CUDA). The join is capture-safe: the side stream waits on the main stream before it starts,
writes into an output buffer allocated on the main stream before the fork, and the main stream waits on the
side stream before the add (both waits are events that a CUDA graph records). With overlap off: serial.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.config import ModelConfig
from moelora.kernels.moe.routing import grouped_topk_ref
from moelora.layers.moe import DenseMLP, RoutedExperts


class DeepseekRouter(nn.Module):
    """weight: [E, H] · e_score_correction_bias: [E] fp32 (noaux_tc only). Logits are computed in fp32, as
    transformers does."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        r = cfg.routing
        self.top_k, self.renormalize, self.routing = cfg.num_experts_per_tok, cfg.norm_topk_prob, r
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = None
        if r.topk_method == "noaux_tc":
            bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> topk_weights [T, K] fp32, topk_ids [T, K]."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        r = self.routing
        return grouped_topk_ref(logits, self.top_k, r.scoring_func, r.topk_method, r.n_group, r.topk_group,
                                self.renormalize, r.routed_scaling_factor, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """gate (router) + experts (routed, [E, 2I, H] / [E, H, I]) + shared_experts (dense, width I * n_shared)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate = DeepseekRouter(cfg, dtype, device)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, dtype, device)
        self.shared_experts = None
        self.overlap = torch.cuda.is_available()  # shared experts on a side stream (wired to --lora-overlap)
        self._side_stream: torch.cuda.Stream | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, K] fp32: the experts weight their fp32 outputs with it
        self.last_topk_ids = topk_ids  # a reference, for statistics (experts touched per step)
        if self.shared_experts is None:
            return self.experts(x, topk_weights, topk_ids, lora)
        if self.overlap and x.is_cuda:
            return self._overlapped(x, topk_weights, topk_ids, lora)
        return self.experts(x, topk_weights, topk_ids, lora) + self.shared_experts(x, lora)

    def _overlapped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    lora: LoRABatch | None) -> torch.Tensor:
        """routed(x) on the current stream, shared(x) on the side stream, joined before the add."""
        main = torch.cuda.current_stream(x.device)
        if self._side_stream is None or self._side_stream.device != x.device:
            self._side_stream = torch.cuda.Stream(x.device)
        side = self._side_stream
        shared = torch.empty_like(x)  # [T, H], allocated on the main stream before the fork
        side.wait_stream(main)  # fork: x, the router's output and the LoRA metadata are ready
        with torch.cuda.stream(side):
            shared.copy_(self.shared_experts(x, lora))  # its temporaries live and die on the side stream
        routed = self.experts(x, topk_weights, topk_ids, lora)
        main.wait_stream(side)  # join before the add
        return routed + shared
