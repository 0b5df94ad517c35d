"""Adapter registry: adapters by name, held on the CPU in normalized form, loaded and unloaded at run time."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from moelora.adapters.errors import AdapterError
from moelora.adapters.normalize import ModuleLoRA, normalize_adapter
from moelora.adapters.peft_format import group_lora_tensors, parse_config, parse_tensors, read_files
from moelora.layers.lora import LoRATarget

log = logging.getLogger("moelora.adapters")

MAX_NAME_LENGTH = 128
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]*")


def check_name(name: object) -> str:
    """An adapter name: 1-128 characters, letters, digits and . _ @ + - (no path separators, no ':'), starting
    with a letter or digit. Raises AdapterError otherwise."""
    if not isinstance(name, str) or not name:
        raise AdapterError(str(name), "an adapter needs a non-empty name")
    if len(name) > MAX_NAME_LENGTH:
        raise AdapterError(name[:40] + "...", f"the name has {len(name)} characters; at most {MAX_NAME_LENGTH}")
    if not NAME_PATTERN.fullmatch(name):
        raise AdapterError(name, "an adapter name may hold letters, digits and . _ @ + - only, and must start "
                                 "with a letter or digit")
    return name


@dataclass
class LoRAAdapter:
    """A validated adapter: canonical target name -> factors (A [(E,) r, in], B [(E,) out, r], scaling)."""

    name: str
    path: str
    modules: dict[str, ModuleLoRA]
    digest: str = ""  # sha256 of the adapter's files (AdapterFiles.digest); "" for adapters built in memory

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def load_adapter(name: str, path: str, targets: dict[str, LoRATarget], max_lora_rank: int,
                 roots: list[str] | None = None, digest: str | None = None) -> LoRAAdapter:
    """Read, normalize and validate a PEFT LoRA folder; raises AdapterError naming what is wrong.
    roots: the files opened must resolve under one of these folders. digest: the content the files must hold
    (an adapter read again after it left host memory); a folder changed since is refused."""
    files = read_files(name, path, roots)
    if digest is not None and files.digest != digest:
        raise AdapterError(name, f"the files in {path!r} changed since the adapter was loaded (content "
                                 f"{digest[:12]}, now {files.digest[:12]}); it is not served with other weights "
                                 "under the same name: unload it and load it again")
    cfg = parse_config(name, files)
    groups = group_lora_tensors(name, parse_tensors(name, files))
    if not groups:
        raise AdapterError(name, f"{path!r} holds no LoRA weights")
    modules = normalize_adapter(name, groups, cfg, targets, max_lora_rank)
    return LoRAAdapter(name=name, path=path, modules=modules, digest=files.digest)


@dataclass(frozen=True)
class _Source:
    """Where a registered adapter's files are, and what they held when it was loaded."""

    path: str
    digest: str
    roots: list[str] | None


class AdapterRegistry:
    """Name -> LoRAAdapter (CPU). A failed load leaves the registry as it was. With `max_cpu_loras`,
    the least recently used adapter is dropped from the CPU cache and re-read from its path when needed; the
    files read again must hold the same content (sha256) as at load, and lie under the same roots, or the read
    fails with an AdapterError naming the adapter (the request that needed it fails, nothing else).
    counters: loads (from files), reloads (read again after leaving host memory), unloads, cpu_evictions."""

    def __init__(self, targets: dict[str, LoRATarget], max_lora_rank: int, max_cpu_loras: int | None = None) -> None:
        self.targets, self.max_lora_rank, self.max_cpu_loras = targets, max_lora_rank, max_cpu_loras
        self._sources: dict[str, _Source] = {}  # every registered adapter, in registration order
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._in_memory: set[str] = set()  # registered from memory: never dropped from the cache
        self.counters = {"loads": 0, "reloads": 0, "unloads": 0, "cpu_evictions": 0, "load_failures": 0}

    def load(self, name: str, path: str, roots: list[str] | None = None) -> LoRAAdapter:
        """Read and register the adapter at `path` under `name`. roots: its files (symlinks resolved) must lie
        under one of these folders, now and whenever they are read again."""
        check_name(name)
        with self._lock:
            self._check_free(name)
        adapter = load_adapter(name, path, self.targets, self.max_lora_rank, roots)
        with self._lock:
            self._check_free(name)  # again: another load of this name may have finished while this one read its files
            self._sources[name] = _Source(path, adapter.digest, list(roots) if roots is not None else None)
            self._remember(adapter)
            self.counters["loads"] += 1
        log.info("adapter %r loaded from %s (max rank %d, %d target weights, content %s)", name, path,
                 adapter.max_rank, len(adapter.modules), adapter.digest[:12])
        return adapter

    def digest(self, name: str) -> str:
        """The content identity of a registered adapter: its files' sha256 (a fresh unique id for an adapter
        registered from memory)."""
        with self._lock:
            return self._sources[name].digest

    def _check_free(self, name: str) -> None:
        if name in self._sources:
            raise AdapterError(name, f"an adapter of this name is already loaded (from {self._sources[name].path!r}); "
                                     "unload it first")

    def register(self, adapter: LoRAAdapter) -> None:
        """Add an adapter built in memory (benchmarks, conversions); it cannot be re-read from disk, so it is
        never dropped from the CPU cache."""
        check_name(adapter.name)
        with self._lock:
            self._check_free(adapter.name)
            # an identity of its own: an adapter registered again under this name never passes for this one
            self._sources[adapter.name] = _Source(adapter.path, adapter.digest or f"memory:{uuid.uuid4().hex}", None)
            self._cache[adapter.name] = adapter
            self._in_memory.add(adapter.name)
            self.counters["loads"] += 1

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._sources:
                raise KeyError(f"adapter {name!r} is not loaded; loaded: {sorted(self._sources)}")
            del self._sources[name]
            self._cache.pop(name, None)
            self._in_memory.discard(name)
            self.counters["unloads"] += 1
        log.info("adapter %r unloaded", name)

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            if name not in self._sources:
                raise KeyError(f"adapter {name!r} is not loaded; loaded: {sorted(self._sources)}")
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
            src = self._sources[name]
        try:
            adapter = load_adapter(name, src.path, self.targets, self.max_lora_rank, src.roots, src.digest)
        except AdapterError as e:
            with self._lock:
                self.counters["load_failures"] += 1
            log.warning("adapter %r could not be read again: %s", name, e)
            raise
        with self._lock:
            if self._sources.get(name) is not src:  # unloaded (or replaced) while its files were read
                raise AdapterError(name, "the adapter was unloaded while it was read again")
            self._remember(adapter)
            self.counters["reloads"] += 1
        log.info("adapter %r read again from %s into host memory", name, src.path)
        return adapter

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    def path(self, name: str) -> str:
        return self._sources[name].path

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._cache[adapter.name] = adapter
        self._cache.move_to_end(adapter.name)
        keep = self._in_memory
        while self.max_cpu_loras and len(self._cache) > self.max_cpu_loras:
            victim = next((n for n in self._cache if n not in keep), None)
            if victim is None:
                break
            del self._cache[victim]
            self.counters["cpu_evictions"] += 1
            log.info("adapter %r evicted from host memory (--max-cpu-loras %d)", victim, self.max_cpu_loras)
