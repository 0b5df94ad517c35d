"""DeepSeek-V2 / DeepSeek-V3 causal LM: multi-head latent attention, dense first layers, MoE layers with
shared experts and a grouped router. The V2/V3 differences (router scoring and grouping, rope layout, the
YaRN softmax scale) are fields of ModelConfig.mla / .routing, so one module tree serves both.

Parameter names follow transformers' (q_a_proj and kv_a_proj_with_mqa are fused into `fused_qkv_a_proj` when
the model has q_lora_rank; gate/up into `gate_up_proj`), so checkpoints and PEFT adapters address them as
transformers does. The KV cache holds one tensor per layer: [blocks, block_size, kv_lora_rank + qk_rope_head_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.layers.deepseek_moe import DeepseekMoE
from moelora.layers.mla import MLAttention
from moelora.models.moe_causal_lm import MoECausalLM


class DeepseekForCausalLM(MoECausalLM):
    """The generic MoE causal LM with MLA attention and the DeepSeek MoE block (grouped router, shared experts).
    Its decode step reads no host data on a GPU (Triton absorbed decode, unmasked latent writes), so CUDA graphs
    capture it like the GQA families."""

    attention_cls = MLAttention
    moe_cls = DeepseekMoE
    supports_prefill_graphs = False  # MLA's prefill reads host lists (the expanded form's sequences)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if cfg.mla is None or cfg.routing is None:
            raise ValueError(f"{cfg.architecture} is not a DeepSeek-style config (no mla / routing fields)")
        super().__init__(cfg, dtype, device)

    @classmethod
    def kv_cache_shapes(cls, cfg: ModelConfig, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer, the shapes of its cache tensors: one latent cache [NB, BS, kv_lora_rank + qk_rope_head_dim]."""
        m = cfg.mla
        return [((num_blocks, block_size, m.kv_lora_rank + m.qk_rope_head_dim),)] * cfg.num_hidden_layers

    def _attention_lora_targets(self, prefix: str, attn: nn.Module, add_linear) -> None:
        if attn.q_lora_rank is None:
            add_linear(prefix, attn.q_proj, ["q_proj"])
            add_linear(prefix, attn.kv_a_proj_with_mqa, ["kv_a_proj_with_mqa"])
        else:
            add_linear(prefix, attn.fused_qkv_a_proj, ["q_a_proj", "kv_a_proj_with_mqa"])
            add_linear(prefix, attn.q_b_proj, ["q_b_proj"])
        add_linear(prefix, attn.kv_b_proj, ["kv_b_proj"])
        add_linear(prefix, attn.o_proj, ["o_proj"])
