"""The routed experts' base-path choices (a section of kernels/config.py's KernelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """fused_router: the router's gate GEMM, softmax and top-k in one launch on CUDA up to 256 tokens (else F.linear
    + route_topk). combine_to_norm: the routed experts' weighted combine computed by the next RMSNorm as it loads its
    input (blocks without a shared expert, not under tensor / expert parallelism's hooks)."""

    fused_router: bool = True
    combine_to_norm: bool = True
