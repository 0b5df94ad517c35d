"""Normalize the three expert layouts (and dense targets) of a PEFT adapter into one form:
canonical target name -> A [(E,) r, in], B [(E,) out, r], scaling, checked against the base model.

Layouts of routed-expert LoRA (see ARCHITECTURE.md):
- per-expert 2-D: `mlp.experts.{e}.{gate,up,down}_proj` (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`);
- PEFT `target_parameters` on fused 3-D experts: `mlp.experts[.base_layer]*` with A [r*E, in] and
  B [out, r*E], columns interleaved j*E + e; gate_up vs down told apart by shapes, never by key order;
- 3-D tensors `mlp.experts.{gate_up_proj,down_proj}` with A [E, r, in], B [E, out, r]; "shared outer"
  when gate_up's A or down's B has an expert dim of 1 (one factor for all experts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moelora.adapters.errors import AdapterError
from moelora.adapters.peft_format import PeftLoraConfig
from moelora.layers.lora import LoRATarget

_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class ModuleLoRA:
    """a: [(E,) r, in] · b: [(E,) out, r] · scaling: alpha / r (or alpha / sqrt(r))."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


def normalize_adapter(
    name: str,
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]],
    cfg: PeftLoraConfig,
    targets: dict[str, LoRATarget],
    max_lora_rank: int,
) -> dict[str, ModuleLoRA]:
    out: dict[str, ModuleLoRA] = {}
    per_expert: dict[str, dict[int, tuple[str, ModuleLoRA]]] = {}
    for module, ab in groups.items():
        (ka, a), (kb, b) = ab["A"], ab["B"]
        a, b = a.float(), b.float()
        for key, t in ((ka, a), (kb, b)):
            if not torch.isfinite(t).all():
                raise AdapterError(name, "contains NaN or Inf values", key)
        canon = re.sub(r"\.block_sparse_moe\.", ".mlp.", module)
        if m := re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)", canon):
            kind = _MIXTRAL.get(m[3], m[3])
            _check_2d(name, ka, a, kb, b)
            r, scaling = cfg.rank_and_scaling(module)
            _check_rank(name, ka, a.shape[0], r)
            per_expert.setdefault(f"{m[1]}.{kind}", {})[int(m[2])] = (ka, ModuleLoRA(a, b, scaling))
        elif m := re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", canon):
            _from_3d(name, m[1], m[2], module, ka, a, kb, b, cfg, targets, out)
        elif m := re.fullmatch(r"(.*\.mlp\.experts)(?:\.base_layer)*", canon):
            _from_target_parameters(name, m[1], module, ka, a, kb, b, cfg, targets, out)
        else:
            _check_2d(name, ka, a, kb, b)
            r, scaling = cfg.rank_and_scaling(module)
            _check_rank(name, ka, a.shape[0], r)
            _put(name, out, targets, canon, ModuleLoRA(a, b, scaling), ka, kb)
    for canon, experts in per_expert.items():
        key = next(iter(experts.values()))[0]
        _put(name, out, targets, canon, _stack_experts(name, canon, experts, targets), key, key)
    for canon, mod in out.items():
        if mod.rank > max_lora_rank:
            raise AdapterError(
                name, f"rank {mod.rank} on {canon} is above max_lora_rank={max_lora_rank}; "
                f"restart with --max-lora-rank {_next_pow2(mod.rank)} or more",
            )
    return out


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_2d(name, ka, a, kb, b) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(name, f"expected 2-D lora_A/lora_B, found {list(a.shape)} and {list(b.shape)}", ka)
    if a.shape[0] != b.shape[1]:
        raise AdapterError(name, f"lora_A has rank {a.shape[0]} but lora_B {list(b.shape)} has {b.shape[1]} columns", kb)


def _check_rank(name, key, found: int, expected: int) -> None:
    if found != expected:
        raise AdapterError(name, f"adapter_config.json gives rank {expected} for this module, the tensor has {found}", key)


def _target(name: str, targets: dict[str, LoRATarget], canon: str, key: str) -> LoRATarget:
    t = targets.get(canon)
    if t is None:
        kinds = sorted({n.split(".", 3)[-1] for n in targets})
        raise AdapterError(
            name, f"targets module {canon!r}, which this base model does not have "
            f"({sum(1 for n in targets if n.endswith('.o_proj'))} layers; LoRA targets per layer: {', '.join(kinds)})", key,
        )
    return t


def _put(name, out, targets, canon: str, mod: ModuleLoRA, ka: str, kb: str) -> None:
    t = _target(name, targets, canon, ka)
    e = () if t.num_experts is None else (t.num_experts,)
    exp_a, exp_b = [*e, mod.rank, t.in_features], [*e, t.out_features, mod.rank]
    if list(mod.a.shape) != exp_a:
        raise AdapterError(name, f"expected shape {exp_a} for {canon} (in={t.in_features}), found {list(mod.a.shape)}", ka)
    if list(mod.b.shape) != exp_b:
        raise AdapterError(name, f"expected shape {exp_b} for {canon} (out={t.out_features}), found {list(mod.b.shape)}", kb)
    out[canon] = mod


def _expert_targets(name, targets, prefix: str, key: str) -> tuple[LoRATarget, LoRATarget]:
    gate, down = targets.get(f"{prefix}.gate_proj"), targets.get(f"{prefix}.down_proj")
    if gate is None or down is None:
        raise AdapterError(name, f"targets routed experts {prefix!r}, but that layer of the base model has none", key)
    return gate, down


