"""Paged KV cache: per-layer block tensors and a free-list block allocator."""

from __future__ import annotations

import math

import torch

from moelora.config import ModelConfig
from moelora.models.registry import kv_cache_shapes


class KVCache:
    """Per layer, the tuple of cache tensors its attention reads, as the model class declares them
    (models.registry.kv_cache_shapes): (k, v) of [num_blocks, block_size, num_kv_heads, head_dim], or for MLA one
    latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]. Block ids are handed out from a free
    list; a sequence's block table lists its blocks in position order."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caches = [
            tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in layer)
            for layer in kv_cache_shapes(cfg, num_blocks + 1, block_size)
        ]
        self.dummy_block = num_blocks  # never handed out: CUDA-graph padding rows write their keys here
        self._free = list(range(num_blocks - 1, -1, -1))
        self.min_free = num_blocks  # the fewest free blocks there have been (metrics: how close the cache came to full)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(shape) for layer in kv_cache_shapes(cfg, 1, block_size) for shape in layer) * elem

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {n}, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self.min_free = min(self.min_free, len(self._free))
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
