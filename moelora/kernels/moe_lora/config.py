"""The routed-expert LoRA's choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoELoRAConfig:
    """grouped_min_pairs: from this many (token, expert) pairs up to 2,048 the grouped kernel (pairs grouped by
    (slot, expert)) instead of the per-pair fused one (above 2,048 pairs always the grouped one, in prefill blocks).
    prefill_epilogue: above 2,048 pairs on FP8 expert stacks, the LoRA expand in the expert GEMM's epilogue (else the
    grouped kernel's delta). early: gate_up's LoRA issued on the side stream beside the experts' alignment (which
    runs on a stream above the side stream's priority) instead of after it. early_down: with early, down's LoRA
    issued as soon as the gate_up GEMM is done, computing the activation itself, beside the activation kernel."""

    grouped_min_pairs: int = 2048
    prefill_epilogue: bool = True
    early: bool = True
    early_down: bool = True

    def __post_init__(self) -> None:
        if self.grouped_min_pairs < 1:
            raise ValueError(f"kernel config moe_lora.grouped_min_pairs: a number of pairs >= 1, got "
                             f"{self.grouped_min_pairs}")
