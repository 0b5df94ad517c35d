"""Shared cases for kernel tests: adapter popularity patterns, token counts, per-slot ranks.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set before Triton is
imported) at small shapes in fp32/fp16; with CUDA they run compiled at real shapes in bf16."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"
POPULARITY = ["distinct", "uniform", "skewed", "identical", "with_base_rows"]
NUM_TOKENS = [1, 3, 7, 133]
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


def token_slots(pattern: str, T: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slots in [0, S) (or -1 for base rows) following an adapter popularity pattern."""
    if pattern == "distinct":
        s = torch.arange(T) % S
    elif pattern == "uniform":
        s = torch.randint(0, S, (T,), generator=gen)
    elif pattern == "skewed":  # zipf-like: slot k with weight 1/(k+1)^2
        w = 1.0 / (torch.arange(S, dtype=torch.float) + 1) ** 2
        s = torch.multinomial(w, T, replacement=True, generator=gen)
    elif pattern == "identical":
        s = torch.full((T,), S - 1)  # one adapter, and not slot 0
    elif pattern == "with_base_rows":
        s = torch.randint(-1, S, (T,), generator=gen)
    else:
        raise ValueError(pattern)
    return s.to(torch.int32)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (3e-2, 3e-2)}[dtype]
