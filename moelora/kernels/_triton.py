"""Triton availability and version checks, in one place; the count of kernel variants this process built."""

from __future__ import annotations

import logging
import os
import threading

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


_variants = [0]
_lock = threading.Lock()
log = logging.getLogger(__name__)


def track_kernel_builds() -> None:
    """From now on count each Triton kernel variant built (kernel_builds()) and log it at INFO with its
    specialization (`n: i32D`: a multiple of 16), through knobs.runtime.jit_post_compile_hook, still calling the
    hook set before. Idempotent; nothing without Triton."""
    if not HAS_TRITON or not hasattr(triton, "knobs"):
        return
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook
    if getattr(previous, "moelora_counter", False):
        return

    def counted(*args, **kwargs):
        with _lock:
            _variants[0] += 1
        log.info("Triton kernel variant built: %s", describe_build(kwargs))
        return previous(*args, **kwargs) if previous is not None else None

    counted.moelora_counter = True
    runtime.jit_post_compile_hook = counted


def describe_build(hook_kwargs: dict) -> str:
    """A built variant in one line, `name[warps, stages](ptr: *bf16D, n: i32, BLOCK=64)` (D: 16-divisible, constexprs
    with their values), from the hook's `compile`; else its `repr` (garbled by Triton 3.6-3.9) on one line."""
    comp, fn = hook_kwargs.get("compile") or {}, hook_kwargs.get("fn")
    try:
        signature, constants, attrs = comp["signature"], comp["constants"], comp["configs"][0]
        div16 = {k for k, v in attrs.items() if any(a[0] == "tt.divisibility" and a[1] >= 16 for a in v)}
        parts = [f"{n}={constants.get((i,))!r}" if ty == "constexpr" else f"{n}: {ty}{'D' if (i,) in div16 else ''}"
                 for i, (n, ty) in enumerate(signature.items())]
        name = fn.name.rsplit(".", 1)[-1]  # Triton passes the qualified name (outer.<locals>.kernel)
        return f"{name}[warps={comp['num_warps']}, stages={comp['num_stages']}]({', '.join(parts)})"
    except (KeyError, IndexError, TypeError, AttributeError):
        return " ".join(str(hook_kwargs.get("repr")).split())


def kernel_builds() -> int:
    """Triton kernel variants built since track_kernel_builds() (0 before it, or without Triton)."""
    return _variants[0]
