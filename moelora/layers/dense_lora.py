"""The dense LoRA's backends (attention and dense MLP layers: LoRALinear), one picked per layer by pick_dense_lora
when the layer is configured (LoRALinear.configure, from the KernelConfig), each called with one DenseLoRAArgs:

    ShrinkExpandLoRA  the grouped shrink, then the expand adding into the base GEMM's output: the Triton kernels (a
                      GPU) or the torch references (the CPU, or no Triton); plain matmuls on the slot for a batch
                      whose LoRA tokens all share one adapter (single_slot_path)
    Fp8EpilogueLoRA   the shrink, then the FP8 GEMM with the expand in its epilogue (an FP8 base on a GPU)
    DeferredLoRA      at decode sizes: the plain base GEMM beside the shrink and the delta kernel on the side stream,
                      the delta handed back for the next kernel to add (LoRALinear.forward_deferred)"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.kernels._triton import HAS_TRITON, interpreting
from moelora.kernels.config import KernelConfig
from moelora.kernels.lora.delta_triton import DELTA_BLOCK_N, DELTA_MAX_GROUPS, lora_delta
from moelora.kernels.lora.shrink_expand import lora_expand_ref, lora_shrink_ref, lora_single_slot
from moelora.kernels.lora.shrink_expand_triton import (SHRINK_SPLIT_MAX_TOKENS, lora_expand, lora_shrink,
                                                       lora_shrink_buffer)
from moelora.kernels.quant.fp8_act_triton import fp8_prequantize
from moelora.kernels.quant.fp8_triton import Fp8LoRAEpilogue, fp8_linear, pdl_supported
from moelora.kernels.streams import fork, join, side_stream
from moelora.layers.lora import LoRAWeights

# The single-adapter path (plain matmuls on the slot: ~12 small launches for qkv) on a GPU from this many tokens:
# below, the grouped kernels are faster (bf16 qkv at 64 tokens 16.9 against 51.9 µs; at 4,096 308.6 against 282.7);
# on an FP8 base the GEMM's LoRA epilogue is faster at every size.
SINGLE_SLOT_MIN_TOKENS = 1024
# The deferred shrink walks K in tiles of 128, not 64 (+1.42% / +1.11% decode with 4 / 8 adapters), and splits H
# into min(8, H // DEFER_SHRINK_K_PER_SPLIT) parts (qkv's 2,048 inputs 4 ways, o_proj's 4,096 8 ways); its delta
# kernel runs 8 warps a program, not 4 (both: +0.69% / +0.73%).
DEFER_SHRINK_BLOCK_K = 128
DEFER_SHRINK_K_PER_SPLIT = 512
DEFER_DELTA_WARPS = 8


@dataclass(frozen=True)
class DenseLoRAArgs:
    """One call's LoRA inputs: x [T, H] (the unquantized activations) · w: the layer's slot buffers · batch: the
    batch's slot metadata (tokens grouped by slot, its one slot if any, whether a CUDA graph runs it)."""

    x: torch.Tensor
    w: LoRAWeights
    batch: LoRABatch


def single_slot_path(batch: LoRABatch, num_tokens: int, min_tokens: int | None) -> bool:
    """Whether the dense LoRA takes plain matmuls on the batch's one slot: every LoRA token on one slot, outside a
    CUDA graph (a graph serves every later mix of adapters), and at least min_tokens tokens (None: never)."""
    return batch.single_slot is not None and not batch.graph and min_tokens is not None and num_tokens >= min_tokens


def _add_single_slot(args: DenseLoRAArgs, y: torch.Tensor) -> None:
    g, w = args.batch.groups, args.w
    rows = None if args.batch.all_lora else g.sorted_token_ids[: g.counts[0]].long()
    lora_single_slot(args.x, w.a, w.b_cat, w.slice_offsets_host, w.ranks, w.scaling, args.batch.single_slot, rows, y)


def dense_lora_h(w: LoRAWeights, x: torch.Tensor, max_splits: int = 0) -> torch.Tensor:
    """The shrink's buffer for x [T, H]: [split_k, n_slices, T, max_lora_rank] fp32, uninitialised (the shrink
    writes every entry the expand reads; split_k > 1 on a GPU at decode sizes: partial sums, added by the expand;
    at most max_splits when > 0)."""
    return lora_shrink_buffer(w.num_slices, x.shape[0], w.max_lora_rank, x.shape[1], x.device, max_splits)


@dataclass(frozen=True)
class ShrinkExpandLoRA:
    """y = base(x) + the LoRA delta: the grouped shrink, then the expand adding into y (the Triton kernels; triton
    False: the torch references), or plain matmuls on the slot for a one-adapter batch of at least
    single_slot_min_tokens tokens (None: never)."""

    triton: bool
    single_slot_min_tokens: int | None

    def forward(self, layer: nn.Module, args: DenseLoRAArgs) -> torch.Tensor:
        x, w, g = args.x, args.w, args.batch.groups
        y = layer.base(x)
        if single_slot_path(args.batch, x.shape[0], self.single_slot_min_tokens):
            _add_single_slot(args, y)
            return y
        shrink, expand = (lora_shrink, lora_expand) if self.triton else (lora_shrink_ref, lora_expand_ref)
        h = dense_lora_h(w, x)
        shrink(x, w.a, w.rank_tensor, g, h)
        expand(h, w.b_cat, w.slice_offsets, w.rank_tensor, w.scaling, g, y)
        return y


