"""Linear layers whose output may carry per-slot LoRA deltas (fused slices: qkv, gate_up)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from moelora.adapters.metadata import LoRABatch
from moelora.kernels._triton import HAS_TRITON, interpreting
from moelora.kernels.lora.shrink_expand import lora_expand_ref, lora_shrink_ref, lora_single_slot
from moelora.layers.lora import LoRAWeights, lora_active, lora_runs


# The single-adapter path (plain matmuls on the slot: ~12 small launches for qkv) on a GPU only from this many
# tokens. Measured (scripts/bench_fp8_lora_epilogue.py, H200, rank 16, µs per call, grouped kernels against
# it): bf16 qkv 16.9 / 51.9 at 64 tokens, 87.2 / 98.2 at 1,024, 308.6 / 282.7 at 4,096; o_proj 20.1 / 25.8,
# 57.8 / 45.8, 159.1 / 134.8. On an FP8 base the GEMM's LoRA epilogue is used at every size (qkv 17.8 / 54.6 at
# 64 tokens, 224.0 / 341.8 at 4,096; o_proj 227.6 / 234.2 at 4,096). MOELORA_SINGLE_SLOT_MIN_TOKENS overrides it.
SINGLE_SLOT_MIN_TOKENS = 1024
_SINGLE_SLOT = {"enabled": True,
                "min_tokens": int(os.environ.get("MOELORA_SINGLE_SLOT_MIN_TOKENS", str(SINGLE_SLOT_MIN_TOKENS)))}


def set_single_slot_fast_path(enabled: bool, min_tokens: int | None = None) -> None:
    """Turn the cuBLAS single-adapter path off (tests that compare eager with graph replay bit for bit: a
    graph always runs the grouped kernels), or set from how many tokens a GPU batch takes it."""
    _SINGLE_SLOT["enabled"] = bool(enabled)
    if min_tokens is not None:
        _SINGLE_SLOT["min_tokens"] = int(min_tokens)


def single_slot_path(lora: LoRABatch, num_tokens: int, on_gpu: bool) -> bool:
    """Whether dense LoRA takes the single-adapter path: every LoRA token on one slot, outside a CUDA graph, the
    path on, and on a GPU at least SINGLE_SLOT_MIN_TOKENS tokens (below, the grouped kernels are faster; on
    the CPU the matmuls are, at any size)."""
    if lora.single_slot is None or lora.graph or not _SINGLE_SLOT["enabled"]:
        return False
    return not on_gpu or num_tokens >= _SINGLE_SLOT["min_tokens"]


# The deferred dense LoRA's shrink (LoRALinear.forward_deferred) walks K in tiles of 128, not 64: half as many
# serial steps a split for the same programs. Measured (fp8 128/128 batch 64, shared-A adapters, one A/B process,
# two rounds, MOELORA_LORA_SHRINK_BLOCK_K): 128 +1.42% / +1.11% with 4 / 8 adapters, 256 -0.85% / -0.88%.
# set_lora_shrink_config's K tile, when set, wins.
DEFER_SHRINK_BLOCK_K = 128
# ... and splits H into min(8, H // DEFER_SHRINK_K_PER_SPLIT) parts: qkv's 2,048 inputs 4 ways, o_proj's 4,096 8 ways
# (4 K steps each). Before, it split at most 4 ways (half the programs of 8 beside the base GEMM, which they slow by
# sharing its SMs: +0.2-0.4% against 8 splits; 2 splits lost 1.4%). Its delta kernel runs 8 warps a program, not 4
# (DEFER_DELTA_WARPS). Measured (one A/B process each, two rounds, shared-A adapters, fp8 128/128 batch 64, 4 / 8
# adapters): the split by width +0.14% / +0.20% over at most 4, the 8 warps +0.47% / +0.48%, both +0.69% / +0.73%
# and, in the next process, +0.75% / +0.74% (89.5% / 88.3% kept).
# set_dense_defer_k_per_split / set_lora_delta_warps, when set, win; MOELORA_LORA_SHRINK_SPLITS=4 is the old split.
DEFER_SHRINK_K_PER_SPLIT = 512
DEFER_DELTA_WARPS = 8


def defer_shrink_max_splits(H: int) -> int:
    """The deferred shrink's most splits for input width H: min(8, H // k), at least 1, for k =
    set_dense_defer_k_per_split's k when set, else DEFER_SHRINK_K_PER_SPLIT."""
    from moelora.kernels._triton import dense_defer_k_per_split

    k = dense_defer_k_per_split() or DEFER_SHRINK_K_PER_SPLIT
    return max(1, min(8, H // k))


def dense_lora_h(w: LoRAWeights, x: torch.Tensor, max_splits: int = 0) -> torch.Tensor:
    """The shrink's buffer for x [T, H]: [split_k, n_slices, T, max_lora_rank] fp32, uninitialised (the shrink
    writes every entry the expand reads; split_k > 1 on a GPU at decode sizes: partial sums, added by the expand;
    at most max_splits when > 0)."""
    from moelora.kernels.lora.shrink_expand_triton import lora_shrink_buffer

    return lora_shrink_buffer(w.num_slices, x.shape[0], w.max_lora_rank, x.shape[1], x.device, max_splits)


def apply_dense_lora(x: torch.Tensor, w: LoRAWeights, lora: LoRABatch, y: torch.Tensor) -> None:
    """y[t] += per slice i: scaling[i, s] * B_i[s] A_i[s] x[t], s = slot of token t (rows of slot -1 untouched).

    One adapter in the batch (on a GPU from SINGLE_SLOT_MIN_TOKENS tokens): plain matmuls on that slot (cuBLAS
    on a GPU). Otherwise the grouped shrink/expand kernels (Triton on a GPU, the torch references on the CPU).
    x: [T, H] · y: [T, sum(out_i)] (x's dtype, or fp32 for a delta buffer)
    """
    if single_slot_path(lora, x.shape[0], x.is_cuda):
        g = lora.groups
        rows = None if lora.all_lora else g.sorted_token_ids[: g.counts[0]].long()
        lora_single_slot(x, w.a, w.b_cat, w.slice_offsets_host, w.ranks, w.scaling, lora.single_slot, rows, y)
        return
    h = dense_lora_h(w, x)
    if x.is_cuda:
        from moelora.kernels.lora.shrink_expand_triton import lora_expand, lora_shrink
    else:
        lora_shrink, lora_expand = lora_shrink_ref, lora_expand_ref
    lora_shrink(x, w.a, w.rank_tensor, lora.groups, h)
    lora_expand(h, w.b_cat, w.slice_offsets, w.rank_tensor, w.scaling, lora.groups, y)


def attach_lora_delta(y: torch.Tensor, delta: torch.Tensor) -> None:
    """Marks y (a layer's base output) with its deferred LoRA delta (LoRALinear.forward_deferred) for the kernel
    that reads y next to add (take_lora_delta)."""
    y.lora_delta = delta


def take_lora_delta(y: torch.Tensor) -> torch.Tensor | None:
    """The delta attach_lora_delta put on y (removed from it), or None."""
    delta = getattr(y, "lora_delta", None)
    if delta is not None:
        del y.lora_delta
    return delta


class LoRALinear(nn.Module):
    """y = x W^T (+ bias) + for each slice i: scaling[i, s] * B_i[s] A_i[s] x, s = the token's slot.

    weight: [sum(out_features), in_features]; the slices sit in order along the output dim.
    """

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = list(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(sum(out_features), dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.lora: LoRAWeights | None = None
        self.quant = None  # a quantized base weight: layers/fp8.py Fp8State or layers/nvfp4.py Nvfp4State

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoRAWeights:
        self.lora = LoRAWeights(
            self.in_features, self.out_features, max_loras, max_lora_rank,
            dtype=self.quant.act_dtype if self.quant else self.weight.dtype, device=self.weight.device,
        )
        return self.lora

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x W^T (+ bias) [T, sum(O)], from the bf16 or the quantized weight."""
        return F.linear(x, self.weight, self.bias) if self.quant is None else self.quant.linear(self, x)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if not lora_active(self.lora, lora):
            return self.base(x)
        if self._fp8_epilogue_ok(x, lora):
            return self._forward_fp8_epilogue(x, lora)
        y = self.base(x)
        apply_dense_lora(x, self.lora, lora, y)
        return y

    def defer_ok(self, x: torch.Tensor, lora: LoRABatch | None) -> bool:
        """Whether forward_deferred defers this call's LoRA: set_dense_lora_defer on for this base ("1"; "fp8": an
        FP8 base weight), Triton (a GPU, or the interpreter), a decode-sized 2-D input, the LoRA running for this
        batch, and lora_delta serving this layer (delta_ok: slice bounds on its column tiles, at most
        DELTA_MAX_GROUPS slot groups)."""
        from moelora.kernels._triton import dense_lora_defer
        from moelora.kernels.lora.delta_triton import delta_ok
        from moelora.kernels.lora.shrink_expand_triton import SHRINK_SPLIT_MAX_TOKENS

        mode = dense_lora_defer()
        if mode == "0" or (mode == "fp8" and not self._fp8_base()):
            return False
        if not (HAS_TRITON and (x.is_cuda or interpreting())):
            return False
        if not (x.dim() == 2 and x.shape[0] <= SHRINK_SPLIT_MAX_TOKENS and lora_runs(self.lora, lora)):
            return False
        return delta_ok(tuple(self.lora.slice_offsets_host), lora.groups.active_slots.shape[0])

    def forward_deferred(self, x: torch.Tensor, lora: LoRABatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): where defer_ok, y = base(x) [T, sum(O)] and delta [T, sum(O)] in x's dtype, the LoRA delta
        (lora_delta: every row written, 0 for rows without an adapter) for the caller's next kernel to add, rounded
        once: y + delta is forward(x, lora) up to that one rounding. On a GPU the shrink and the delta kernel run on
        the side stream beside the base GEMM and the main stream waits for them before this returns (later work
        may read delta). Elsewhere (forward(x, lora), None)."""
        if not self.defer_ok(x, lora):
            return self.forward(x, lora), None
        from moelora.kernels.lora.delta_triton import lora_delta
        from moelora.kernels.lora.shrink_expand_triton import lora_shrink

        lora_active(self.lora, lora)  # counted as forward counts it
        w = self.lora
        g = lora.groups
        h = dense_lora_h(w, x, defer_shrink_max_splits(x.shape[1]))
        delta = torch.empty(x.shape[0], sum(self.out_features), dtype=x.dtype, device=x.device)

        def chain() -> None:
            lora_shrink(x, w.a, w.rank_tensor, g, h, block_k=DEFER_SHRINK_BLOCK_K)
            lora_delta(h, w.b_cat, w.slice_offsets, tuple(w.slice_offsets_host), w.rank_tensor, w.scaling,
                       g.token_slots, g.active_slots, delta, num_warps=DEFER_DELTA_WARPS)

        if not x.is_cuda:  # the interpreter (tests): one stream
            chain()
            return self.base(x), delta
        from moelora.kernels.streams import fork, join, side_stream

        side = side_stream(x.device)
        main = fork(side)
        with torch.cuda.stream(side):
            chain()
        y = self.base(x)
        join(main, side)
        return y, delta

    def _fp8_base(self) -> bool:
        from moelora.layers.fp8 import Fp8State

        return isinstance(self.quant, Fp8State)

    def _fp8_epilogue_ok(self, x: torch.Tensor, lora: LoRABatch) -> bool:
        """The FP8 (Triton) base with the grouped LoRA kernels: the expand can run in the GEMM's epilogue."""
        if self.quant is None or not x.is_cuda:
            return False
        from moelora.kernels.quant.fp8_triton import fp8_lora_epilogue
        from moelora.layers.fp8 import Fp8State

        st = self.quant
        # at every size, one adapter or several (faster than the single-adapter path: SINGLE_SLOT_MIN_TOKENS)
        return fp8_lora_epilogue() and isinstance(st, Fp8State) and st.reference is None

    def _forward_fp8_epilogue(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """y = the FP8 GEMM with the LoRA expand added in its epilogue (one launch instead of two; the sum rounded
        once): the shrink into split-K partials first (it reads the unquantized x), then fp8_linear(lora=...)."""
        from moelora.kernels.quant.fp8_triton import Fp8LoRAEpilogue, fp8_linear, fp8_lora_pdl, fp8_prequantize
        from moelora.kernels.lora.shrink_expand_triton import lora_shrink

        w = self.lora
        block = self.quant.block
        xq, xs = fp8_prequantize(x, block[1])  # before the shrink: with PDL nothing may run between it and the GEMM
        h = dense_lora_h(w, x)
        pdl = fp8_lora_pdl(x.device)
        lora_shrink(x, w.a, w.rank_tensor, lora.groups, h, launch_dependents=pdl)
        epi = Fp8LoRAEpilogue(h, w.b_cat, w.slice_offsets, w.rank_tensor, w.scaling, lora.groups.token_slots,
                              lora.groups.active_slots, pdl, tuple(w.slice_offsets_host))
        return fp8_linear(xq, self.weight, self.weight_scale_inv, block, self.bias, x_scale=xs, lora=epi,
                          out_dtype=x.dtype)
