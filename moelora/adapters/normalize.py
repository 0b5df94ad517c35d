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


def normalize_adapter(name: str, groups: dict[str, dict[str, tuple[str, torch.Tensor]]], cfg: PeftLoraConfig,
                      targets: dict[str, LoRATarget], max_lora_rank: int) -> dict[str, ModuleLoRA]:
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
            target_name, e = f"{m[1]}.{_MIXTRAL.get(m[3], m[3])}", int(m[2])
            t = _target(name, targets, target_name, ka)
            if t.num_experts is None:
                raise AdapterError(name, f"per-expert LoRA for {target_name}, but that base module has no experts", ka)
            if e >= t.num_experts:
                raise AdapterError(name, f"expert index {e} out of range: the base model has {t.num_experts} experts "
                                         f"(0..{t.num_experts - 1})", ka)
            mod = _module_lora(name, cfg, module, module, t, ka, a, kb, b)
            experts = per_expert.setdefault(target_name, {})
            if e in experts:
                raise AdapterError(name, f"expert {e} of {target_name} is given twice (also by {experts[e][0]!r})", ka)
            experts[e] = (ka, mod)
        elif m := re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", canon):
            _from_3d(name, m[1], m[2], module, ka, a, kb, b, cfg, targets, out)
        elif m := re.fullmatch(r"(.*\.mlp\.experts)(?:\.base_layer)*", canon):
            _from_target_parameters(name, m[1], ka, a, kb, b, cfg, targets, out)
        else:
            t = _target(name, targets, canon, ka)
            if t.num_experts is not None:
                raise AdapterError(name, f"LoRA for the routed experts {canon} needs per-expert keys "
                                         "(experts.<e>.<proj>) or PEFT target_parameters on the fused experts", ka)
            _put(name, out, targets, canon, _module_lora(name, cfg, module, canon, t, ka, a, kb, b), ka, kb)
    for canon, experts in per_expert.items():
        key = next(iter(experts.values()))[0]
        _put(name, out, targets, canon, _stack_experts(name, canon, experts, targets), key, key)
    for canon, mod in out.items():
        if mod.rank > max_lora_rank:
            raise AdapterError(name, f"rank {mod.rank} on {canon} is above max_lora_rank={max_lora_rank}; "
                                     f"restart with --max-lora-rank {1 << (mod.rank - 1).bit_length()} or more")
    return out


def _module_lora(name, cfg, module: str, shown: str, t: LoRATarget, ka, a, kb, b) -> ModuleLoRA:
    """2-D factors A [r, in], B [out, r] of one weight (`module` in the adapter's keys), checked against target t
    and the rank adapter_config.json gives it: an error names the tensor at fault, the expected shape and the found."""
    r, scaling = cfg.rank_and_scaling(module)
    for key, f, ab, expected in ((ka, a, "A", [r, t.in_features]), (kb, b, "B", [t.out_features, r])):
        if list(f.shape) != expected:
            raise AdapterError(name, f"expected shape {expected} for lora_{ab} of {shown} (rank {r} from "
                                     f"adapter_config.json, sizes from the base model), found {list(f.shape)}", key)
    return ModuleLoRA(a, b, scaling)


def _target(name: str, targets: dict[str, LoRATarget], canon: str, key: str) -> LoRATarget:
    t = targets.get(canon)
    if t is None:
        kinds = sorted({n.split(".", 3)[-1] for n in targets})
        layers = sum(1 for n in targets if n.endswith(".o_proj"))
        raise AdapterError(name, f"targets module {canon!r}, which this base model does not have ({layers} layers; "
                                 f"LoRA targets per layer: {', '.join(kinds)})", key)
    return t


def _put(name, out, targets, canon: str, mod: ModuleLoRA, ka: str, kb: str) -> None:
    t = _target(name, targets, canon, ka)
    if canon in out:
        raise AdapterError(name, f"LoRA for {canon} is given twice (two layouts for the same weights, e.g. "
                                 "per-expert keys next to fused target_parameters ones); expected one", ka)
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


