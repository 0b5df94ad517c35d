"""Model configuration: a Hugging Face ``config.json`` read into one frozen dataclass.

The per-family differences that the forward pass needs (q/k norm placement,
shared experts, dense layers, routing normalization, sliding windows, biases)
become plain fields here, so the model code has no family switches of its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)
# config.json model_type -> architecture, for configs that name no architectures (config.save_pretrained)
_MODEL_TYPES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# rope types whose inverse frequencies depend on the sequence length at run time
_DYNAMIC_ROPE = ("dynamic", "longrope")


class ConfigError(ValueError):
    """A model configuration moelora cannot serve; the message says why and what to do."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # "none" | "head" (per head, Qwen3) | "full" (whole projection, OLMoE)
    clip_qkv: float | None
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_type: str
    rope_theta: float
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP (False)
    intermediate_size: int  # dense MLP width (layers where moe_layers[i] is False)
    shared_expert_intermediate_size: int  # 0 = no shared expert
    shared_expert_gate: bool  # sigmoid gate on the shared expert output (Qwen2-MoE)
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    # the transformers config object, kept for rope initialisation (not compared, not hashed)
    hf_config: Any = field(default=None, compare=False, repr=False, hash=False)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``path/config.json`` (a model folder) or ``path`` itself (a json file)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"no config.json at {path!r}: pass a model folder that holds config.json")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{file}: cannot read config.json ({e})") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        from transformers import AutoConfig

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPES.get(raw.get("model_type"))
        if arch is None:
            raise ConfigError(
                f"architectures {archs} (model_type {raw.get('model_type')!r}) not supported; "
                f"moelora serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no model_type")
        kwargs = {k: v for k, v in raw.items() if k != "model_type"}
        hf = AutoConfig.for_model(model_type, **kwargs)
        return cls.from_hf(hf, arch)

    @classmethod
    def from_hf(cls, hf: Any, architecture: str | None = None) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig`` (Qwen3Moe/Qwen2Moe/Mixtral/Olmoe)."""
        arch = architecture or (getattr(hf, "architectures", None) or [None])[0]
        if arch is None:
            arch = _MODEL_TYPES.get(hf.model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} not supported; use one of {SUPPORTED_ARCHITECTURES}")
        n_layers = hf.num_hidden_layers
        n_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in _DYNAMIC_ROPE:
            raise ConfigError(f"rope_type {rope_type!r} changes with the sequence length and is not supported")
        rope_theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))

        mixtral = arch == "MixtralForCausalLM"
        num_experts = hf.num_local_experts if mixtral else hf.num_experts
        if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            mlp_only = set(getattr(hf, "mlp_only_layers", None) or [])
            step = getattr(hf, "decoder_sparse_step", 1) or 1
            moe_layers = tuple(
                (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
            )
        else:
            moe_layers = (True,) * n_layers
        moe_inter = hf.intermediate_size if mixtral or arch == "OlmoeForCausalLM" else hf.moe_intermediate_size

        if arch == "Qwen2MoeForCausalLM":
            layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n_layers
            sw = getattr(hf, "sliding_window", None) or None
            windows = tuple(sw if t == "sliding_attention" else None for t in layer_types)
        elif arch == "OlmoeForCausalLM":  # OLMoE has no sliding window: transformers masks causally whatever the config says
            windows = (None,) * n_layers
        else:
            sw = getattr(hf, "sliding_window", None) or None
            windows = (sw,) * n_layers

        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = getattr(hf, "dtype", None) or "float32"
        dtype = str(dtype).replace("torch.", "")
        if arch == "Qwen2MoeForCausalLM":
            qkv_bias, o_bias = bool(getattr(hf, "qkv_bias", True)), False
        else:
            bias = bool(getattr(hf, "attention_bias", False))
            qkv_bias, o_bias = bias, bias
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            hidden_act=hf.hidden_act,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm={"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(arch, "none"),
            clip_qkv=getattr(hf, "clip_qkv", None),
            sliding_windows=windows,
            rope_type=rope_type,
            rope_theta=rope_theta,
            num_experts=num_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=moe_inter,
            norm_topk_prob=True if mixtral else bool(getattr(hf, "norm_topk_prob", False)),
            moe_layers=moe_layers,
            intermediate_size=hf.intermediate_size,
            shared_expert_intermediate_size=(
                hf.shared_expert_intermediate_size if arch == "Qwen2MoeForCausalLM" else 0
            ),
            shared_expert_gate=arch == "Qwen2MoeForCausalLM",
            torch_dtype=dtype,
            eos_token_ids=eos_ids,
            hf_config=hf,
        )
