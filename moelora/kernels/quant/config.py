"""The FP8 GEMMs' choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FP8Config:
    """lora_epilogue: dense LoRA on an FP8 base (where it is not deferred) as the expand inside the FP8 GEMM's
    epilogue; off, the GEMM, then the expand kernel adding into its output.
    lora_pdl: that GEMM launched with programmatic dependent launch right after its LoRA shrink, its K steps beside
    the shrink (Hopper and later)."""

    lora_epilogue: bool = True
    lora_pdl: bool = True
