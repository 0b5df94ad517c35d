"""Model registry: architecture name -> model class; and the per-layer KV-cache shapes a model declares."""

from __future__ import annotations

from torch import nn

from moelora.config import ConfigError, ModelConfig
from moelora.models.deepseek_v2 import DeepseekForCausalLM
from moelora.models.moe_causal_lm import MoECausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3MoeForCausalLM": MoECausalLM,
    "Qwen2MoeForCausalLM": MoECausalLM,
    "MixtralForCausalLM": MoECausalLM,
    "OlmoeForCausalLM": MoECausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ConfigError(f"no model registered for {cfg.architecture!r}; registered: "
                          f"{', '.join(MODEL_REGISTRY)}") from None


def kv_cache_shapes(cfg: ModelConfig, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], ...]]:
    """Per layer, the shapes of the cache tensors its attention reads (all of them paged: [num_blocks,
    block_size, ...]). A model class declares them with a `kv_cache_shapes(cfg, num_blocks, block_size)`
    classmethod (MLA: one latent cache per layer); without one, a layer holds k and v of
    [num_blocks, block_size, num_key_value_heads, head_dim]."""
    declared = getattr(model_class(cfg), "kv_cache_shapes", None)
    if declared is not None:
        return declared(cfg, num_blocks, block_size)
    kv = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(kv, kv)] * cfg.num_hidden_layers
