"""Dense multi-LoRA: shrink (x @ A[slot]^T) and expand (+= scaling[slot] * h @ B[slot]^T) for a
mixed batch, over the slices of a fused weight (qkv: 3 slices, gate_up: 2, others: 1).

Slot buffers are zero past each slot's true rank; `ranks` lets an implementation skip that padding
and skip (slice, slot) pairs of rank 0 entirely, so they add exactly nothing. Rows of tokens with
slot -1 are never touched. The Triton kernels (shrink_expand_triton.py) have these signatures too.
"""

from __future__ import annotations

import torch

from moelora.kernels.lora.groups import SlotGroups


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, groups: SlotGroups, out: torch.Tensor) -> None:
    """Semantics:
        for i in range(n): for t in range(T):
            s = token_slots[t]
            if s >= 0: out[i, t, :ranks[i, s]] = x[t] @ a[i, s, :ranks[i, s]].T   (other entries untouched)
    x: [T, H] · a: [n, S, R, H] · ranks: [n, S] int32 · groups: tokens grouped by slot
    out: [n, T, R], or the kernel's split-K partials [split_k, n, T, R]: the sum in out[0], zeros in out[1:]
    """
    rk = ranks.tolist()
    parts = out if out.dim() == 4 else out.unsqueeze(0)
    for s in groups.slot_ids:
        rows = (groups.token_slots == s).nonzero().squeeze(1)
        for i in range(a.shape[0]):
            r = rk[i][s]
            if r:
                parts[0, i, rows, :r] = (x[rows].float() @ a[i, s, :r].float().T).to(out.dtype)  # fp32, as the kernels
                parts[1:, i, rows, :r] = 0


def lora_expand_ref(h: torch.Tensor, b_cat: torch.Tensor, slice_offsets: torch.Tensor, ranks: torch.Tensor,
                    scaling: torch.Tensor, groups: SlotGroups, y: torch.Tensor) -> None:
    """Semantics (slice i owns columns o_i = slice_offsets[i] : slice_offsets[i+1] of y and rows o_i of b_cat):
        for i in range(n): for t in range(T):
            s = token_slots[t]; r = ranks[i, s]
            if s >= 0 and r > 0: y[t, o_i] += scaling[i, s] * (h[i, t, :r] @ b_cat[s, o_i, :r].T)
    h: [n, T, R], or split-K partials [split_k, n, T, R] (summed first) · b_cat: [S, O, R]
    slice_offsets: [n+1] int32 · ranks: [n, S] int32 · scaling: [n, S] fp32
    groups: tokens grouped by slot · y: [T, O] updated in place
    """
    if h.dim() == 4:
        h = h.sum(0)
    rk, off = ranks.tolist(), slice_offsets.tolist()
    for s in groups.slot_ids:
        rows = (groups.token_slots == s).nonzero().squeeze(1)
        for i in range(len(off) - 1):
            r = rk[i][s]
            if r:
                delta = (h[i, rows, :r].float() @ b_cat[s, off[i] : off[i + 1], :r].T.float()) * scaling[i, s]
                cols = slice(off[i], off[i + 1])
                y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)  # rounded once, as the kernels


def lora_single_slot(x: torch.Tensor, a: torch.Tensor, b_cat: torch.Tensor, slice_offsets: list[int],
                     ranks: list[list[int]], scaling: torch.Tensor, slot: int, rows: torch.Tensor | None,
                     y: torch.Tensor) -> None:
    """Fast path for a batch whose LoRA tokens all use one slot: plain matmuls (cuBLAS on a GPU).
    Semantics: for each slice i with r = ranks[i][slot] > 0, over the LoRA rows (all rows when rows is None):
        y[rows, o_i] += scaling[i, slot] * (x[rows] @ a[i, slot, :r].T) @ b_cat[slot, o_i, :r].T
    x: [T, H] · a: [n, S, R, H] · b_cat: [S, O, R] · rows: [m] int or None · y: [T, O]
    """
    xs = x if rows is None else x[rows]
    for i in range(len(slice_offsets) - 1):
        r = ranks[i][slot]
        if not r:
            continue
        o0, o1 = slice_offsets[i], slice_offsets[i + 1]
        delta = (xs @ a[i, slot, :r].T) @ b_cat[slot, o0:o1, :r].T  # [m, O_i]
        delta = delta * scaling[i, slot].to(delta.dtype)
        if rows is None:
            y[:, o0:o1] += delta
        else:
            y[rows, o0:o1] += delta
