"""Tokens grouped by LoRA slot: the device-side index every multi-LoRA kernel reads.

Fixed sizes (T tokens, max_loras groups) so the same buffers serve CUDA-graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotGroups:
    """token_slots: [T] int32 (-1 = no adapter) · sorted_token_ids: [T] int32, tokens grouped by slot
    (ascending slot, base tokens last) · active_slots: [L] int32, the slot of group l (-1 = unused group)
    slot_counts: [L] int32 tokens in group l · slot_starts: [L] int32 offset of group l in sorted_token_ids
    L = max_loras. Host copies: slot_ids (the distinct slots >= 0 present, ascending) and counts."""

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    active_slots: torch.Tensor
    slot_counts: torch.Tensor
    slot_starts: torch.Tensor
    slot_ids: list[int]
    counts: list[int]

    @classmethod
    def build(cls, token_slots: torch.Tensor, max_loras: int, device: torch.device | str = "cpu") -> "SlotGroups":
        """token_slots: [T] int32 on the host."""
        host = token_slots.to(torch.int32).cpu()
        key = torch.where(host < 0, torch.full_like(host, max_loras), host)
        order = torch.argsort(key, stable=True).to(torch.int32)
        ids, counts = torch.unique(host[host >= 0], return_counts=True)
        L = max(max_loras, 1)
        active = torch.full((L,), -1, dtype=torch.int32)
        cnt = torch.zeros(L, dtype=torch.int32)
        start = torch.zeros(L, dtype=torch.int32)
        active[: len(ids)] = ids.to(torch.int32)
        cnt[: len(ids)] = counts.to(torch.int32)
        if len(ids):
            start[1 : len(ids)] = torch.cumsum(counts, 0)[:-1].to(torch.int32)
        return cls(
            token_slots=host.to(device), sorted_token_ids=order.to(device), active_slots=active.to(device),
            slot_counts=cnt.to(device), slot_starts=start.to(device), slot_ids=ids.tolist(), counts=counts.tolist(),
        )
