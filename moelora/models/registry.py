"""Model registry: architecture name -> model class."""

from __future__ import annotations

from torch import nn

from moelora.config import ConfigError, ModelConfig
from moelora.models.moe_causal_lm import MoECausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3MoeForCausalLM": MoECausalLM,
    "Qwen2MoeForCausalLM": MoECausalLM,
    "MixtralForCausalLM": MoECausalLM,
    "OlmoeForCausalLM": MoECausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ConfigError(
            f"no model registered for {cfg.architecture!r}; registered: {', '.join(MODEL_REGISTRY)}"
        ) from None
