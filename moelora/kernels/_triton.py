"""Triton availability and version checks, in one place; programmatic dependent launch (pdl_args, pdl_enter)."""

from __future__ import annotations

import functools
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


# Programmatic dependent launch (Hopper and later) through every kernel: each launch may start while the kernel before
# it on the stream still runs (launch_pdl), and its first act is to wait for that kernel to complete (gdc_wait), its
# second to let the next one start (gdc_launch_dependents). The next kernel is then resident and past its launch when
# this one ends. Invariant: a kernel lets the next one start only after its own wait, so everything launched two
# kernels back is complete when a kernel starts (fp8_triton's LORA_WAIT GEMM reads its input before waiting).
PDL_CHAIN = True


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr` (pdl_enter first): {"PDL": True, "launch_pdl":
    True} on a CUDA device of compute capability >= 9.0 with PDL_CHAIN, else {}."""
    if not PDL_CHAIN or device.type != "cuda" or interpreting():
        return {}
    return {"PDL": True, "launch_pdl": True} if _pdl_device(device.index or 0) else {}


if HAS_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, wait for the kernel before it, then let the next one start."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
