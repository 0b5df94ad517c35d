"""Split a built (and loaded) model over the ranks of a ParallelState, in place.

Every rank builds the whole model and loads every weight, then `shard_model` keeps its part and wires the
collectives in as forward hooks, so the modules of moelora.layers run unchanged on smaller tensors:

- GQA attention (tp group): qkv_proj column-parallel by heads (each rank keeps num_heads/tp query heads and
  the KV heads they read; when num_kv_heads < tp a KV head is replicated on tp/num_kv_heads ranks), o_proj
  row-parallel + all-reduce (its bias on tp rank 0 only).
- MLA attention (tp group): q_proj / q_b_proj and kv_b_proj column-parallel by heads; q_a/kv_a (the latent
  and its cache) replicated; o_proj row-parallel + all-reduce.
- dense MLP (tp group): gate_up column-parallel, down row-parallel + all-reduce.
- MoE layer (all ranks, one all-reduce after the block): routed experts split by expert over ep and by
  intermediate width over tp; shared experts split by width over all ranks; the router (and Qwen2-MoE's
  shared-expert gate) replicated, so every rank routes every token the same way.
- embedding: vocabulary-parallel (masked lookup + all-reduce over tp); LM head: vocabulary-parallel
  logits, all-gathered over tp.

Expert parallelism dispatches the simplest correct way: activations are replicated (every rank holds every
token after the attention all-reduce), every rank routes every token, computes only the (token, k) pairs whose
expert it holds (the others get router weight 0 and local expert 0, contributing exactly nothing), and the
block's all-reduce sums the ranks' partial outputs. No all-to-all, no token permutation across ranks, and the
combine is the same all-reduce that tensor parallelism needs anyway; the cost is that every rank touches every
token (an all-to-all dispatch sends each token only to the ranks of its experts: the better choice at large
batch, to be chosen by measurement on GPUs).

LoRA follows its layer (ARCHITECTURE.md): column-parallel: B split with the output, A whole; row-parallel:
A split with the input, B whole (the rank's delta is a partial sum inside the same all-reduce); experts: the
adapter's per-expert factors live with their expert. Each LoRAWeights gets a LoRAShard, so an adapter written
by the SlotPool (whole tensors, as the registry holds them) lands cut to this rank's part at set_slot time.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moelora.config import ModelConfig
from moelora.distributed.parallel_state import ParallelState, all_reduce_
from moelora.layers.attention import Attention
from moelora.layers.linear import LoRALinear
from moelora.layers.lora import LoRAShard
from moelora.layers.mla import MLAttention
from moelora.layers.moe import DenseMLP, RoutedExperts


def _part(n: int, rank: int, size: int, what: str) -> slice:
    """The rank's contiguous share of n items (n must divide evenly)."""
    if n % size:
        raise ValueError(f"{what} = {n} does not split evenly over {size} ranks")
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _check_unquantized(module: nn.Module, name: str) -> None:
    if getattr(module, "quant", None) is not None:
        raise NotImplementedError(f"{name}: tensor/expert parallelism over quantized (FP8/NVFP4) weights is not supported yet")


def _relora(module: nn.Module, shard: LoRAShard | list[LoRAShard], max_loras: int, max_lora_rank: int) -> None:
    """Re-allocate the module's LoRA slot buffers at its new (local) shape and attach the shard specs."""
    if not max_loras:
        return
    module.enable_lora(max_loras, max_lora_rank)
    if isinstance(module, LoRALinear):
        module.lora.shard = shard
    else:  # RoutedExperts: [gate_up spec, down spec]
        module.gate_up_lora.shard, module.down_lora.shard = shard


