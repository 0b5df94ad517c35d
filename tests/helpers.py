"""Shared test helpers: tiny random models per family, PEFT-saved adapters, and a runner that
puts a mixed-adapter batch through moelora and returns per-row log-probabilities."""

from __future__ import annotations

import os

import torch

from moelora.layers.lora_batch import LoRABatch
from moelora.adapters.registry import AdapterRegistry
from moelora.adapters.slots import SlotPool
from moelora.config import ModelConfig
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.models.loader import build_model

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, tie_word_embeddings=False)


def hf_tiny(family: str, **over):
    """(config, model class) of a tiny random model built from the family's real config class.
    Hidden 32, expert intermediate 12 (2I = 24): gate_up and down LoRA shapes always differ."""
    from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**COMMON, "head_dim": 8, "intermediate_size": 40, "moe_intermediate_size": 12,
                                "num_experts": 8, "norm_topk_prob": True, "mlp_only_layers": [1], **over})
        return cfg, Qwen3MoeForCausalLM
    if family == "qwen2_moe":
        cfg = Qwen2MoeConfig(**{**COMMON, "intermediate_size": 40, "moe_intermediate_size": 12,
                                "shared_expert_intermediate_size": 20, "num_experts": 8, **over})
        return cfg, Qwen2MoeForCausalLM
    if family == "mixtral":
        return MixtralConfig(**{**COMMON, "intermediate_size": 12, "num_local_experts": 8, **over}), MixtralForCausalLM
    if family == "olmoe":
        return OlmoeConfig(**{**COMMON, "intermediate_size": 12, "num_experts": 8, "eos_token_id": 1, **over}), OlmoeForCausalLM
    if family.startswith("deepseek"):
        return deepseek_tiny(family, **over)
    raise ValueError(family)


# MLA dims: q/k head 8 (nope) + 4 (rope), v head 6, latent 16, q latent 12; 8 routed experts in 4 groups of 2
DEEPSEEK_COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=40, moe_intermediate_size=12, n_routed_experts=8, n_shared_experts=1,
                       num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=6, n_group=4, topk_group=2, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0}


def deepseek_tiny(variant: str, **over):
    """deepseek_v2: no q_lora_rank, group-limited greedy routing (top-3), default rope.
    deepseek_v2_q: q_lora_rank, greedy routing, routed_scaling_factor 1.5, attention biases, YaRN (mscale_all_dim set).
    deepseek_v3: q_lora_rank, noaux_tc (sigmoid, score-correction bias, groups), norm_topk_prob, scaling 2.5, YaRN."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    if variant == "deepseek_v2":  # top-3 from 2 of 4 groups: the group limit changes the choice
        kw = dict(q_lora_rank=None, topk_method="group_limited_greedy", num_experts_per_tok=3)
        return DeepseekV2Config(**{**DEEPSEEK_COMMON, **kw, **over}), DeepseekV2ForCausalLM
    if variant == "deepseek_v2_q":
        kw = dict(q_lora_rank=12, topk_method="greedy", routed_scaling_factor=1.5, attention_bias=True,
                  max_position_embeddings=128, rope_parameters=dict(YARN))
        return DeepseekV2Config(**{**DEEPSEEK_COMMON, **kw, **over}), DeepseekV2ForCausalLM
    if variant == "deepseek_v3":
        kw = dict(q_lora_rank=12, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
                  rope_parameters={**YARN, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.8})
        return DeepseekV3Config(**{**DEEPSEEK_COMMON, **kw, **over}), DeepseekV3ForCausalLM
    raise ValueError(variant)


def save_tiny_model(family: str, path: str, seed: int = 0, **over):
    cfg, cls = hf_tiny(family, **over)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # spread the router so several experts get tokens
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
        if family.startswith("deepseek"):
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):  # V3: a bias that changes which experts win
                    b.normal_(0, 0.5)
            for n, p in model.named_parameters():
                if n.endswith("_proj.bias"):  # attention biases (attention_bias=True): nonzero, so they count
                    p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def save_peft_adapter(base, path: str, seed: int, **lora_kwargs) -> None:
    """A PEFT LoRA adapter with random (nonzero) A and B, saved by PEFT itself."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(path)


def peft_logprobs(base, adapter_path: str | None, ids: list[int]) -> torch.Tensor:
    """Reference: transformers (+ PEFT with this one adapter) on one sequence -> log-probs [L, V]."""
    import copy

    from peft import PeftModel

    model = base if adapter_path is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


