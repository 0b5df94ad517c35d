"""The dense (attention and dense MLP) LoRA's choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseLoRAConfig:
    """defer: "fp8" (the default: on FP8 bases), "on" (every base) or "off": at decode sizes qkv_proj / o_proj run
    a plain GEMM while their LoRA shrink and delta run on the side stream, the next kernel adding the delta."""

    defer: str = "fp8"

    def __post_init__(self) -> None:
        if self.defer not in ("fp8", "on", "off"):
            raise ValueError(f"kernel config dense_lora.defer: 'fp8', 'on' or 'off', got {self.defer!r}")
