"""Per-batch LoRA metadata, built once per forward and read by every LoRA-carrying layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """Which slot each token of a flat batch uses.

    token_slots: [T] int32 on the model's device, -1 = no adapter (base only)
    sorted_token_ids: [T] int64, token indices grouped by slot (base tokens last)
    slot_ids: host list of the distinct slots >= 0 present, ascending
    slot_starts: host list, len(slot_ids) + 1: slot_ids[j] owns sorted_token_ids[slot_starts[j]:slot_starts[j+1]]
    single_slot: the one slot every LoRA token maps to, or None (several slots, or none)
    has_lora: False when no token uses an adapter: layers then do no LoRA work at all
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    slot_ids: list[int]
    slot_starts: list[int]
    single_slot: int | None
    has_lora: bool

    @classmethod
    def build(cls, token_slots: list[int] | torch.Tensor, max_loras: int, device: torch.device | str = "cpu") -> "LoRABatch":
        """token_slots: per token, a slot in [0, max_loras) or -1."""
        host = torch.as_tensor(token_slots, dtype=torch.int32).cpu()
        if host.numel() and (int(host.max()) >= max_loras or int(host.min()) < -1):
            raise ValueError(f"token slot out of range [-1, {max_loras}): found {host.min()}..{host.max()}")
        # base tokens (-1) sort last: key = slot, with -1 mapped past every real slot
        key = torch.where(host < 0, torch.full_like(host, max_loras), host)
        order = torch.argsort(key, stable=True)
        slot_ids, counts = torch.unique(host[host >= 0], return_counts=True)
        starts = [0]
        for c in counts.tolist():
            starts.append(starts[-1] + c)
        ids = slot_ids.tolist()
        return cls(
            token_slots=host.to(device),
            sorted_token_ids=order.to(device),
            slot_ids=ids,
            slot_starts=starts,
            single_slot=ids[0] if len(ids) == 1 else None,
            has_lora=len(ids) > 0,
        )

    @classmethod
    def empty(cls, num_tokens: int, max_loras: int, device: torch.device | str = "cpu") -> "LoRABatch":
        return cls.build([-1] * num_tokens, max_loras, device)
