"""DeepSeek-V2/V3 MoE feed-forward: a grouped top-k router (with V3's score-correction bias), the routed
experts of moe.py (+LoRA, every layout) and ungated shared experts (a dense MLP, + LoRA), summed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.adapters.metadata import LoRABatch
from moelora.config import ModelConfig
from moelora.kernels.routing import grouped_topk_ref
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
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32, device=device), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> topk_weights [T, K] fp32, topk_ids [T, K]."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        r = self.routing
        return grouped_topk_ref(
            logits, self.top_k, r.scoring_func, r.topk_method, r.n_group, r.topk_group, self.renormalize,
            r.routed_scaling_factor, self.e_score_correction_bias,
        )


class DeepseekMoE(nn.Module):
    """gate (router) + experts (routed, [E, 2I, H] / [E, H, I]) + shared_experts (dense, width I * n_shared)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate = DeepseekRouter(cfg, dtype, device)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, dtype, device)
        self.shared_experts = None
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, K] fp32: the experts weight their fp32 outputs with it
        out = self.experts(x, topk_weights, topk_ids, lora)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, lora)
        return out