def shard_column(lin: LoRALinear, parts: list[slice], model_lora: tuple[int, int], name: str) -> None:
    """Keep rows parts[i] of output slice i (weight, bias, LoRA B); in_features unchanged."""
    _check_unquantized(lin, name)
    full_out = tuple(lin.out_features)
    offsets = [0, *itertools.accumulate(full_out)]
    rows = torch.cat([torch.arange(offsets[i] + p.start, offsets[i] + p.stop) for i, p in enumerate(parts)])
    rows = rows.to(lin.weight.device)
    lin.weight = _param(lin.weight[rows])  # [sum(out_local), in]
    if lin.bias is not None:
        lin.bias = _param(lin.bias[rows])
    lin.out_features = [p.stop - p.start for p in parts]
    _relora(lin, LoRAShard(lin.in_features, full_out, None, out_slices=tuple(parts)), *model_lora)


def shard_row(lin: LoRALinear, part: slice, keep_bias: bool, model_lora: tuple[int, int], name: str) -> None:
    """Keep input columns `part` (weight, LoRA A); the bias stays on one rank only (keep_bias), so the all-reduce
    adds it once."""
    _check_unquantized(lin, name)
    full_in = lin.in_features
    lin.weight = _param(lin.weight[:, part])  # [out, in_local]
    if lin.bias is not None and not keep_bias:
        lin.bias = _param(torch.zeros_like(lin.bias))
    lin.in_features = part.stop - part.start
    _relora(lin, LoRAShard(full_in, tuple(lin.out_features), None, in_slice=part), *model_lora)


def _all_reduce_hook(group: dist.ProcessGroup | None):
    """Forward hook: the module's output summed over `group`, in place."""
    return lambda module, args, output: all_reduce_(output, group)


