"""Split-K for the quantized GEMMs at decode sizes (fp8_triton's and nvfp4_triton's): each K split stores its fp32
partial tile in a workspace and counts itself in a per-tile arrival counter; the split arriving last adds the
partials in split order (deterministic) and resets the counter for the next launch."""

from __future__ import annotations

import torch

from moelora.kernels._triton import HAS_TRITON

_COUNTERS: dict[torch.device, torch.Tensor] = {}

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, sk, tile, SPLIT_K: tl.constexpr):
        """The split-K epilogue of a [BLOCK_M, BLOCK_N] fp32 tile: split sk stores its partial in ws[sk] ([SPLIT_K,
        M, N] fp32, contiguous) and counts itself in cnt[tile]; the split arriving last adds the partials in order
        sk = 0, 1, ... and resets the counter to 0 for the next launch (stream order). Returns (the sum on the last
        split, else acc unchanged; whether last): the caller returns unless last."""
        tile_ws = ws_ptr + rows[:, None] * N + offs_n[None, :]
        mask_c = mask_m[:, None] & mask_n[None, :]
        tl.store(tile_ws + sk * M * N, acc, mask=mask_c)
        tl.debug_barrier()  # every thread's partial stored before the count (the atomic is acq_rel, gpu scope)
        last = tl.atomic_add(cnt_ptr + tile, 1) == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            for j in range(SPLIT_K):
                acc += tl.load(tile_ws + j * M * N, mask=mask_c, other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + tile, 0)
        return acc, last


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The arrival counters of split-K tiles: int32 zeros, one buffer per device, left at zero by every launch, so
    launches in stream order (and in graph replays) share it. Made eagerly only: inside a CUDA-graph capture an
    allocation's zero-fill is only recorded, not run (a graph replayed before the one holding that memset would
    read garbage counters), so a capture that finds no buffer gets None and the GEMM does not split; the engine's
    warm-up run before each capture makes it. 4,096 counters: a split GEMM has < 264 tiles, a split attention
    < 528 (row, KV head) pairs (a replaced buffer would leave captured graphs pointing at freed memory); neither
    runs on two streams at once."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = cnt
    return cnt


def counters_ready(device: torch.device, tiles: int) -> bool:
    """Whether split_counters(device, tiles) returns an existing buffer (no zero-fill launch)."""
    cnt = _COUNTERS.get(device)
    return cnt is not None and cnt.numel() >= tiles


def split_k_buffers(out: torch.Tensor, tiles: int, split_k: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split_k, ws, cnt) for a launch whose kernel ends in split_k_reduce: the partials' workspace
    [split_k, M, N] fp32 and the arrival counters; split_k 1 (out standing in for both) when no split is asked
    or when the counters do not exist yet inside a graph capture (split_counters). out: [M, N]."""
    if split_k <= 1:
        return 1, out, out
    cnt = split_counters(out.device, tiles)
    if cnt is None:  # first use inside a graph capture: no counters can be made here
        return 1, out, out
    return split_k, torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device), cnt
