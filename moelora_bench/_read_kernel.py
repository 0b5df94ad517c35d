"""The streaming-read kernel behind common.hbm_read_bandwidth_gbs (reference: buf.view(-1, block * iters).sum(1))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_words(buf: torch.Tensor, block: int, iters: int, num_warps: int) -> torch.Tensor:
    """Each program sums `iters` x `block` consecutive int32 words of buf ([n] int32, CUDA): returns those sums
    [ceil(n / (block * iters))] int32 (wrapping), so that every word is read once."""
    n = buf.numel()
    out = torch.empty(triton.cdiv(n, block * iters), dtype=torch.int32, device=buf.device)
    _read_kernel[(out.numel(),)](buf, out, n, BLOCK=block, ITERS=iters, num_warps=num_warps)
    return out
