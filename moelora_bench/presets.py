"""Model presets for `moelora bench decode` (config.json dicts, dummy weights) beyond Qwen3-30B-A3B, and the
byte floor counted from the model's own tensors (used for MLA models, whose attention and cache differ from GQA).
"""

from __future__ import annotations

import math

import torch

from moelora.layers.lora import LoRAWeights

# deepseek-ai/DeepSeek-V2-Lite's config.json (the fields moelora reads)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V2_LITE_TINY = {
    **DEEPSEEK_V2_LITE, "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "bos_token_id": 1, "eos_token_id": 2,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _lora_bytes(w: LoRAWeights, slots: list[int]) -> int:
    """A and B of every slice, at each slot's true rank (the kernels mask the padding)."""
    el = w.a.element_size()
    return sum(w.ranks[i][s] * (w.in_features + w.out_features[i]) * el for i in range(w.num_slices) for s in slots)


def floor_bytes_from_tensors(engine, reqs, ctx_len: int) -> tuple[int, list[int]]:
    """Bytes one decode step of `reqs` must read, from the model's tensors: every layer weight except the routed
    experts; the routed experts some row routes to (last step's routing); LoRA factors of the batch's slots at
    their true ranks (routed experts: only the (slot, expert) pairs some row of that slot routes to); the
    lm_head; each sequence's cache rows (ctx_len tokens per layer, the cache's row width: for MLA the latent and
    the rope key). Returns (bytes, experts touched per MoE layer)."""
    m = engine.model
    n = len(reqs)
    # the adapter's slot, not r.slot: a finished request has already given its slot reference back (-1)
    slots = [-1 if r.adapter is None or engine.pool.slot_of(r.adapter) is None else engine.pool.slot_of(r.adapter)
             for r in reqs]
    batch_slots = sorted({s for s in slots if s >= 0})
    total, touched = 0, []
    for layer, cache in zip(m.model.layers, engine.kv.caches):
        experts = getattr(layer.mlp, "experts", None)
        for name, p in layer.named_parameters():
            if experts is None or not name.startswith("mlp.experts."):
                total += _nbytes(p)
        for mod in layer.modules():
            if isinstance(mod, LoRAWeights) and mod.num_experts is None:
                total += _lora_bytes(mod, batch_slots)
        total += n * ctx_len * sum(math.prod(c.shape[2:]) * c.element_size() for c in cache)
        ids = getattr(layer.mlp, "last_topk_ids", None)
        if experts is None or ids is None:
            continue
        ids = ids[:n].cpu()
        used = ids.unique()
        touched.append(int(used.numel()))
        total += used.numel() * (_nbytes(experts.gate_up_proj[0]) + _nbytes(experts.down_proj[0]))
        pairs = {(s, int(e)) for s, row in zip(slots, ids.tolist()) if s >= 0 for e in row}
        for w in (experts.gate_up_lora, experts.down_lora):
            if w is not None:  # an A another slice's copy stands for (LoRAWeights.a_src) is read once
                el = w.a.element_size()
                total += sum(w.ranks[i][s] * (w.in_features * (w.a_src_host[i][s] == i) + w.out_features[i]) * el
                             for s, _ in pairs for i in range(w.num_slices))
    total += _nbytes(m.model.embed_tokens.weight if m.lm_head is None else m.lm_head)
    return total, touched
