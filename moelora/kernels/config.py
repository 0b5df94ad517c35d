"""The one frozen kernel configuration: every tuning and kernel choice, built once from the engine's arguments
(`EngineArgs.kernel_config`, `--kernel-config JSON`) and handed to the model when it is built
(`layers.configure.configure_kernels`). Nothing reads an environment variable for a kernel choice, and no kernel
re-derives a choice at call time: each layer picks its backends from this object when it is configured.

Each area owns a section (its own frozen dataclass, beside its kernels); `KernelConfig.from_dict` and
`with_overrides` parse strictly (an unknown key or a value of the wrong type is an error naming it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from moelora.kernels.lora.config import DenseLoRAConfig
from moelora.kernels.moe.config import MoEConfig
from moelora.kernels.moe_lora.config import MoELoRAConfig
from moelora.kernels.quant.config import FP8Config


@dataclass(frozen=True)
class KernelConfig:
    """side_stream_priority: "high" (the routed-expert LoRA and shared experts' stream gets SMs first) or
    "normal"."""

    side_stream_priority: str = "high"
    moe: MoEConfig = field(default_factory=MoEConfig)
    moe_lora: MoELoRAConfig = field(default_factory=MoELoRAConfig)
    dense_lora: DenseLoRAConfig = field(default_factory=DenseLoRAConfig)
    fp8: FP8Config = field(default_factory=FP8Config)

    def __post_init__(self) -> None:
        if self.side_stream_priority not in ("high", "normal"):
            raise ValueError(f"kernel config side_stream_priority: 'high' or 'normal', got {self.side_stream_priority!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "KernelConfig":
        """{"moe_lora": {"early": false, "grouped_min_pairs": 1024}} -> KernelConfig; None or {}: the
        defaults. Unknown keys and values of the wrong type are errors naming the key."""
        return _build(cls, d or {}, "")

    @classmethod
    def from_json(cls, text: str | None) -> "KernelConfig":
        """--kernel-config's JSON object (None or empty: the defaults)."""
        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kernel-config is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--kernel-config must be a JSON object, got {text!r}")
        return cls.from_dict(d)

    def with_overrides(self, items: dict[str, str]) -> "KernelConfig":
        """A copy with dotted keys set from strings ({"moe_lora.grouped": "0", "fp8.lora_pdl": "1"}), as
        `bench decode --ab` writes them; each value parsed as its field's type."""
        d = self.to_dict()
        for key, raw in items.items():
            node, parts = d, key.split(".")
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    raise ValueError(f"kernel config: no section {p!r} in {key!r} (sections: {_sections()})")
                node = node[p]
            if parts[-1] not in node or isinstance(node[parts[-1]], dict):
                raise ValueError(f"kernel config: no field {key!r} (fields: {', '.join(field_names())})")
            node[parts[-1]] = _parse_scalar(key, raw, type(node[parts[-1]]))
        return KernelConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def diff(self, other: "KernelConfig | None" = None) -> dict[str, Any]:
        """The dotted fields where self differs from other (default: the defaults), for a benchmark row."""
        a, b = _flat(self.to_dict()), _flat((other or KernelConfig()).to_dict())
        return {k: v for k, v in a.items() if b.get(k) != v}


def field_names() -> list[str]:
    """Every field as a dotted name ("side_stream_priority", "moe_lora.grouped_min_pairs", ...)."""
    return sorted(_flat(KernelConfig().to_dict()))


def _sections() -> str:
    return ", ".join(f.name for f in dataclasses.fields(KernelConfig) if dataclasses.is_dataclass(f.default_factory))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _parse_scalar(key: str, raw: str, typ: type) -> Any:
    if typ is bool:
        if raw.lower() in ("1", "true", "on"):
            return True
        if raw.lower() in ("0", "false", "off"):
            return False
        raise ValueError(f"kernel config {key}: expected 0/1 or true/false, got {raw!r}")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"kernel config {key}: expected an integer, got {raw!r}") from None
    return raw


def _build(cls, d: dict[str, Any], prefix: str):
    if not isinstance(d, dict):
        raise ValueError(f"kernel config {prefix.rstrip('.') or 'root'}: expected an object, got {d!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in known:
            raise ValueError(f"kernel config: unknown field {prefix + key!r} (fields: {', '.join(sorted(known))})")
        default = known[key].default if known[key].default is not dataclasses.MISSING else known[key].default_factory()
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value, f"{prefix}{key}.")
            continue
        want = type(default)
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise ValueError(f"kernel config {prefix + key}: expected {want.__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)
