"""Decoder-only MoE causal LM covering Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE.

The family differences are fields of ModelConfig (q/k norms, shared expert, dense layers,
routing normalization, biases, windows), so one module tree serves all four. Parameter
names follow transformers' where they exist; q/k/v and gate/up are fused (`qkv_proj`,
`gate_up_proj`) and filled slice by slice by the weight loader.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.config import ModelConfig
from moelora.layers.attention import Attention, AttentionMetadata
from moelora.layers.linear import LoRALinear, take_lora_delta
from moelora.layers.lora import LoRATarget
from moelora.layers.moe import DenseMLP, MoEBlock
from moelora.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device: torch.device | str,
                 attention_cls: type[nn.Module] = Attention, moe_cls: type[nn.Module] = MoEBlock) -> None:
        super().__init__()
        self.self_attn = attention_cls(cfg, idx, dtype, device)
        self.is_moe = cfg.moe_layers[idx]
        self.mlp: nn.Module = (moe_cls(cfg, dtype, device) if self.is_moe
                               else DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, device))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if hasattr(self.self_attn, "o_proj_delta_to_norm"):  # forward hands the norm o_proj's deferred delta
            self.self_attn.o_proj_delta_to_norm = True

    def forward(self, x, residual, positions, attn, kv_cache, lora):
        """x: this layer's input delta [T, H] (the embeddings for layer 0, with residual None) · residual: the
        running hidden state before x is added. Returns (mlp output, residual): the hidden state after this
        layer is their sum, added (fused into a norm) by the next layer or the final norm."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        a = self.self_attn(h, positions, attn, kv_cache, lora)
        h, residual = self.post_attention_layernorm.add_norm(a, residual, delta=take_lora_delta(a))
        return self.mlp(h, lora), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 attention_cls: type[nn.Module] = Attention, moe_cls: type[nn.Module] = MoEBlock) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, attention_cls, moe_cls)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class MoECausalLM(nn.Module):
    """forward(flat batch) -> hidden [T, H]; compute_logits(hidden) -> [T, V]."""

    supports_cuda_graphs = True  # on a GPU in bf16/fp16 its decode step reads no host data
    supports_prefill_graphs = True  # nor its prefill / mixed step (the attention's prefill kernel reads device metadata)
    attention_cls: type[nn.Module] = Attention  # a family with other attention or MoE blocks subclasses and swaps these
    moe_cls: type[nn.Module] = MoEBlock

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.model = Backbone(cfg, dtype, device, self.attention_cls, self.moe_cls)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.max_loras, self.max_lora_rank = 0, 0  # enable_lora sets them

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoRABatch | None = None) -> torch.Tensor:
        """input_ids, positions: [T] · kv_caches: per layer (k_cache, v_cache) · returns hidden [T, H]."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, positions, attn, cache, lora)
        return self.model.norm.add_norm(x, residual)[0]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()  # [T, V]

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Allocate slot buffers in every LoRA-capable weight."""
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        for module in self.modules():
            if isinstance(module, LoRALinear) or hasattr(module, "down_lora"):
                module.enable_lora(max_loras, max_lora_rank)

    def set_overlap(self, enabled: bool) -> None:
        """GPU two-stream overlap on or off in every module that has one (the routed experts' LoRA chains,
        shared experts): `--lora-overlap on|off`."""
        for module in self.modules():
            if hasattr(module, "overlap"):
                module.overlap = bool(enabled)

    def lora_overlap_state(self) -> bool:
        """Whether any module has the side-stream overlap on."""
        return any(getattr(m, "overlap", False) for m in self.modules())

    def lora_targets(self) -> dict[str, LoRATarget]:
        """Every adapter-addressable weight, by the module name PEFT uses for it."""
        if not self.max_loras:
            raise RuntimeError("enable_lora() first")
        out: dict[str, LoRATarget] = {}

        def add(name: str, weights, slice_idx: int, experts: int | None = None) -> None:
            in_f, out_f, num_experts = weights.full_dims(slice_idx)  # the unsharded shapes under tensor/expert parallelism
            out[name] = LoRATarget(name, weights, slice_idx, in_f, out_f, None if experts is None else num_experts)

        def add_linear(prefix: str, lin: LoRALinear, names: list[str]) -> None:
            for i, n in enumerate(names):
                add(f"{prefix}.{n}", lin.lora, i)

        def add_mlp(prefix: str, mlp: DenseMLP) -> None:
            add_linear(prefix, mlp.gate_up_proj, ["gate_proj", "up_proj"])
            add_linear(prefix, mlp.down_proj, ["down_proj"])

        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            self._attention_lora_targets(f"{p}.self_attn", layer.self_attn, add_linear)
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):
                add_mlp(f"{p}.mlp", mlp)
                continue
            ex = mlp.experts
            add(f"{p}.mlp.experts.gate_proj", ex.gate_up_lora, 0, ex.num_experts)
            add(f"{p}.mlp.experts.up_proj", ex.gate_up_lora, 1, ex.num_experts)
            add(f"{p}.mlp.experts.down_proj", ex.down_lora, 0, ex.num_experts)
            for name in ("shared_expert", "shared_experts"):  # Qwen2-MoE / DeepSeek names
                if getattr(mlp, name, None) is not None:
                    add_mlp(f"{p}.mlp.{name}", getattr(mlp, name))
            if getattr(mlp, "shared_expert_gate", None) is not None:
                add(f"{p}.mlp.shared_expert_gate", mlp.shared_expert_gate.lora, 0)
        return out

    def _attention_lora_targets(self, prefix: str, attn: nn.Module, add_linear) -> None:
        add_linear(prefix, attn.qkv_proj, ["q_proj", "k_proj", "v_proj"])
        add_linear(prefix, attn.o_proj, ["o_proj"])
