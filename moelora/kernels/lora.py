"""Dense multi-LoRA: shrink (x @ A[slot]^T) and expand (+= scaling[slot] * h @ B[slot]^T) for a
mixed batch, over the slices of a fused weight (qkv: 3 slices, gate_up: 2, others: 1).

Slot buffers are zero beyond each slot's true rank; `ranks` lets an implementation skip that
padding and skip (slot, slice) pairs with rank 0 entirely, so they add exactly nothing.
"""

import torch


def lora_shrink_ref(
    x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, ranks: list[list[int]], out: torch.Tensor
) -> None:
    """Semantics:
        for i in range(n): for t in range(T):
            if token_slots[t] >= 0: out[i, t] = x[t] @ a[i, token_slots[t]].T   (rows of other tokens untouched)
    x: [T, H] · a: [n, S, R, H] · token_slots: [T] int32 (-1 = no adapter) · ranks: host [n][S]
    out: [n, T, R] (written in place; columns past a slot's rank are set to 0)
    """
    for s in _slots_present(token_slots):
        rows = (token_slots == s).nonzero().squeeze(1)
        for i in range(a.shape[0]):
            r = ranks[i][s]
            out[i, rows] = 0
            if r:
                out[i, rows, :r] = x[rows] @ a[i, s, :r].T


def lora_expand_ref(
    h: torch.Tensor,
    b: list[torch.Tensor],
    token_slots: torch.Tensor,
    scaling: torch.Tensor,
    ranks: list[list[int]],
    y: torch.Tensor,
) -> None:
    """Semantics (slice i occupies columns off_i : off_i + O_i of y, in slice order):
        for i in range(n): for t in range(T):
            s = token_slots[t]
            if s >= 0 and ranks[i][s] > 0: y[t, off_i:off_i+O_i] += scaling[i, s] * (h[i, t] @ b[i][s].T)
    h: [n, T, R] · b: n tensors [S, O_i, R] · token_slots: [T] int32 · scaling: [n, S] fp32
    ranks: host [n][S] · y: [T, sum(O_i)] updated in place
    """
    for s in _slots_present(token_slots):
        rows = (token_slots == s).nonzero().squeeze(1)
        off = 0
        for i, bi in enumerate(b):
            o, r = bi.shape[1], ranks[i][s]
            if r:
                delta = (h[i, rows, :r] @ bi[s, :, :r].T) * scaling[i, s].to(h.dtype)
                y[rows, off : off + o] += delta.to(y.dtype)
            off += o


def _slots_present(token_slots: torch.Tensor) -> list[int]:
    return [s for s in torch.unique(token_slots).tolist() if s >= 0]
