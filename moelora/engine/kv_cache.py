"""Paged KV cache: per-layer block tensors and a free-list block allocator."""

from __future__ import annotations

import torch

from moelora.config import ModelConfig


class KVCache:
    """k/v per layer: [num_blocks, block_size, num_kv_heads, head_dim]. Block ids are handed out
    from a free list; a sequence's block table lists its blocks in position order."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