@dataclass(frozen=True)
class Fp8EpilogueLoRA:
    """y = the FP8 GEMM with the LoRA expand added in its epilogue (one launch instead of two; the sum rounded
    once), at every size and adapter count: x quantized first (with PDL nothing may run between the shrink and the
    GEMM), the shrink into split-K partials (it reads the unquantized x), then fp8_linear(lora=...). pdl: the GEMM
    launched with programmatic dependent launch right after the shrink."""

    pdl: bool = False

    def forward(self, layer: nn.Module, args: DenseLoRAArgs) -> torch.Tensor:
        x, w, g = args.x, args.w, args.batch.groups
        block = layer.quant.block
        xq, xs = fp8_prequantize(x, block[1])
        h = dense_lora_h(w, x)
        lora_shrink(x, w.a, w.rank_tensor, g, h, launch_dependents=self.pdl)
        epi = Fp8LoRAEpilogue(h, w.b_cat, w.slice_offsets, w.rank_tensor, w.scaling, g.token_slots, g.active_slots,
                              self.pdl, tuple(w.slice_offsets_host))
        return fp8_linear(xq, layer.weight, layer.weight_scale_inv, block, layer.bias, x_scale=xs, lora=epi,
                          out_dtype=x.dtype)


def defer_shrink_max_splits(H: int) -> int:
    """The deferred shrink's most splits for input width H: min(8, H // DEFER_SHRINK_K_PER_SPLIT), at least 1."""
    return max(1, min(8, H // DEFER_SHRINK_K_PER_SPLIT))


@dataclass(frozen=True)
class DeferredLoRA:
    """(y, delta): y = base(x) [T, O], delta [T, O] in x's dtype, the LoRA delta (lora_delta: every row written, 0
    for rows without an adapter) for the caller's next kernel to add, rounded once. On a GPU the shrink and the
    delta kernel run on the side stream beside the base GEMM, and the main stream waits for them before this
    returns; under the interpreter (tests) one stream. Serves a layer whose slice bounds lie on the delta kernel's
    column tiles (pick_dense_lora), for calls where `serves` holds."""

    def serves(self, args: DenseLoRAArgs) -> bool:
        """Decode sizes (<= SHRINK_SPLIT_MAX_TOKENS rows of a 2-D input), 1..DELTA_MAX_GROUPS slot groups."""
        x = args.x
        return (x.dim() == 2 and x.shape[0] <= SHRINK_SPLIT_MAX_TOKENS
                and 0 < args.batch.groups.active_slots.shape[0] <= DELTA_MAX_GROUPS)

    def forward(self, layer: nn.Module, args: DenseLoRAArgs) -> tuple[torch.Tensor, torch.Tensor]:
        x, w, g = args.x, args.w, args.batch.groups
        h = dense_lora_h(w, x, defer_shrink_max_splits(x.shape[1]))
        delta = torch.empty(x.shape[0], w.slice_offsets_host[-1], dtype=x.dtype, device=x.device)

        def chain() -> None:
            lora_shrink(x, w.a, w.rank_tensor, g, h, block_k=DEFER_SHRINK_BLOCK_K)
            lora_delta(h, w.b_cat, w.slice_offsets, tuple(w.slice_offsets_host), w.rank_tensor, w.scaling,
                       g.token_slots, g.active_slots, delta, num_warps=DEFER_DELTA_WARPS)

        if not x.is_cuda:  # the interpreter (tests): one stream
            chain()
            return layer.base(x), delta
        side = side_stream(x.device)
        main = fork(side)
        with torch.cuda.stream(side):
            chain()
        y = layer.base(x)
        join(main, side)
        return y, delta


DenseLoRABackend = ShrinkExpandLoRA | Fp8EpilogueLoRA


def pick_dense_lora(cfg: KernelConfig, quant, device: torch.device, slice_bounds: list[int]
                    ) -> tuple[DenseLoRABackend, DeferredLoRA | None]:
    """A dense LoRA layer's backends: (the one for forward, the one for forward_deferred or None). quant: the
    layer's quantized-base state (layers/fp8.py Fp8State, layers/nvfp4.py Nvfp4State) or None; device: its
    weights'; slice_bounds: its slices' output offsets [0, o_1, ..., O]."""
    single_slot = cfg.dense_lora.single_slot
    fp8 = getattr(quant, "kind", None) == "fp8"
    if not (HAS_TRITON and device.type == "cuda"):  # the CPU: the matmuls beat the grouped references at any size
        backend = ShrinkExpandLoRA(False, 0 if single_slot else None)
    elif fp8 and quant.reference is None and cfg.fp8.lora_epilogue:
        backend = Fp8EpilogueLoRA(cfg.fp8.lora_pdl and pdl_supported(device))
    else:
        backend = ShrinkExpandLoRA(True, SINGLE_SLOT_MIN_TOKENS if single_slot else None)
    defer = cfg.dense_lora.defer == "on" or (cfg.dense_lora.defer == "fp8" and fp8)
    on_tiles = all(o % DELTA_BLOCK_N == 0 for o in slice_bounds[1:-1])
    deferred = DeferredLoRA() if defer and on_tiles and HAS_TRITON and (device.type == "cuda" or interpreting()) \
        else None
    return backend, deferred
