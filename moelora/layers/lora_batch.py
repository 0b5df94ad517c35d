"""Per-batch LoRA metadata, built once per forward and read by every LoRA-carrying layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels.lora.groups import SlotGroups


@dataclass
class LoRABatch:
    """Which slot each token of a flat batch uses.

    groups: the device-side index the kernels read (token -> slot, tokens grouped by slot, per-group
    slot/count/start); see moelora.kernels.lora.groups.SlotGroups
    slot_ids: host list of the distinct slots >= 0 present, ascending
    single_slot: the one slot every LoRA token maps to, or None (several slots, or none)
    all_lora: every token of the batch uses an adapter (no base rows)
    has_lora: False when no token uses an adapter: layers then do no LoRA work at all
    skip_dense / skip_experts (CUDA-graph batches only): the graph of a batch whose adapters adapt no dense
    weight (attention, shared experts, dense MLPs) / no routed expert leaves those layers' LoRA kernels out"""

    groups: SlotGroups
    slot_ids: list[int]
    single_slot: int | None
    all_lora: bool
    has_lora: bool
    graph: bool = False  # CUDA-graph batch: static buffers, every LoRA layer runs its kernels (they read ranks on the device)
    skip_dense: bool = False
    skip_experts: bool = False

    @property
    def token_slots(self) -> torch.Tensor:
        return self.groups.token_slots

    @classmethod
    def build(cls, token_slots: list[int] | torch.Tensor, max_loras: int, device: torch.device | str = "cpu") -> "LoRABatch":
        """token_slots: per token, a slot in [0, max_loras) or -1."""
        host = _checked_slots(token_slots, max_loras)
        groups = SlotGroups.build(host, max_loras, device)
        ids = groups.slot_ids
        return cls(groups=groups, slot_ids=ids, single_slot=ids[0] if len(ids) == 1 else None,
                   all_lora=bool(host.numel()) and bool((host >= 0).all()), has_lora=len(ids) > 0)

    @classmethod
    def static(cls, num_tokens: int, max_loras: int, device: torch.device | str) -> "LoRABatch":
        """Buffers for a CUDA-graph batch of num_tokens rows, refreshed in place by update_static()."""
        b = cls.build([-1] * num_tokens, max_loras, device)
        b.graph, b.has_lora, b.single_slot, b.all_lora = True, True, None, False
        return b

    def update_static(self, token_slots: list[int] | torch.Tensor, max_loras: int) -> None:
        """Write a new batch's slots (padded with -1 to this batch's size) into the graph's buffers: every row, so no
        slot of an earlier batch stays in a padding row. ValueError for a slot outside [-1, max_loras) or a length
        other than the buffers' (a graph reads whatever its buffers hold: nothing else would catch it)."""
        host = _checked_slots(token_slots, max_loras)
        rows = self.groups.token_slots.shape[0]
        if host.shape[0] != rows:
            raise ValueError(f"update_static: this graph batch has {rows} rows (pad with -1 to it); found "
                             f"{host.shape[0]} token slots")
        src = SlotGroups.build(host, max_loras, "cpu")
        g = self.groups
        for name in ("token_slots", "sorted_token_ids", "active_slots", "slot_counts", "slot_starts"):
            getattr(g, name).copy_(getattr(src, name), non_blocking=True)
        g.slot_ids, g.counts = src.slot_ids, src.counts
        self.slot_ids = src.slot_ids

    @classmethod
    def every_slot(cls, num_tokens: int, max_loras: int, device: torch.device | str) -> "LoRABatch":
        """Tokens spread round-robin over every slot, each LoRA kernel run whatever the slots hold (as in a captured
        graph): the profiling and warm-up forwards. max_loras 0: no LoRA."""
        b = cls.build([t % max_loras if max_loras else -1 for t in range(num_tokens)], max(max_loras, 1), device)
        b.graph = bool(max_loras)
        return b

    @classmethod
    def empty(cls, num_tokens: int, max_loras: int, device: torch.device | str = "cpu") -> "LoRABatch":
        return cls.build([-1] * num_tokens, max_loras, device)


def _checked_slots(token_slots: list[int] | torch.Tensor, max_loras: int) -> torch.Tensor:
    """token_slots as int32 on the host, each in [-1, max_loras) (ValueError naming the range otherwise)."""
    host = torch.as_tensor(token_slots, dtype=torch.int32).cpu()
    if host.numel() and (int(host.max()) >= max_loras or int(host.min()) < -1):
        raise ValueError(f"token slot out of range [-1, {max_loras}): found {int(host.min())}..{int(host.max())}")
    return host
