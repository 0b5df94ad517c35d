"""The FP8 GEMMs' choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FP8Config:
    """lora_pdl: the dense FP8 GEMM launched with programmatic dependent launch right after its LoRA shrink
    (Hopper and later)."""

    lora_pdl: bool = True
