"""Fixed-size LoRA slot buffers for one LoRA-carrying weight (dense or routed experts).

A fused weight has n slices (qkv: 3, gate_up: 2, others: 1); each slice has its own A and B.
Buffers hold `max_loras` slots of rank `max_lora_rank`; a slot's rows/columns past its true rank
stay zero, and `ranks`/`scaling` record each (slice, slot)'s true rank and scale.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


class LoRAWeights(nn.Module):
    """a: [n, S, (E,) R, in] · b_cat: [S, (E,) sum(out_i), R], slice i at rows slice_offsets[i]:slice_offsets[i+1]
    (b[i] is that view) · scaling: [n, S] fp32 · ranks: host [n][S], and rank_tensor [n, S] int32 on the device."""

    def __init__(self, in_features: int, out_features: list[int], max_loras: int, max_lora_rank: int,
                 num_experts: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        n = len(out_features)
        self.in_features, self.out_features, self.num_experts = in_features, list(out_features), num_experts
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        e = () if num_experts is None else (num_experts,)
        self.register_buffer("a", torch.zeros(n, max_loras, *e, max_lora_rank, in_features, dtype=dtype, device=device))
        self.register_buffer("b_cat", torch.zeros(max_loras, *e, sum(out_features), max_lora_rank, dtype=dtype, device=device))
        self.slice_offsets_host = offsets = [0, *itertools.accumulate(out_features)]
        self.register_buffer("slice_offsets", torch.tensor(offsets, dtype=torch.int32, device=device))
        self.register_buffer("scaling", torch.zeros(n, max_loras, dtype=torch.float32, device=device))
        self.register_buffer("rank_tensor", torch.zeros(n, max_loras, dtype=torch.int32, device=device))
        self.ranks: list[list[int]] = [[0] * max_loras for _ in range(n)]
        # a_src[i, s]: the slice whose A copy equals slice i's for slot s (i itself unless another slice holds the
        # same A: routed experts only, e.g. gate and up of a PEFT target_parameters adapter, which share A; the later
        # slice names the earlier). Every slice keeps its own copy too; the fused and grouped
        # routed-expert kernels read the named one (fewer distinct bytes, same values)
        self.register_buffer("a_src", torch.arange(n, dtype=torch.int32, device=device)[:, None].repeat(1, max_loras))
        self.a_src_host: list[list[int]] = [[i] * max_loras for i in range(n)]
        self.shard: LoRAShard | None = None  # set when the owning layer is split over ranks (moelora.distributed)

    def full_dims(self, slice_idx: int) -> tuple[int, int, int | None]:
        """(in_features, out_features of the slice, num_experts) of the whole, unsharded weight: what an
        adapter's tensors are checked against."""
        if self.shard is not None:
            s = self.shard
            return s.in_features, s.out_features[slice_idx], s.num_experts
        return self.in_features, self.out_features[slice_idx], self.num_experts

    @property
    def b(self) -> list[torch.Tensor]:
        """Per slice, a view [S, (E,) out_i, R] of b_cat."""
        o = self.slice_offsets_host
        return [self.b_cat[..., o[i] : o[i + 1], :] for i in range(len(self.out_features))]

    @property
    def num_slices(self) -> int:
        return len(self.out_features)

    @torch.no_grad()
    def set_slot(self, slice_idx: int, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """a: [(E,) r, in] · b: [(E,) out_i, r]; r <= max_lora_rank (checked by the adapter loader).
        On a sharded layer a and b are the whole adapter's factors: this rank's part is cut here."""
        if self.shard is not None:
            a, b = self.shard.local(slice_idx, a, b)
        r = a.shape[-2]
        self.clear(slice_idx, slot)
        self.a[slice_idx, slot, ..., :r, :] = a.to(self.a.dtype)
        self.b[slice_idx][slot, ..., :r] = b.to(self.a.dtype)
        self.scaling[slice_idx, slot] = scaling
        self.rank_tensor[slice_idx, slot] = r
        self.ranks[slice_idx][slot] = r
        if self.num_experts is not None:
            self._share_a(slice_idx, slot)

    def _share_a(self, i: int, slot: int) -> None:
        """After slice i of `slot` was written: where another slice of the slot holds the same A (the whole buffer
        row: equal ranks, zeros past them in both), the later of the two reads the earlier's copy (a_src), in
        whichever order the slices were written."""
        for j in range(self.num_slices):
            if j == i or self.ranks[j][slot] != self.ranks[i][slot] or self.a_src_host[j][slot] != j:
                continue
            if not torch.equal(self.a[j, slot], self.a[i, slot]):
                continue
            src, dst = min(i, j), max(i, j)
            self.a_src[dst, slot] = src
            self.a_src_host[dst][slot] = src
            return

    @torch.no_grad()
    def clear(self, slice_idx: int, slot: int) -> None:
        LORA_SLOT_WRITES[0] += 1
        # this slice reads its own A again, and so does any slice that read this one's copy
        for k in range(self.num_slices):
            if self.a_src_host[k][slot] != k and (k == slice_idx or self.a_src_host[k][slot] == slice_idx):
                self.a_src[k, slot] = k
                self.a_src_host[k][slot] = k
        self.a[slice_idx, slot].zero_()
        self.b[slice_idx][slot].zero_()
        self.scaling[slice_idx, slot] = 0.0
        self.rank_tensor[slice_idx, slot] = 0
        self.ranks[slice_idx][slot] = 0


@dataclass(frozen=True)
class LoRAShard:
    """Which part of an adapter's factors one rank keeps for a layer split over ranks.

    Column-parallel (output split): B keeps rows `out_slices[i]` of slice i, A whole. Row-parallel (input split):
    A keeps columns `in_slice`, B whole; the rank's delta is then a partial sum, completed by the layer's
    all-reduce. Expert-parallel: A and B keep experts `expert_slice` (a factor with an expert dim of 1, the
    "shared outer" layout, is kept whole). in_features/out_features/num_experts: the whole weight's."""

    in_features: int
    out_features: tuple[int, ...]
    num_experts: int | None = None
    in_slice: slice | None = None
    out_slices: tuple[slice | None, ...] | None = None
    expert_slice: slice | None = None

    def local(self, slice_idx: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a: [(E,) r, in] · b: [(E,) out_i, r] -> this rank's [(E_local,) r, in_local], [(E_local,) out_local, r]."""
        if a.shape[-1] != self.in_features or b.shape[-2] != self.out_features[slice_idx]:
            raise ValueError(
                f"LoRA factors A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the unsharded weight "
                f"(in {self.in_features}, out {self.out_features[slice_idx]})"
            )
        if self.expert_slice is not None:
            a = a[self.expert_slice] if a.dim() == 3 and a.shape[0] != 1 else a
            b = b[self.expert_slice] if b.dim() == 3 and b.shape[0] != 1 else b
        if self.in_slice is not None:
            a = a[..., self.in_slice]
        if self.out_slices is not None and self.out_slices[slice_idx] is not None:
            b = b[..., self.out_slices[slice_idx], :]
        return a, b


@dataclass(frozen=True)
class LoRATarget:
    """One adapter-addressable weight, by its transformers module name (e.g.
    `model.layers.0.self_attn.q_proj`, `model.layers.0.mlp.experts.gate_proj`).

    in_features/out_features: of this slice; num_experts: None for dense targets."""

    name: str
    weights: LoRAWeights
    slice_idx: int
    in_features: int
    out_features: int
    num_experts: int | None


LORA_SLOT_WRITES = [0]  # slot writes so far (set_slot clears first): summaries of the slots recompute after one


def slot_target_groups(weights: list[LoRAWeights], max_loras: int) -> list[tuple[bool, bool]]:
    """Per slot: (a dense LoRA weight — attention, shared experts, dense MLP, MLA — has a nonzero rank there,
    a routed-expert one has). weights: every LoRAWeights of the model."""
    dense = [w for w in weights if w.num_experts is None]
    experts = [w for w in weights if w.num_experts is not None]
    return [(any(slot_has_lora(w, [s]) for w in dense), any(slot_has_lora(w, [s]) for w in experts))
            for s in range(max_loras)]


def slot_has_lora(weights: LoRAWeights | None, slot_ids: list[int]) -> bool:
    """True when any of the batch's slots has a nonzero rank on any slice of these weights."""
    if weights is None:
        return False
    return any(weights.ranks[i][s] for i in range(weights.num_slices) for s in slot_ids)


LORA_WORK = {"layer_calls": 0}  # LoRA computations issued (eager) or recorded into a graph (capture)


def lora_work_count() -> int:
    """How many times a layer has run (or captured) its LoRA computation in this process: a base-only
    batch must leave it unchanged."""
    return LORA_WORK["layer_calls"]


def lora_active(weights: LoRAWeights | None, lora) -> bool:
    """Whether a LoRA-carrying layer must run its LoRA kernels for this batch: any of the batch's slots has
    a nonzero rank here, or (CUDA graph) always, since the graph serves every later mix of adapters — unless
    the graph is one for batches without dense / routed-expert adapters (lora.skip_dense / skip_experts) and
    these weights are of that kind. Counts each True answer in LORA_WORK."""
    active = lora_runs(weights, lora)
    LORA_WORK["layer_calls"] += int(active)
    return active


def lora_runs(weights: LoRAWeights | None, lora) -> bool:
    """lora_active's answer, not counted (for a look ahead: a norm computing the next layer's shrink)."""
    if weights is None or lora is None or not lora.has_lora:
        return False
    if lora.graph:
        return not (lora.skip_experts if weights.num_experts is not None else lora.skip_dense)
    return slot_has_lora(weights, lora.slot_ids)
