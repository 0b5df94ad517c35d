"""Read a PEFT LoRA directory: adapter_config.json (ranks, alphas, rsLoRA, rank/alpha patterns)
and the weight file, grouped by module. Layout normalization is in normalize.py."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch

from moelora.adapters.errors import AdapterError

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True)
class PeftLoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_and_scaling(self, module_name: str) -> tuple[int, float]:
        """PEFT's rule: the first pattern key k with re.match(rf'(.*\\.)?({k})$', name) overrides r / alpha."""
        r = _pattern_value(self.rank_pattern, module_name, self.r)
        alpha = _pattern_value(self.alpha_pattern, module_name, self.lora_alpha)
        return int(r), float(alpha) / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


_MISSING = object()
_PEFT_DEFAULT_ALPHA = 8


def _positive_int(name: str, file: str, what: str, value: Any) -> int:
    if value is _MISSING:
        raise AdapterError(name, f"{file}: {what} is missing; expected a positive integer (the LoRA rank)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise AdapterError(name, f"{file}: {what} must be a positive integer, found {type(value).__name__} {value!r}")
    if value <= 0:
        raise AdapterError(name, f"{file}: {what} must be a positive integer, found {value!r}")
    return value


def _finite_number(name: str, file: str, what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(name, f"{file}: {what} must be a finite number, found {type(value).__name__} {value!r}")
    return float(value)


CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # the first present is read


@dataclass(frozen=True)
class AdapterFiles:
    """The bytes of one PEFT adapter folder, read once: every later step parses these, never the files again.
    digest: sha256 over the config's and the weights' bytes — the adapter's content identity (two folders with
    the same files share it; the same folder rewritten does not)."""

    folder: str
    config_file: str
    config: bytes
    weights_file: str
    weights: bytes

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.config, os.path.basename(self.weights_file).encode(), self.weights):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()


def _under(path: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([path, r]) == r for r in roots)


def _read_file(name: str, file: str, roots: list[str] | None) -> bytes:
    """The bytes of `file`. With `roots`, the file actually opened (every symlink resolved) must lie under one of
    them, and must be a regular file (not a FIFO or a device)."""
    real = os.path.realpath(file)
    if roots is not None and not _under(real, [os.path.realpath(r) for r in roots]):
        raise AdapterError(name, f"{file!r} resolves to {real!r}, outside the allowed --lora-root {roots}")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise AdapterError(name, f"cannot open {file!r}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise AdapterError(name, f"{file!r} is not a regular file")
        return f.read()


def read_files(name: str, path: str, roots: list[str] | None = None) -> AdapterFiles:
    """Read adapter_config.json and the weight file of the PEFT folder `path` (see _read_file for `roots`)."""
    if "\x00" in path:
        raise AdapterError(name, f"adapter path {path!r} contains a NUL byte")
    if not os.path.isdir(path):
        raise AdapterError(name, f"adapter folder {path!r} does not exist or is not a folder")
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise AdapterError(name, f"{config_file} is missing: a PEFT adapter folder holds {CONFIG_FILE}")
    config = _read_file(name, config_file, roots)
    for w in WEIGHT_FILES:
        weights_file = os.path.join(path, w)
        if os.path.isfile(weights_file):
            return AdapterFiles(path, config_file, config, weights_file, _read_file(name, weights_file, roots))
    raise AdapterError(name, f"no adapter_model.safetensors (or adapter_model.bin) in {path!r}")


def parse_config(name: str, files: AdapterFiles) -> PeftLoraConfig:
    """adapter_config.json of the adapter, parsed and checked."""
    file = files.config_file
    try:
        raw = json.loads(files.config.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(name, f"{file} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterError(name, f"{file} must hold a JSON object, found {type(raw).__name__}")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type is {peft_type!r}; moelora serves LoRA adapters only")
    if raw.get("use_dora"):
        raise AdapterError(name, "use_dora is true: DoRA adapters are not supported (retrain without DoRA or merge it)")
    if raw.get("lora_bias"):
        raise AdapterError(name, "lora_bias is true: LoRA with a trained bias on lora_B is not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save={raw['modules_to_save']} stores full copies of base modules; only "
                                 "LoRA weights can be served per request (this includes adapters that resize "
                                 "embeddings or the LM head)")
    if raw.get("trainable_token_indices"):
        raise AdapterError(name, "trainable_token_indices is set: adapters that add or retrain tokens are not supported")
    r = _positive_int(name, file, "'r'", raw.get("r", _MISSING))
    # PEFT's LoraConfig default when the field is absent is lora_alpha=8 (not alpha = r)
    alpha = _finite_number(name, file, "'lora_alpha'", raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA))
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = raw.get(key) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(name, f"{file}: {key!r} must be an object of regex -> number, found "
                                     f"{type(patterns).__name__} {patterns!r}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise AdapterError(name, f"{file}: {key!r} key {pattern!r} is not a valid regex ({e})") from e
            check = _positive_int if key == "rank_pattern" else _finite_number
            check(name, file, f"{key!r} value for {pattern!r}", value)
    return PeftLoraConfig(r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)),
                          rank_pattern=dict(raw.get("rank_pattern") or {}),
                          alpha_pattern=dict(raw.get("alpha_pattern") or {}))


def parse_tensors(name: str, files: AdapterFiles) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, else the older adapter_model.bin (a torch.save'd dict of tensors)."""
    try:
        if files.weights_file.endswith(".safetensors"):
            return safetensors.torch.load(files.weights)
        return _load_bin(files.weights)
    except Exception as e:  # safetensors and torch raise many types for a corrupt file
        raise AdapterError(name, f"cannot read the weights in {files.weights_file!r}: {e}") from e


def _load_bin(data: bytes) -> dict[str, torch.Tensor]:
    obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ValueError(f"expected a dict of tensors (tensor name -> tensor), found {type(obj).__name__}")
    return obj


def group_lora_tensors(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """key 'base_model.model.<module>.lora_A.weight' -> {module: {'A': (key, t), 'B': (key, t)}}.
    Anything that is not a LoRA A/B factor is refused with the reason."""
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        if "lora_magnitude_vector" in key:
            raise AdapterError(name, "DoRA magnitude vector found: DoRA adapters are not supported", key)
        if "lora_embedding_" in key:
            raise AdapterError(name, "LoRA on an embedding layer is not supported (adapters may not change embeddings)", key)
        m = _LORA_KEY.match(key)
        if m is None:
            raise AdapterError(name, "not a LoRA factor: the adapter stores other weights (new tokens, resized "
                                     "embeddings or modules_to_save), which cannot be served per request", key)
        module = m[1][len(_PREFIX):] if m[1].startswith(_PREFIX) else m[1]
        groups.setdefault(module, {})[m[2]] = (key, t)
    for module, ab in groups.items():
        if len(ab) != 2:
            have = next(iter(ab.values()))[0]
            raise AdapterError(name, f"module {module!r} has lora_{next(iter(ab))} but no lora_{'B' if 'A' in ab else 'A'}", have)
    return groups
