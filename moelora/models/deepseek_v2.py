"""DeepSeek-V2 / DeepSeek-V3 causal LM: multi-head latent attention, dense first layers, MoE layers with
shared experts and a grouped router. The V2/V3 differences (router scoring and grouping, rope layout, the
YaRN softmax scale) are fields of ModelConfig.mla / .routing, so one module tree serves both.

Parameter names follow transformers' (q_a_proj and kv_a_proj_with_mqa are fused into `fused_qkv_a_proj` when
the model has q_lora_rank; gate/up into `gate_up_proj`), so checkpoints and PEFT adapters address them as
transformers does. The KV cache holds one tensor per layer: [blocks, block_size, kv_lora_rank + qk_rope_head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.adapters.metadata import LoRABatch
from moelora.config import ModelConfig
from moelora.layers.attention import AttentionMetadata
from moelora.layers.deepseek_moe import DeepseekMoE
from moelora.layers.linear import LoRALinear
from moelora.layers.lora import LoRATarget
from moelora.layers.mla import MLAttention
from moelora.layers.moe import DenseMLP, RoutedExperts
from moelora.layers.norm import RMSNorm


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, idx, dtype, device)
        self.mlp: nn.Module = (
            DeepseekMoE(cfg, dtype, device)
            if cfg.moe_layers[idx]
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, device)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, positions, attn, kv_cache, lora):
        x = x + self.self_attn(self.input_layernorm(x), positions, attn, kv_cache, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekForCausalLM(nn.Module):
    """forward(flat batch) -> hidden [T, H]; compute_logits(hidden) -> [T, V]; the same interface as MoECausalLM."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if cfg.mla is None or cfg.routing is None:
            raise ValueError(f"{cfg.architecture} is not a DeepSeek-style config (no mla / routing fields)")
        self.config = cfg
        self.dtype = dtype
        self.model = DeepseekModel(cfg, dtype, device)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.max_loras = 0
        self.max_lora_rank = 0

    @classmethod
    def kv_cache_shapes(cls, cfg: ModelConfig, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer, the shapes of its cache tensors: one latent cache [NB, BS, kv_lora_rank + qk_rope_head_dim]."""
        m = cfg.mla
        return [((num_blocks, block_size, m.kv_lora_rank + m.qk_rope_head_dim),)] * cfg.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor]],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] · kv_caches: per layer (latent_cache,) · returns hidden [T, H]."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        for layer, cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, attn, cache, lora)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()  # [T, V]

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Allocate slot buffers in every LoRA-capable weight."""
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        for module in self.modules():
            if isinstance(module, (LoRALinear, RoutedExperts)):
                module.enable_lora(max_loras, max_lora_rank)

    def lora_targets(self) -> dict[str, LoRATarget]:
        """Every adapter-addressable weight, by the module name PEFT uses for it."""
        if not self.max_loras:
            raise RuntimeError("enable_lora() first")
        out: dict[str, LoRATarget] = {}

        def add(name: str, weights, slice_idx: int, experts: int | None = None) -> None:
            out[name] = LoRATarget(name, weights, slice_idx, weights.in_features, weights.out_features[slice_idx], experts)

        def add_linear(prefix: str, lin: LoRALinear, names: list[str]) -> None:
            for i, n in enumerate(names):
                add(f"{prefix}.{n}", lin.lora, i)

        def add_mlp(prefix: str, mlp: DenseMLP) -> None:
            add_linear(prefix, mlp.gate_up_proj, ["gate_proj", "up_proj"])
            add_linear(prefix, mlp.down_proj, ["down_proj"])

        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            attn = layer.self_attn
            if attn.q_lora_rank is None:
                add_linear(f"{p}.self_attn", attn.q_proj, ["q_proj"])
                add_linear(f"{p}.self_attn", attn.kv_a_proj_with_mqa, ["kv_a_proj_with_mqa"])
            else:
                add_linear(f"{p}.self_attn", attn.fused_qkv_a_proj, ["q_a_proj", "kv_a_proj_with_mqa"])
                add_linear(f"{p}.self_attn", attn.q_b_proj, ["q_b_proj"])
            add_linear(f"{p}.self_attn", attn.kv_b_proj, ["kv_b_proj"])
            add_linear(f"{p}.self_attn", attn.o_proj, ["o_proj"])
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):
                add_mlp(f"{p}.mlp", mlp)
                continue
            ex = mlp.experts
            add(f"{p}.mlp.experts.gate_proj", ex.gate_up_lora, 0, ex.num_experts)
            add(f"{p}.mlp.experts.up_proj", ex.gate_up_lora, 1, ex.num_experts)
            add(f"{p}.mlp.experts.down_proj", ex.down_lora, 0, ex.num_experts)
            if mlp.shared_experts is not None:
                add_mlp(f"{p}.mlp.shared_experts", mlp.shared_experts)
        return out
