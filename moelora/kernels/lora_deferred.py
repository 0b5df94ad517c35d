"""A dense LoRA expand handed from a projection to the kernel that reads its output (set_lora_consumer_expand).

The projection (an FP8 LoRALinear at decode sizes) launches only its shrink and its base GEMM; the kernel reading
the GEMM's output (qk_norm_rope after qkv_proj, the post-attention RMSNorm after o_proj) adds
    y[t, o_i] += scaling[i, s] * (h[i, t, :r] @ b_cat[s, o_i, :r].T),   s = token_slots[t] >= 0, r = ranks[i, s]
to each row it loads, in fp32, rounding y + delta once to y's dtype (PEFT adds its bf16 LoRA output to the bf16
base output; lora_expand rounds y + delta once the same way). The GEMM then carries no LoRA program, no split-K
hand-over and no wait on the shrink; the shrink runs beside it (PDL) and the consumer reads h.
References: pending_delta_ref / apply_pending_ref below; the kernels' helper: lora_triton.row_lora_delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingExpand:
    """The expand a consumer kernel owes y [T, O]. h: the shrink's [split_k, n, T, R] fp32 partials (or [n, T, R])
    · b_cat: [S, O, R] · ranks: [n, S] int32 · scaling: [n, S] fp32 · token_slots: [T] int32 (-1: no adapter)
    · slice_bounds: the n + 1 column offsets of the slices in y (host ints)."""

    h: torch.Tensor
    b_cat: torch.Tensor
    ranks: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    slice_bounds: tuple[int, ...]

    @property
    def parts(self) -> torch.Tensor:
        """h as [split_k, n, T, R]."""
        return self.h if self.h.dim() == 4 else self.h.unsqueeze(0)

    def check(self, caller: str, rows: int, width: int) -> None:
        """ValueError naming the tensor when this expand does not fit a consumer of `rows` rows and `width` columns."""
        sk, n, T, R = self.parts.shape
        S, O, Rb = self.b_cat.shape
        if T != rows or self.token_slots.shape != (rows,):
            raise ValueError(f"{caller}: pending LoRA expand has h for {T} rows and token_slots "
                             f"{tuple(self.token_slots.shape)}, expected {rows} rows")
        if O != width or Rb != R or self.slice_bounds[-1] != width or len(self.slice_bounds) != n + 1:
            raise ValueError(f"{caller}: pending LoRA expand b_cat {tuple(self.b_cat.shape)} with slices "
                             f"{self.slice_bounds} does not fit an output of width {width} and rank {R}")
        if self.b_cat.stride(2) != 1:
            raise ValueError(f"{caller}: pending LoRA expand needs b_cat [S, O, R] with a contiguous rank dim, "
                             f"found strides {self.b_cat.stride()}")

    def kernel_args(self, chunk: int) -> dict:
        """The consumer kernels' expand arguments (lora_triton.row_lora_delta): pointers, strides, EXPAND_R (the
        rank tile, a power of two >= chunk), EXPAND_SK (partials), EXPAND_CHUNK (ranks a step)."""
        import triton

        h = self.parts
        b = self.b_cat
        br = max(chunk, triton.next_power_of_2(h.shape[3]))
        return dict(eh_ptr=h, eb_ptr=b, erank_ptr=self.ranks, escale_ptr=self.scaling, eslot_ptr=self.token_slots,
                    eS=b.shape[0], eR=h.shape[3], seh_s=h.stride(0), seh_i=h.stride(1), seh_m=h.stride(2), seh_r=h.stride(3),
                    seb_s=b.stride(0), seb_o=b.stride(1), EXPAND_R=br, EXPAND_SK=h.shape[0],
                    EXPAND_CHUNK=min(chunk, br))


def attach_lora_expand(y: torch.Tensor, pending: PendingExpand) -> None:
    """Marks y as owing `pending` (its consumer, RMSNorm.add_norm, takes it with take_lora_expand)."""
    y.lora_pending = pending


def take_lora_expand(y: torch.Tensor) -> PendingExpand | None:
    """The expand y owes (attach_lora_expand), removed from y, or None."""
    pending = getattr(y, "lora_pending", None)
    if pending is not None:
        del y.lora_pending
    return pending


def pending_delta_ref(p: PendingExpand) -> torch.Tensor:
    """The delta [T, O] fp32 a consumer adds (h rounded to the factors' dtype first, as the kernels do; h and B past
    each row's rank, and h of rows of slot -1, never read: whatever they hold)."""
    h = p.parts.sum(0).to(p.b_cat.dtype).float()  # [n, T, R]
    n, T, R = h.shape
    slots = p.token_slots.long()
    sc = slots.clamp(min=0)
    out = torch.zeros(T, p.b_cat.shape[1], dtype=torch.float32, device=h.device)
    for i in range(n):
        o0, o1 = p.slice_bounds[i], p.slice_bounds[i + 1]
        rank = torch.where(slots >= 0, p.ranks[i, sc].long(), 0)  # [T]
        live = (torch.arange(R, device=h.device)[None, :] < rank[:, None]).float()  # [T, R]
        b = p.b_cat[sc, o0:o1, :].float()  # [T, O_i, R]
        d = torch.einsum("tr,tor->to", torch.where(live > 0, h[i], 0.0), torch.where(live[:, None, :] > 0, b, 0.0))
        out[:, o0:o1] = d * torch.where(slots >= 0, p.scaling[i, sc], 0.0)[:, None]
    return out


def apply_pending_ref(y: torch.Tensor, p: PendingExpand) -> torch.Tensor:
    """y + delta rounded once to y's dtype (what the consumer kernels see as their input)."""
    return (y.float() + pending_delta_ref(p)).to(y.dtype)