def _from_target_parameters(name, prefix, module, ka, a, kb, b, cfg, targets, out) -> None:
    """A [r*E, in], B [out, r*E] with columns j*E + e; gate_up vs down decided by shapes."""
    gate, down = _expert_targets(name, targets, prefix, ka)
    E, H, I = gate.num_experts, gate.in_features, gate.out_features
    _check_2d(name, ka, a, kb, b)
    if a.shape[0] % E:
        raise AdapterError(name, f"lora_A rows must be rank x num_experts (E={E}), found {list(a.shape)}", ka)
    fits_gate_up = a.shape[1] == H and b.shape[0] == 2 * I
    fits_down = a.shape[1] == I and b.shape[0] == H
    if not (fits_gate_up or fits_down):
        raise AdapterError(
            name, f"fused-expert LoRA fits neither gate_up_proj (A [r*{E}, {H}], B [{2 * I}, r*{E}]) nor down_proj "
            f"(A [r*{E}, {I}], B [{H}, r*{E}]): found A {list(a.shape)}, B {list(b.shape)} "
            "(a transposed tensor, or an adapter for another base model?)", ka,
        )
    r = a.shape[0] // E
    which = "gate_up_proj" if fits_gate_up else "down_proj"
    r_cfg, scaling = cfg.rank_and_scaling(f"{prefix}.{which}")
    _check_rank(name, ka, r, r_cfg)
    a3 = a.reshape(E, r, a.shape[1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], r, E).permute(2, 0, 1).contiguous()  # [E, out, r]
    _put_experts(name, out, targets, prefix, which, a3, b3, scaling, ka, kb)


def _from_3d(name, prefix, which, module, ka, a, kb, b, cfg, targets, out) -> None:
    """A [E|1, r, in], B [E|1, out, r]; an expert dim of 1 is shared by all experts."""
    gate, _ = _expert_targets(name, targets, prefix, ka)
    E = gate.num_experts
    if a.dim() != 3 or b.dim() != 3:
        raise AdapterError(name, f"expected 3-D [experts, r, in] / [experts, out, r], found {list(a.shape)}, {list(b.shape)}", ka)
    if a.shape[1] != b.shape[2]:
        raise AdapterError(name, f"lora_A rank {a.shape[1]} != lora_B rank {b.shape[2]}", kb)
    for key, t in ((ka, a), (kb, b)):
        if t.shape[0] not in (1, E):
            raise AdapterError(name, f"expert dim must be {E} (or 1 for a shared factor), found {list(t.shape)}", key)
    r_cfg, scaling = cfg.rank_and_scaling(module)
    _check_rank(name, ka, a.shape[1], r_cfg)
    _put_experts(name, out, targets, prefix, which, a.expand(E, -1, -1), b.expand(E, -1, -1), scaling, ka, kb)


def _put_experts(name, out, targets, prefix, which, a3, b3, scaling, ka, kb) -> None:
    if which == "down_proj":
        _put(name, out, targets, f"{prefix}.down_proj", ModuleLoRA(a3.contiguous(), b3.contiguous(), scaling), ka, kb)
        return
    inter = targets[f"{prefix}.gate_proj"].out_features
    if b3.shape[1] != 2 * inter:
        raise AdapterError(name, f"gate_up lora_B must have 2*I = {2 * inter} outputs, found {list(b3.shape)}", kb)
    # gate and up share A; each takes its half of B's rows (gate first, as in gate_up_proj)
    _put(name, out, targets, f"{prefix}.gate_proj", ModuleLoRA(a3.contiguous(), b3[:, :inter].contiguous(), scaling), ka, kb)
    _put(name, out, targets, f"{prefix}.up_proj", ModuleLoRA(a3.contiguous(), b3[:, inter:].contiguous(), scaling), ka, kb)


def _stack_experts(name, canon: str, experts: dict[int, tuple[str, ModuleLoRA]], targets) -> ModuleLoRA:
    """Per-expert 2-D factors -> [E, r_max, in] / [E, out, r_max]; experts without LoRA stay zero;
    differing scalings are folded into B so one scaling serves the stack."""
    t = _target(name, targets, canon, next(iter(experts.values()))[0])
    E = t.num_experts
    bad = [e for e in experts if e >= E]
    if bad:
        raise AdapterError(name, f"expert index {bad[0]} out of range: the base model has {E} experts", experts[bad[0]][0])
    r = max(m.rank for _, m in experts.values())
    a = torch.zeros(E, r, t.in_features)
    b = torch.zeros(E, t.out_features, r)
    scalings = {m.scaling for _, m in experts.values()}
    scaling = scalings.pop() if len(scalings) == 1 else 1.0
    for e, (key, m) in experts.items():
        if m.a.shape[1] != t.in_features:
            raise AdapterError(name, f"expected lora_A [{m.rank}, {t.in_features}] for {canon}, found {list(m.a.shape)}", key)
        if m.b.shape[0] != t.out_features:
            raise AdapterError(name, f"expected lora_B [{t.out_features}, {m.rank}] for {canon}, found {list(m.b.shape)}", key)
        a[e, : m.rank] = m.a
        b[e, :, : m.rank] = m.b * (m.scaling / scaling)
    return ModuleLoRA(a, b, scaling)
