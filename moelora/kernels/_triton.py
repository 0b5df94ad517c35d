"""Triton availability and version checks, in one place."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
except ImportError:  # the CPU path needs no Triton
    HAS_TRITON = False
    TRITON_VERSION = (0, 0)

MIN_TRITON = (3, 6)


class DeviceError(RuntimeError):
    """This machine lacks what a requested path needs (a CUDA GPU, its compute capability, Triton); the message
    says what to install or which option to change. The command line prints it without a traceback."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton() -> None:
    if not HAS_TRITON:
        raise DeviceError("the GPU kernels need Triton: pip install 'triton>=3.6' (it comes with CUDA builds of torch)")
    if TRITON_VERSION < MIN_TRITON:
        raise DeviceError(f"Triton {TRITON_VERSION} is too old for moelora's kernels; install triton>=3.6")


def dot_precision(dtype) -> str | None:
    """fp32 operands: exact IEEE products (Triton would pick tf32); 16-bit operands: Triton's default."""
    return "ieee" if dtype == torch.float32 else None
