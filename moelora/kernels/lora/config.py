"""The dense (attention and dense MLP) LoRA's choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseLoRAConfig:
    """defer: "fp8" (the default: on FP8 bases), "on" (every base) or "off": at decode sizes qkv_proj / o_proj run
    a plain GEMM while their LoRA shrink and delta run on the side stream, the next kernel adding the delta (fp8
    128/128 batch 64: +0.6-1.1% / +1.8-2.2% with 4 / 8 adapters).
    single_slot: a batch whose LoRA tokens all share one adapter takes plain matmuls on that slot (cuBLAS; on a GPU
    from SINGLE_SLOT_MIN_TOKENS tokens, outside CUDA graphs); off, eager runs the kernels a graph runs (tests that
    compare the two token for token)."""

    defer: str = "fp8"
    single_slot: bool = True

    def __post_init__(self) -> None:
        if self.defer not in ("fp8", "on", "off"):
            raise ValueError(f"kernel config dense_lora.defer: 'fp8', 'on' or 'off', got {self.defer!r}")