def shard_attention(attn: Attention, ps: ParallelState, lora: tuple[int, int], name: str) -> None:
    """GQA attention over the tp group: query heads split; KV heads split, or replicated when fewer than ranks."""
    tp, r = ps.tp_size, ps.tp_rank
    D, Hq, Hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q_heads = _part(Hq, r, tp, f"{name}: num_attention_heads")
    if Hkv >= tp:
        kv_heads = _part(Hkv, r, tp, f"{name}: num_key_value_heads")
    else:
        if tp % Hkv:
            raise ValueError(f"{name}: {Hkv} KV heads cannot be replicated evenly over {tp} ranks")
        h = r // (tp // Hkv)  # the one KV head this rank's query heads read
        kv_heads = slice(h, h + 1)
    q = slice(q_heads.start * D, q_heads.stop * D)
    kv = slice(kv_heads.start * D, kv_heads.stop * D)
    shard_column(attn.qkv_proj, [q, kv, kv], lora, f"{name}.qkv_proj")
    shard_row(attn.o_proj, q, r == 0, lora, f"{name}.o_proj")
    if attn.qk_norm == "full":  # OLMoE: q/k norms over the whole projection; their statistics span the ranks
        attn.q_norm = ParallelRMSNorm(attn.q_norm.weight[q], attn.q_norm.eps, attn.q_size, 1, ps.tp_group)
        attn.k_norm = ParallelRMSNorm(attn.k_norm.weight[kv], attn.k_norm.eps, attn.kv_size,
                                      max(1, tp // Hkv), ps.tp_group)
    attn.num_heads, attn.num_kv_heads = q_heads.stop - q_heads.start, kv_heads.stop - kv_heads.start
    attn.q_size, attn.kv_size = attn.num_heads * D, attn.num_kv_heads * D


def shard_mla(attn: MLAttention, ps: ParallelState, lora: tuple[int, int], name: str) -> None:
    """MLA over the tp group: heads split (q or q_b, kv_b by head, o_proj by head); the latent path replicated."""
    tp, r = ps.tp_size, ps.tp_rank
    heads = _part(attn.num_heads, r, tp, f"{name}: num_attention_heads")
    qk = attn.nope + attn.rope
    q_lin = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    shard_column(q_lin, [slice(heads.start * qk, heads.stop * qk)], lora, f"{name}.q_proj")
    kvb = attn.nope + attn.v_dim
    shard_column(attn.kv_b_proj, [slice(heads.start * kvb, heads.stop * kvb)], lora, f"{name}.kv_b_proj")
    shard_row(attn.o_proj, slice(heads.start * attn.v_dim, heads.stop * attn.v_dim), r == 0, lora, f"{name}.o_proj")
    attn.num_heads = heads.stop - heads.start


def shard_mlp(mlp: DenseMLP, rank: int, size: int, lora: tuple[int, int], name: str) -> None:
    """Intermediate width split over `size` ranks: gate_up column, down row (no all-reduce here: the caller
    hooks it where the partial sums are complete)."""
    part = _part(mlp.inter, rank, size, f"{name}: intermediate_size")
    shard_column(mlp.gate_up_proj, [part, part], lora, f"{name}.gate_up_proj")
    shard_row(mlp.down_proj, part, True, lora, f"{name}.down_proj")
    mlp.inter = part.stop - part.start


def shard_experts(ex: RoutedExperts, ps: ParallelState, lora: tuple[int, int], name: str) -> None:
    """Experts split over ep (E/ep local experts), each expert's intermediate width over tp."""
    _check_unquantized(ex, name)
    E, inter, H = ex.num_experts, ex.inter, ex.hidden
    es = _part(E, ps.ep_rank, ps.ep_size, f"{name}: num_experts")
    ts = _part(inter, ps.tp_rank, ps.tp_size, f"{name}: moe_intermediate_size")
    gu = ex.gate_up_proj[es]  # [E_local, 2I, H], gate rows first
    ex.gate_up_proj = _param(torch.cat([gu[:, ts], gu[:, inter + ts.start : inter + ts.stop]], dim=1))
    ex.down_proj = _param(ex.down_proj[es][:, :, ts])  # [E_local, H, I_local]
    ex.num_experts, ex.inter = es.stop - es.start, ts.stop - ts.start
    _relora(ex, [LoRAShard(H, (inter, inter), E, out_slices=(ts, ts), expert_slice=es),
                 LoRAShard(inter, (H,), E, in_slice=ts, expert_slice=es)], *lora)
    if ps.ep_size > 1:
        ex.register_forward_pre_hook(_local_experts_hook(es.start, ex.num_experts))


def _local_experts_hook(first: int, count: int):
    """Forward pre-hook of RoutedExperts(x, topk_weights, topk_ids, lora): pairs routed to another rank's expert
    get weight 0 and local expert 0 (they add exactly nothing); the others their local expert id."""

    def hook(module: nn.Module, args):
        x, topk_weights, topk_ids, lora = args
        local = topk_ids - first  # [T, K]
        mine = (local >= 0) & (local < count)
        return x, topk_weights.masked_fill(~mine, 0), local.masked_fill(~mine, 0), lora

    return hook


class ParallelRMSNorm(nn.Module):
    """RMSNorm over a dimension split across a group: y = w * x / sqrt(sum over all ranks of x^2 / full_dim + eps),
    statistics in fp32 as rms_norm_ref. replicas: how many ranks hold each element (a replicated KV head is
    counted that many times by the all-reduce)."""

    def __init__(self, weight: torch.Tensor, eps: float, full_dim: int, replicas: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = _param(weight)  # [D_local]
        self.eps, self.full_dim, self.replicas, self.group = eps, full_dim, replicas, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [T, D_local]
        sq = all_reduce_(xf.pow(2).sum(-1, keepdim=True), self.group)  # [T, 1]
        xf = xf * torch.rsqrt(sq / (self.full_dim * self.replicas) + self.eps)
        return self.weight * xf.to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V_local) of the embedding (padded to V_local rows on the last rank); a token
    outside them looks up zeros, and the all-reduce over tp leaves each token its one real row."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = _param(weight)  # [V_local, H]
        self.start, self.vocab_size, self.group = start, vocab_size, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0]) & (input_ids < self.vocab_size)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight).masked_fill(~mine[:, None], 0)  # [T, H]
        return all_reduce_(out, self.group)


