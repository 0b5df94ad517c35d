"""Paged KV cache: per-layer block tensors and a reference-counted block allocator that keeps freed blocks holding
a cached prefix (engine/prefix_cache.py) reusable until their memory is needed."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from moelora.config import ModelConfig
from moelora.models.registry import kv_cache_shapes


class KVCache:
    """Per layer, the tuple of cache tensors its attention reads, as the model class declares them
    (models.registry.kv_cache_shapes): (k, v) of [num_blocks, block_size, num_kv_heads, head_dim], or for MLA one
    latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]. A sequence's block table lists its
    blocks in position order.

    Allocation: every block has a reference count (the sequences whose tables hold it). A freed block that holds
    a cached prefix (cache_block gave it a hash) stays in the hash index, evictable, least recently used first;
    allocate() hands out never-cached free blocks first, then evicts the least recently used cached ones.
    num_free_blocks counts both."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.caches = [tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in layer)
                       for layer in kv_cache_shapes(cfg, num_blocks + 1, block_size)]
        self.dummy_block = num_blocks  # never handed out: CUDA-graph padding rows write their keys here
        self._free = list(range(num_blocks - 1, -1, -1))  # free blocks holding no cached prefix (a stack)
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block holding it
        self._hash_of: dict[int, tuple[bytes, str]] = {}  # block -> (its hash, its identity)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, LRU first
        self.min_free = num_blocks  # the fewest free blocks there have been (metrics: how close the cache came to full)
        self.evictions = 0  # cached blocks reused for other contents (metrics)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(shape) for layer in kv_cache_shapes(cfg, 1, block_size) for shape in layer) * elem

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (in use or evictable)."""
        return len(self._hash_of)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with one reference: free ones first, then the least recently used cached ones."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {n}, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        self.min_free = min(self.min_free, self.num_free_blocks)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a sequence's table, in position order). A block no sequence holds
        any more becomes free; a cached one stays findable, the table's last blocks first in line for eviction."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if self._refs[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # ---- prefix caching (engine/prefix_cache.py names the blocks) -----------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each given one more reference (a freed block is
        taken off the eviction list)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        return out

    def cache_block(self, block: int, h: bytes, identity: str) -> None:
        """Record that `block` (full, its keys and values written or queued in stream order) holds the prefix named
        h. A prefix another block already holds keeps that block."""
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = (h, identity)

    def drop_identity(self, identity: str) -> None:
        """Make every cached block computed under `identity` unfindable (an adapter unloaded). Blocks no sequence
        holds become plain free blocks."""
        blocks = [b for b, (_, ident) in self._hash_of.items() if ident == identity]
        for b in blocks:
            self._uncache(b)
            if b in self._evictable:
                del self._evictable[b]
                self._free.append(b)

    def _uncache(self, block: int) -> None:
        h, _ = self._hash_of.pop(block)
        del self._block_of[h]
