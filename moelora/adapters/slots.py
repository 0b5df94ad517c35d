"""Slot pool: which adapter sits in which of the model's `max_loras` LoRA slots.

Loading writes every target's slice of the slot (zeroing targets the adapter lacks, so a stale
adapter's weights can never leak). Eviction takes the least recently used adapter that no running
request holds and that is not pinned; an adapter in use is never evicted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from moelora.adapters.registry import LoRAAdapter
from moelora.layers.lora import LoRATarget


log = logging.getLogger("moelora.adapters")


class NoFreeSlot(RuntimeError):
    pass


def write_slot(targets: dict[str, LoRATarget], adapter: LoRAAdapter, slot: int) -> None:
    """Write every target's slice of `slot`: the adapter's factors, or zeros where it has none."""
    for name, t in targets.items():
        mod = adapter.modules.get(name)
        if mod is None:
            t.weights.clear(t.slice_idx, slot)
        else:
            t.weights.set_slot(t.slice_idx, slot, mod.a, mod.b, mod.scaling)


def clear_slot(targets: dict[str, LoRATarget], slot: int) -> None:
    for t in targets.values():
        t.weights.clear(t.slice_idx, slot)


class SlotPool:
    def __init__(self, targets: dict[str, LoRATarget], max_loras: int,
                 on_change: Callable[[int, str | None], None] | None = None) -> None:
        """on_change(slot, adapter name or None): called after a slot is written or cleared (tensor/expert
        parallelism: the other ranks repeat the same writes into their shards)."""
        self.targets, self.max_loras, self.on_change = targets, max_loras, on_change
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._refs: dict[str, int] = {}
        self._pinned: set[str] = set()
        self.counters = {"slot_loads": 0, "slot_evictions": 0}  # adapters written into a slot; evicted from one

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)

    def refcount(self, name: str) -> int:
        return self._refs.get(name, 0)

    def can_acquire(self, name: str) -> bool:
        return name in self._slot_of or len(self._slot_of) < self.max_loras or self._victim() is not None

    def acquire(self, adapter: LoRAAdapter) -> int:
        """Make `adapter` resident (loading or evicting as needed), take a reference, return its slot."""
        return self.acquire_by_name(adapter.name, lambda _: adapter)

    def acquire_by_name(self, name: str, get: Callable[[str], LoRAAdapter]) -> int:
        """acquire() for the adapter `name`, calling get(name) for its factors only when no slot holds it (an
        adapter read again from disk may raise there: nothing has changed then)."""
        slot = self._slot_of.get(name)
        if slot is None:
            adapter = get(name)
            used = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = self._victim()
                if victim is None:
                    raise NoFreeSlot(f"all {self.max_loras} LoRA slots hold adapters in use or pinned; adapter "
                                     f"{name!r} must wait (or raise --max-loras)")
                slot = self._slot_of.pop(victim)
                self.counters["slot_evictions"] += 1
                log.info("adapter %r evicted from LoRA slot %d for %r", victim, slot, adapter.name)
            self._write(adapter, slot)
            self.counters["slot_loads"] += 1
            self._slot_of[name] = slot
        self._slot_of.move_to_end(name)
        self._refs[name] = self._refs.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        n = self._refs.get(name, 0)
        if n <= 0:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        self._refs[name] = n - 1

    def pin(self, adapter: LoRAAdapter) -> int:
        slot = self.acquire(adapter)
        self.release(adapter.name)
        self._pinned.add(adapter.name)
        return slot

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def evict(self, name: str) -> None:
        """Drop `name` from its slot (used by unload); refuses while requests hold it."""
        if self._refs.get(name, 0) > 0:
            raise RuntimeError(f"adapter {name!r} is in use by {self._refs[name]} running requests")
        slot = self._slot_of.pop(name, None)
        self._pinned.discard(name)
        if slot is not None:
            clear_slot(self.targets, slot)
            if self.on_change is not None:
                self.on_change(slot, None)

    def _victim(self) -> str | None:
        for name in self._slot_of:  # oldest first
            if self._refs.get(name, 0) == 0 and name not in self._pinned:
                return name
        return None

    def _write(self, adapter: LoRAAdapter, slot: int) -> None:
        write_slot(self.targets, adapter, slot)
        if self.on_change is not None:
            self.on_change(slot, adapter.name)