def _vocab_rows(w: torch.Tensor, ps: ParallelState) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [V, H] vocabulary matrix, zero-padded to ceil(V / tp) rows; and its first row."""
    V = w.shape[0]
    per = -(-V // ps.tp_size)
    start = ps.tp_rank * per
    part = w[start : min(start + per, V)]
    if part.shape[0] < per:
        part = torch.cat([part, part.new_zeros(per - part.shape[0], w.shape[1])])
    return part, start


def _vocab_parallel_logits(model: nn.Module, ps: ParallelState, vocab_size: int):
    """compute_logits of a vocabulary-parallel model: local logits [T, V_local], all-gathered to [T, V]."""

    @torch.no_grad()
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        w = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head
        local = F.linear(hidden, w).float().contiguous()  # [T, V_local]
        parts = [torch.empty_like(local) for _ in range(ps.tp_size)]
        dist.all_gather(parts, local, group=ps.tp_group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]  # [T, V]

    return compute_logits


@torch.no_grad()
def shard_model(model: nn.Module, ps: ParallelState) -> nn.Module:
    """Split a MoECausalLM (GQA families) or DeepseekForCausalLM over ps, in place; returns the model.

    Call it after the weights are loaded and enable_lora() (the LoRA buffers are re-made at the local shape),
    before lora_targets() and before any adapter is written into a slot. At tp = ep = 1 nothing changes."""
    if not ps.is_parallel:
        return model
    if getattr(model, "parallel_state", None) is not None:
        raise RuntimeError("shard_model: this model is already sharded")
    for m in model.modules():
        w = getattr(m, "lora", None) or getattr(m, "gate_up_lora", None)
        if w is not None and any(any(r) for r in w.ranks):
            raise RuntimeError("shard_model must run before adapters are loaded into slots (a slot already holds one)")
    cfg: ModelConfig = model.config
    lora = (model.max_loras, model.max_lora_rank)
    tp_on = ps.tp_size > 1
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        if tp_on:  # o_proj is row-parallel: the all-reduce over tp completes its partial sums
            shard = shard_mla if isinstance(layer.self_attn, MLAttention) else shard_attention
            shard(layer.self_attn, ps, lora, f"{p}.self_attn")
            layer.self_attn.o_proj.register_forward_hook(_all_reduce_hook(ps.tp_group))
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            if tp_on:
                shard_mlp(mlp, ps.tp_rank, ps.tp_size, lora, f"{p}.mlp")
                mlp.register_forward_hook(_all_reduce_hook(ps.tp_group))
            continue
        shard_experts(mlp.experts, ps, lora, f"{p}.mlp.experts")
        for name in ("shared_expert", "shared_experts"):
            shared = getattr(mlp, name, None)
            if shared is not None:  # width over every rank: its partial sum joins the block's all-reduce
                shard_mlp(shared, ps.rank, ps.world_size, lora, f"{p}.mlp.{name}")
        mlp.register_forward_hook(_all_reduce_hook(ps.world_group))
    if tp_on:
        emb = model.model.embed_tokens
        part, start = _vocab_rows(emb.weight, ps)
        model.model.embed_tokens = VocabParallelEmbedding(part, start, cfg.vocab_size, ps.tp_group)
        if model.lm_head is not None:
            model.lm_head = _param(_vocab_rows(model.lm_head, ps)[0])
        model.compute_logits = _vocab_parallel_logits(model, ps, cfg.vocab_size)
    model.parallel_state = ps
    return model


def kv_cache_config(cfg: ModelConfig, ps: ParallelState) -> ModelConfig:
    """The config whose KV-cache shapes fit this rank (GQA: its KV heads; MLA: the latent cache, replicated)."""
    if cfg.mla is not None or ps.tp_size == 1:
        return cfg
    h = cfg.num_key_value_heads
    return dataclasses.replace(cfg, num_key_value_heads=h // ps.tp_size if h >= ps.tp_size else 1)