class Runner:
    """moelora model + registry + slot pool on the CPU, for parity tests."""

    def __init__(self, model_path: str, max_loras: int = 4, max_lora_rank: int = 16, dtype: str = "float32",
                 device: str = "cpu", build_kw: dict | None = None) -> None:
        self.cfg = ModelConfig.from_pretrained(model_path)
        self.device = device
        self.model = build_model(self.cfg, model_path, dtype=dtype, device=device, max_loras=max_loras,
                                 max_lora_rank=max_lora_rank, **(build_kw or {}))
        self.targets = self.model.lora_targets()
        self.registry = AdapterRegistry(self.targets, max_lora_rank)
        self.pool = SlotPool(self.targets, max_loras)
        self.max_loras = max_loras

    def load(self, name: str, path: str) -> int:
        self.registry.load(name, path)
        return self.pool.pin(self.registry.get(name))

    def logprobs(self, rows: list[tuple[list[int], str | None]], block_size: int = 4,
                 kv_blocks: int = 256) -> list[torch.Tensor]:
        """Prefill every row in one flat batch; rows name their adapter (None = base). kv_blocks: the KV cache's
        blocks (of block_size tokens), enough for every row."""
        kv = KVCache(self.cfg, kv_blocks, block_size, self.model.dtype, self.device)
        chunks = []
        for ids, adapter in rows:
            slot = -1 if adapter is None else self.pool.slot_of(adapter)
            chunks.append(SeqChunk(ids, 0, kv.allocate(kv.blocks_needed(len(ids), 0)), slot))
        fb = build_flat_batch(chunks, block_size, self.device)
        lora = LoRABatch.build(fb.token_slots, self.max_loras, self.device)
        hidden = self.model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
        lp = torch.log_softmax(self.model.compute_logits(hidden), -1).cpu()
        q = fb.attn.query_start_loc
        return [lp[q[i] : q[i + 1]] for i in range(len(rows))]


def rows_of(seed: int, lengths: list[int], vocab: int = 97) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def tmp(path, *parts) -> str:
    p = os.path.join(str(path), *parts)
    os.makedirs(p, exist_ok=True)
    return p


def greedy_ref(base, adapter_path: str | None, ids: list[int], n: int) -> list[int]:
    """Reference greedy continuation: n full forwards of transformers (+ PEFT), argmax each time."""
    import copy

    from peft import PeftModel

    model = base if adapter_path is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_path)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def save_byte_tokenizer(path: str, eos: str = "<|endoftext|>") -> None:
    """A byte-level BPE tokenizer without merges (ids 0..255 = bytes, then special tokens), saved with a
    chat template: enough for the engine's text paths on a model with vocab_size >= 260."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), sorted(alphabet, key=lambda c: _byte_of(c)))}
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos, "<|im_start|>", "<|im_end|>"])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template}, f)


def _byte_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[c]


def attention_lora_decode_case(root: str, quant: str | None, batch: int, device: str = "cuda", seed: int = 24,
                               mlp_only_layers: list[int] | None = None):
    """A decode step at Qwen3-30B-A3B's attention dims: a 2-layer Qwen3-MoE (hidden 2048, 32 heads of 128, 4 KV
    heads; dummy weights, FP8 with quant="fp8"), 4 adapters of ranks 16 / 8 / 16 / 4 on qkv_proj and o_proj,
    `batch` sequences of one new token each after a random cached context (random cache contents), slots
    b % 5 - 1 (every fifth row without an adapter). Returns (model, step, adapter_rows): step(lora=the batch's
    graph-mode LoRABatch, None for no adapter) restores the KV cache, runs the step and returns the logits
    [T, vocab] (the same inputs every call, so it can be captured in a CUDA graph); adapter_rows [T] bool."""
    import dataclasses
    import random

    src = os.path.join(root, "decode-case")
    os.makedirs(src, exist_ok=True)
    over = {} if mlp_only_layers is None else {"mlp_only_layers": mlp_only_layers}
    save_tiny_model("qwen3_moe", src, hidden_size=2048, head_dim=128, num_attention_heads=32, num_key_value_heads=4,
                    moe_intermediate_size=128, intermediate_size=256, num_hidden_layers=2, **over)
    cfg = ModelConfig.from_pretrained(src)
    model = build_model(cfg, dtype=torch.bfloat16, device=device, max_loras=4, max_lora_rank=16, load_format="dummy",
                        quantization=quant)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            w = lin.lora
            for s in range(4):
                for i, out in enumerate(w.out_features):
                    r = (16, 8, 16, 4)[s]
                    w.set_slot(i, s, torch.randn(r, w.in_features, device=device, generator=g) * 0.02,
                               torch.randn(out, r, device=device, generator=g) * 0.02, 2.0)
    kv = KVCache(cfg, 4096, 16, torch.bfloat16, device)
    for cache in kv.caches:
        for c in cache:
            c.normal_(0, 1, generator=g)
    rng = random.Random(seed)
    chunks = []
    for b in range(batch):
        cached = rng.randrange(1, 300)
        chunks.append(SeqChunk([rng.randrange(cfg.vocab_size)], cached, kv.allocate(-(-(cached + 1) // 16)), b % 5 - 1))
    fb = build_flat_batch(chunks, 16, device)
    graph_lora = dataclasses.replace(LoRABatch.build(fb.token_slots, 4, device), graph=True)
    caches = [c for cache in kv.caches for c in cache]
    saved = [c.clone() for c in caches]

    def step(lora=graph_lora):
        for c, s in zip(caches, saved):
            c.copy_(s)  # every run starts from the same cache (the step writes its own k / v rows)
        return model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora))

    return model, step, torch.tensor(fb.token_slots, device=device) >= 0
