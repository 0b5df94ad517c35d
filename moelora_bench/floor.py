"""The byte floor of one decode step of a GQA model (Qwen3-MoE, Mixtral, OLMoE presets), by the role that reads
each byte: what `bench decode` divides by the read bandwidth (`floor_ms`), and what the per-kernel layer table
(`trace.kernel_bytes`) sets against each kernel's time. MLA models count from their tensors instead
(`presets.floor_bytes_from_tensors`).

Roles of a decoder layer: `qkv`, `o_proj` (weights), `kv` (the cache rows of every sequence), `router`,
`gate_up`, `down` (the experts some row routes to), the dense LoRA factors `qkv_lora_a`, `qkv_lora_b`,
`o_lora_a`, `o_lora_b` (the batch's slots), the routed-expert LoRA factors `gate_up_lora`, `down_lora` (the
(slot, expert) pairs routed to). Once a step: `lm_head`.
"""

from __future__ import annotations

import torch

ATTENTION_ROLES = ("qkv", "o_proj", "kv", "qkv_lora_a", "qkv_lora_b", "o_lora_a", "o_lora_b")
EXPERT_ROLES = ("router", "gate_up", "down", "gate_up_lora", "down_lora")


def layer_roles(engine, reqs, ctx_len: int, lora_targets: str = "all") -> tuple[list[dict], list[list[dict]], float]:
    """Per decoder layer: (the bytes every rank reads by role, [the bytes each expert-parallel group's ranks read
    by role, one dict a group]), and the lm_head's bytes. Tensor/expert parallel: one rank's shard of attention,
    dense LoRA and lm_head (over tp), its KV heads, and its group's own experts (over ep) at I/tp width.
    lora_targets (all, attention, experts): the dense LoRA factors count unless it is "experts", the routed
    experts' unless it is "attention". The routing is each MoE block's `last_topk_ids`."""
    cfg, m = engine.config, engine.model
    el = torch.empty((), dtype=m.dtype).element_size()  # activations, KV, LoRA, router, lm_head
    # base weight bytes per element: FP8 a byte + one fp32 scale per 128x128 block; NVFP4 half a byte + an e4m3 per 16
    wel = {"fp8": 1 + 4 / 128**2, "nvfp4": 0.5 + 1 / 16}.get(engine.args.quantization, el)
    tp, ep = engine.args.tensor_parallel_size, engine.args.expert_parallel_size
    H, E, qs, kvs = cfg.hidden_size, cfg.num_experts, cfg.q_size // tp, cfg.kv_size
    kvs = kvs // tp if cfg.num_key_value_heads >= tp else kvs // cfg.num_key_value_heads  # KV heads replicated
    I = cfg.moe_intermediate_size // tp  # noqa: E741 - each expert's intermediate width on one rank
    r = engine.args.max_lora_rank
    n = len(reqs)
    # the slot each request's adapter sits in (a finished request's own slot field is already -1)
    slots = torch.tensor([engine.pool.slot_of(q.adapter) if q.adapter and engine.pool else -1 for q in reqs])
    lora_slots = int(slots[slots >= 0].unique().numel())
    dense = 0 if lora_targets == "experts" else lora_slots
    routed = lora_targets != "attention"
    common, groups = [], []
    for layer in m.model.layers:
        # q, k, v column-parallel, o row-parallel; LoRA q/k/v: A [r, H] replicated, B [out/tp, r]; o: A [r, qs/tp],
        # B [H, r] replicated
        c = {"qkv": H * (qs + 2 * kvs) * wel, "o_proj": qs * H * wel, "kv": n * ctx_len * 2 * kvs * el,
             "qkv_lora_a": dense * r * 3 * H * el, "qkv_lora_b": dense * r * (qs + 2 * kvs) * el,
             "o_lora_a": dense * r * qs * el, "o_lora_b": dense * r * H * el}
        g: list[dict] = [{} for _ in range(ep)]
        mlp = layer.mlp
        ids = getattr(mlp, "last_topk_ids", None)
        if ids is not None:
            ids = ids[:n].cpu()
            experts = ids.unique()
            c["router"] = E * H * el  # replicated
            pairs = {(int(s), int(e)) for s, row in zip(slots.tolist(), ids.tolist()) if s >= 0 and routed
                     for e in row}
            gu = getattr(getattr(mlp, "experts", None), "gate_up_lora", None)
            # slots whose up slice reads the gate's A (LoRAWeights.a_src: the same A, e.g. PEFT's target_parameters)
            shared = set() if gu is None else {s for s, src in enumerate(gu.a_src_host[1]) if src == 0}
            for k in range(ep):
                lo, hi = k * E // ep, (k + 1) * E // ep
                mine = int(((experts >= lo) & (experts < hi)).sum())
                own = [s for s, e in pairs if lo <= e < hi]
                # gate/up A [r, H] (one when shared) and B [I, r] each; down A [r, I] and B [H, r]
                g[k] = {"gate_up": mine * 2 * H * I * wel, "down": mine * H * I * wel,
                        "gate_up_lora": sum(r * ((1 if s in shared else 2) * H + 2 * I) * el for s in own),
                        "down_lora": len(own) * r * (I + H) * el}
        common.append(c)
        groups.append(g)
    return common, groups, -(-cfg.vocab_size // tp) * H * el  # lm_head (vocabulary-parallel)


def floor_bytes(engine, reqs, ctx_len: int, lora_targets: str = "all") -> tuple[int, list[int]]:
    """Bytes one decode step must read (`layer_roles` summed: the bytes of the rank that reads the most, ranks
    reading in parallel), and the experts touched per MoE layer (from the last step's routing)."""
    common, groups, lm_head = layer_roles(engine, reqs, ctx_len, lora_targets)
    ep = engine.args.expert_parallel_size
    per_group = [sum(sum(g[k].values()) for g in groups) for k in range(ep)]
    touched = [int(mlp.last_topk_ids[:len(reqs)].unique().numel()) for layer in engine.model.model.layers
               if (mlp := layer.mlp) is not None and getattr(mlp, "last_topk_ids", None) is not None]
    return int(sum(sum(c.values()) for c in common) + lm_head + max(per_group)), touched


def mean_layer_roles(engine, reqs, ctx_len: int, lora_targets: str = "all") -> dict[str, float]:
    """One decoder layer's bytes by role, the mean over the layers (a single rank: expert-parallel group 0);
    roles a layer does not have (a dense layer's router) count 0 there."""
    common, groups, _ = layer_roles(engine, reqs, ctx_len, lora_targets)
    out: dict[str, float] = {}
    for c, g in zip(common, groups):
        for k, v in {**c, **g[0]}.items():
            out[k] = out.get(k, 0.0) + v / len(common)
    return out
