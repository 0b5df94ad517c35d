"""Adapter registry: adapters by name, held on the CPU in normalized form, loaded and unloaded at run time."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from moelora.adapters.errors import AdapterError
from moelora.adapters.normalize import ModuleLoRA, normalize_adapter
from moelora.adapters.peft_format import group_lora_tensors, read_config, read_tensors
from moelora.layers.lora import LoRATarget


@dataclass
class LoRAAdapter:
    """A validated adapter: canonical target name -> factors (A [(E,) r, in], B [(E,) out, r], scaling)."""

    name: str
    path: str
    modules: dict[str, ModuleLoRA]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def load_adapter(name: str, path: str, targets: dict[str, LoRATarget], max_lora_rank: int) -> LoRAAdapter:
    """Read, normalize and validate a PEFT LoRA folder; raises AdapterError naming what is wrong."""
    cfg = read_config(name, path)
    groups = group_lora_tensors(name, read_tensors(name, path))
    if not groups:
        raise AdapterError(name, f"{path!r} holds no LoRA weights")
    modules = normalize_adapter(name, groups, cfg, targets, max_lora_rank)
    return LoRAAdapter(name=name, path=path, modules=modules)


class AdapterRegistry:
    """Name -> LoRAAdapter (CPU). A failed load leaves the registry as it was. With `max_cpu_loras`,
    the least recently used adapter is dropped from the CPU cache and re-read from its path when needed."""

    def __init__(self, targets: dict[str, LoRATarget], max_lora_rank: int, max_cpu_loras: int | None = None) -> None:
        self.targets = targets
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._paths: dict[str, str] = {}
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._in_memory: set[str] = set()  # registered from memory: never dropped from the cache

    def load(self, name: str, path: str) -> LoRAAdapter:
        if not name or not isinstance(name, str):
            raise AdapterError(str(name), "an adapter needs a non-empty name")
        with self._lock:
            self._check_free(name)
        adapter = load_adapter(name, path, self.targets, self.max_lora_rank)
        with self._lock:
            self._check_free(name)  # again: another load of this name may have finished while this one read its files
            self._paths[name] = path
            self._remember(adapter)
        return adapter

    def _check_free(self, name: str) -> None:
        if name in self._paths:
            raise AdapterError(name, f"an adapter of this name is already loaded (from {self._paths[name]!r}); unload it first")

    def register(self, adapter: LoRAAdapter) -> None:
        """Add an adapter built in memory (benchmarks, conversions); it cannot be re-read from disk, so it is
        never dropped from the CPU cache."""
        with self._lock:
            self._check_free(adapter.name)
            self._paths[adapter.name] = adapter.path
            self._cache[adapter.name] = adapter
            self._in_memory.add(adapter.name)

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise KeyError(f"adapter {name!r} is not loaded; loaded: {sorted(self._paths)}")
            del self._paths[name]
            self._cache.pop(name, None)
            self._in_memory.discard(name)

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            if name not in self._paths:
                raise KeyError(f"adapter {name!r} is not loaded; loaded: {sorted(self._paths)}")
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
            path = self._paths[name]
        adapter = load_adapter(name, path, self.targets, self.max_lora_rank)
        with self._lock:
            self._remember(adapter)
        return adapter

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    @property
    def names(self) -> list[str]:
        return list(self._paths)

    def path(self, name: str) -> str:
        return self._paths[name]

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._cache[adapter.name] = adapter
        self._cache.move_to_end(adapter.name)
        keep = self._in_memory
        while self.max_cpu_loras and len(self._cache) > self.max_cpu_loras:
            victim = next((n for n in self._cache if n not in keep), None)
            if victim is None:
                break
            del self._cache[victim]
