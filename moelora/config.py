"""Model configuration: a Hugging Face ``config.json`` read into one frozen dataclass.

The per-family differences that the forward pass needs (q/k norm placement,
shared experts, dense layers, routing normalization, sliding windows, biases)
become plain fields here, so the model code has no family switches of its own.
DeepSeek-V2/V3 add two frozen sub-configs: `mla` (multi-head latent attention) and
`routing` (scoring function, grouped top-k, routed scaling), each set the way
transformers' modeling code reads the config, which is what the outputs must equal.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

# config.json model_type -> architecture (the model_type is read for configs that name no architectures, as
# config.save_pretrained writes them); the values are the architectures moelora serves
_MODEL_TYPES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# rope types whose inverse frequencies depend on the sequence length at run time
_DYNAMIC_ROPE = ("dynamic", "longrope")


class ConfigError(ValueError):
    """A model configuration moelora cannot serve; the message says why and what to do."""


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3).

    q: q_proj (q_lora_rank None) or q_a_proj -> q_a_layernorm -> q_b_proj, [H, qk_nope_head_dim + qk_rope_head_dim];
    kv_a_proj_with_mqa -> [kv_lora_rank latent | qk_rope_head_dim key shared by all heads]; the latent goes through
    kv_a_layernorm and is what the cache holds (with the rotated key); kv_b_proj maps it to [H, qk_nope + v_head_dim].
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim**-0.5, times YaRN's mscale(factor, mscale_all_dim)**2 when that is set
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek weights) rather than the two halves
    rope_fp32: bool  # rotate in fp32 and cast back (V2's complex form) rather than in the input dtype (V3)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RoutingConfig:
    """Router of DeepSeek-style MoE layers (the other families route by softmax + top-k, see norm_topk_prob).

    scoring_func: "softmax" | "sigmoid" · topk_method: "greedy" | "group_limited_greedy" (groups ranked by their
    best expert) | "noaux_tc" (groups ranked by the sum of their two best biased scores; experts picked by
    score + e_score_correction_bias, weighted by the unbiased score) · the experts form n_group equal groups, of
    which topk_group are searched · weights are multiplied by routed_scaling_factor (after normalization)."""

    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float


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
    mla: MLAConfig | None = None  # DeepSeek: multi-head latent attention (head_dim is then qk_head_dim)
    routing: RoutingConfig | None = None  # DeepSeek: grouped top-k router; None = softmax + top-k

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
            raise ConfigError(f"architectures {archs} (model_type {raw.get('model_type')!r}) not supported; "
                              f"moelora serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no model_type")
        kwargs = {k: v for k, v in raw.items() if k != "model_type"}
        return cls.from_hf(AutoConfig.for_model(model_type, **kwargs), arch)

    @classmethod
    def from_hf(cls, hf: Any, architecture: str | None = None) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig`` (Qwen3Moe/Qwen2Moe/Mixtral/Olmoe/DeepseekV2/DeepseekV3)."""
        arch = architecture or (getattr(hf, "architectures", None) or [None])[0]
        if arch is None:
            arch = _MODEL_TYPES.get(hf.model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} not supported; use one of {SUPPORTED_ARCHITECTURES}")
        if arch in _DEEPSEEK:
            return _deepseek_from_hf(cls, hf, arch)
        n_layers, n_heads = hf.num_hidden_layers, hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        rope_type, rope_theta, _ = _rope(hf)

        mixtral, qwen2 = arch == "MixtralForCausalLM", arch == "Qwen2MoeForCausalLM"
        num_experts = hf.num_local_experts if mixtral else hf.num_experts
        if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            mlp_only = set(getattr(hf, "mlp_only_layers", None) or [])
            step = getattr(hf, "decoder_sparse_step", 1) or 1
            moe_layers = tuple((i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
        else:
            moe_layers = (True,) * n_layers
        moe_inter = hf.intermediate_size if mixtral or arch == "OlmoeForCausalLM" else hf.moe_intermediate_size

        sw = getattr(hf, "sliding_window", None) or None
        if qwen2:
            layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n_layers
            windows = tuple(sw if t == "sliding_attention" else None for t in layer_types)
        elif arch == "OlmoeForCausalLM":  # OLMoE has no sliding window: transformers masks causally whatever the config says
            windows = (None,) * n_layers
        else:
            windows = (sw,) * n_layers

        bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias, o_bias = (bool(getattr(hf, "qkv_bias", True)), False) if qwen2 else (bias, bias)
        return cls(
            **_common_fields(hf, arch), num_attention_heads=n_heads, qkv_bias=qkv_bias, o_bias=o_bias,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or n_heads, head_dim=head_dim,
            qk_norm={"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(arch, "none"),
            clip_qkv=getattr(hf, "clip_qkv", None), sliding_windows=windows, rope_type=rope_type, rope_theta=rope_theta,
            num_experts=num_experts, num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=moe_inter,
            norm_topk_prob=True if mixtral else bool(getattr(hf, "norm_topk_prob", False)), moe_layers=moe_layers,
            intermediate_size=hf.intermediate_size, shared_expert_gate=qwen2,
            shared_expert_intermediate_size=hf.shared_expert_intermediate_size if qwen2 else 0,
        )


def _rope(hf: Any) -> tuple[str, float, dict[str, Any]]:
    """(rope_type, rope_theta, rope_parameters); rope types that change with the sequence length are refused."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in _DYNAMIC_ROPE:
        raise ConfigError(f"rope_type {rope_type!r} changes with the sequence length and is not supported")
    return rope_type, float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))), rope


def _common_fields(hf: Any, arch: str) -> dict[str, Any]:
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    dtype = str(getattr(hf, "dtype", None) or "float32").replace("torch.", "")
    return dict(architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, hidden_act=hf.hidden_act,
                num_hidden_layers=hf.num_hidden_layers, rms_norm_eps=float(hf.rms_norm_eps), hf_config=hf,
                max_position_embeddings=hf.max_position_embeddings, torch_dtype=dtype, eos_token_ids=eos_ids,
                tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))


def _deepseek_from_hf(cls: type[ModelConfig], hf: Any, arch: str) -> ModelConfig:
    """DeepSeek-V2/V3 as transformers' modeling_deepseek_v2/v3 read the config: V2 scores by softmax and routes
    greedy or group-limited (it never renormalizes the top-k weights, whatever norm_topk_prob says); V3 scores by
    sigmoid and always routes noaux_tc-style with e_score_correction_bias (its config's scoring_func/topk_method
    are not read). The first first_k_dense_replace layers are dense."""
    v3 = arch == "DeepseekV3ForCausalLM"
    n_layers, n_heads = hf.num_hidden_layers, hf.num_attention_heads
    n_kv = getattr(hf, "num_key_value_heads", None) or n_heads
    if n_kv != n_heads:
        raise ConfigError(f"num_key_value_heads={n_kv} differs from num_attention_heads={n_heads}: MLA expands the "
                          "latent to one key and value per query head (transformers cannot run this config either)")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError("mlp_bias=true is not supported for DeepSeek models (no released checkpoint uses it)")
    rope_type, rope_theta, rope = _rope(hf)
    nope, rope_dim, v_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
    scale = (nope + rope_dim) ** -0.5
    if rope_type != "default" and rope.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    mla = MLAConfig(q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=nope,
                    qk_rope_head_dim=rope_dim, v_head_dim=v_dim, softmax_scale=scale, rope_fp32=not v3,
                    rope_interleave=bool(getattr(hf, "rope_interleave", True)) if v3 else True)
    num_experts, top_k = hf.n_routed_experts, hf.num_experts_per_tok
    if v3:
        scoring, method = "sigmoid", "noaux_tc"
    else:
        scoring, method = "softmax", hf.topk_method or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {method!r}: DeepseekV2ForCausalLM routes 'greedy' or "
                              "'group_limited_greedy' (noaux_tc belongs to DeepseekV3ForCausalLM)")
    grouped = method != "greedy"  # greedy ignores n_group / topk_group
    n_group = (hf.n_group or 1) if grouped else 1
    topk_group = (hf.topk_group or n_group) if grouped else 1
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"n_group={n_group}, topk_group={topk_group} for {num_experts} experts: the experts must "
                          "split into n_group equal groups and 1 <= topk_group <= n_group")
    per_group = num_experts // n_group
    if top_k > topk_group * per_group or (method == "noaux_tc" and per_group < 2):
        why = " (noaux_tc ranks groups by their two best experts)" if method == "noaux_tc" else ""
        raise ConfigError(f"num_experts_per_tok={top_k} cannot be picked from {topk_group} groups of {per_group} "
                          f"experts{why}")
    routing = RoutingConfig(scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=float(hf.routed_scaling_factor))
    first_dense = hf.first_k_dense_replace or 0
    bias = bool(getattr(hf, "attention_bias", False))
    return cls(
        **_common_fields(hf, arch), num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=nope + rope_dim,
        qkv_bias=bias, o_bias=bias, qk_norm="none", clip_qkv=None, sliding_windows=(None,) * n_layers,
        rope_type=rope_type, rope_theta=rope_theta, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob) if v3 else False,
        moe_layers=tuple(i >= first_dense for i in range(n_layers)), intermediate_size=hf.intermediate_size,
        shared_expert_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
        shared_expert_gate=False, mla=mla, routing=routing,
    )