def _from_target_parameters(name, prefix, ka, a, kb, b, cfg, targets, out) -> None:
    """A [r*E, in], B [out, r*E] with columns j*E + e; gate_up vs down decided by shapes (and the config's rank)."""
    gate, down = _expert_targets(name, targets, prefix, ka)
    E, H, I = gate.num_experts, gate.in_features, gate.out_features
    layouts = {}  # which -> (expected A, expected B, r, scaling)
    for which, in_w, out_w in (("gate_up_proj", H, 2 * I), ("down_proj", I, H)):
        r, scaling = cfg.rank_and_scaling(f"{prefix}.{which}")
        layouts[which] = ([r * E, in_w], [out_w, r * E], r, scaling)
    fa, fb = list(a.shape), list(b.shape)
    fits = [w for w, (ea, eb, _, _) in layouts.items() if fa == ea and fb == eb]
    if not fits:
        # one factor fits a layout: the other one is at fault
        half = [(w, ea, eb, r) for w, (ea, eb, r, _) in layouts.items() if fa == ea or fb == eb]
        if len(half) == 1:
            w, ea, eb, r = half[0]
            key, exp, found, ab = (kb, eb, fb, "B") if fa == ea else (ka, ea, fa, "A")
            raise AdapterError(name, f"expected shape {exp} for lora_{ab} of the fused experts' {w} ({prefix}: "
                                     f"rank {r} from adapter_config.json x {E} experts, sizes from the base model), "
                                     f"found {found}", key)
        expected = "; ".join(f"{w}: lora_A {ea}, lora_B {eb} (rank {r})" for w, (ea, eb, r, _) in layouts.items())
        raise AdapterError(name, f"fused-expert LoRA on {prefix} fits neither layout the base model and "
                                 f"adapter_config.json give ({expected}): found lora_A {fa}, lora_B {fb} (A and B "
                                 "swapped, a transposed tensor, or an adapter for another base model?)", ka)
    which = fits[0]
    r, scaling = layouts[which][2], layouts[which][3]
    a3 = a.reshape(E, r, a.shape[1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], r, E).permute(2, 0, 1).contiguous()  # [E, out, r]
    _put_experts(name, out, targets, prefix, which, a3, b3, scaling, ka, kb)


def _from_3d(name, prefix, which, module, ka, a, kb, b, cfg, targets, out) -> None:
    """A [E|1, r, in], B [E|1, out, r]; an expert dim of 1 is shared by all experts."""
    gate, _ = _expert_targets(name, targets, prefix, ka)
    E, H, I = gate.num_experts, gate.in_features, gate.out_features
    in_w, out_w = (H, 2 * I) if which == "gate_up_proj" else (I, H)
    r, scaling = cfg.rank_and_scaling(module)
    for key, t, ab, exp in ((ka, a, "A", [r, in_w]), (kb, b, "B", [out_w, r])):
        if t.dim() != 3 or t.shape[0] not in (1, E) or list(t.shape[1:]) != exp:
            raise AdapterError(name, f"expected shape {[E, *exp]} (or {[1, *exp]} for a factor shared by all "
                                     f"experts) for lora_{ab} of {module} (rank {r} from adapter_config.json, sizes "
                                     f"from the base model), found {list(t.shape)}", key)
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
    t = targets[canon]  # target, expert indices and per-expert shapes were checked when read
    E = t.num_experts
    r = max(m.rank for _, m in experts.values())
    a = torch.zeros(E, r, t.in_features)
    b = torch.zeros(E, t.out_features, r)
    scalings = {m.scaling for _, m in experts.values()}
    scaling = scalings.pop() if len(scalings) == 1 else 1.0
    for e, (_, m) in experts.items():
        a[e, : m.rank] = m.a
        b[e, :, : m.rank] = m.b * (m.scaling / scaling)
    return ModuleLoRA(a, b, scaling)
