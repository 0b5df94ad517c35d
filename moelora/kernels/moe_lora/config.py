"""The routed-expert LoRA's choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoELoRAConfig:
    """grouped_min_pairs: from this many (token, expert) pairs up to 2,048 the grouped kernel (pairs grouped by
    (slot, expert)) instead of the per-pair fused one. grouped_prefill: the grouped kernel at prefill sizes too.
    prefill_epilogue: at prefill on FP8 expert stacks the LoRA expand in the expert GEMM's epilogue.
    early / early_down: gate_up's (down's) LoRA issued on the side stream before the alignment (the activation)."""

    grouped_min_pairs: int = 2048
    grouped_prefill: bool = True
    prefill_epilogue: bool = True
    early: bool = True
    early_down: bool = True
