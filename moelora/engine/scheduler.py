"""Continuous batching: which requests run this step, and how many tokens each computes.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (decode: one token;
an unfinished prefill: the next chunk); waiting requests join FIFO while budget, sequence slots, KV blocks
and LoRA slots last. A batch holds at most `max_loras` distinct adapters because every running adapter
holds a slot; a request whose adapter cannot get a slot waits, and from then on no later request with an
adapter is admitted ahead of it (base requests still are), so every adapter gets its turn. When KV blocks
run out, the most recently arrived running request is preempted: its blocks and adapter reference are
freed, and it later recomputes its prompt and output so far.

With prefix caching (engine/prefix_cache.py), a request being admitted first takes the cached blocks of its
longest cached prefix (whole blocks, never its last token: that one's logits are needed) and computes from there;
requests that want prompt log-probabilities compute every position. register_blocks() names a running request's
newly full blocks after each step.

A request whose adapter cannot be read (its files gone or changed since it was loaded, after it left host memory)
fails alone: it is finished with `error` set and handed out by take_failed(); the rest of the batch runs on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from moelora.adapters.errors import AdapterError
from moelora.adapters.registry import AdapterRegistry
from moelora.adapters.slots import SlotPool
from moelora.engine.kv_cache import KVCache
from moelora.engine.prefix_cache import extend_hashes
from moelora.engine.request import Request, Status

UNKNOWN_TOKEN = -1  # a token still on the device (asynchronous scheduling's placeholder): its block is not named yet


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: its last row is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, kv: KVCache, pool: SlotPool | None, registry: AdapterRegistry | None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048) -> None:
        self.kv, self.pool, self.registry = kv, pool, registry
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.failed: list[Request] = []  # finished with an error since the last take_failed()
        self.num_preemptions = 0  # since start (metrics)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at first admissions (metrics)
        self.prefix_hits = 0  # of those, tokens found cached

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        # 1. running requests, oldest first; preempt the newest when blocks run out
        self.running.sort(key=attrgetter("arrival"))
        block_size = self.kv.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            end = req.num_computed + n
            # most decode steps: the last block has room (no allocation, nothing to preempt)
            while end > len(req.block_table) * block_size and not self._reserve(req, end):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # req itself was preempted: everything after it is too
            out.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
            i += 1
        # 2. waiting requests, FIFO
        blocked_adapter = False
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.adapter is not None and (blocked_adapter or self.pool is None
                                            or not self.pool.can_acquire(req.adapter)):
                blocked_adapter = True
                skipped.append(req)
                continue
            matched = self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if self.kv.blocks_needed(req.num_computed + n, len(req.block_table)) > self.kv.num_free_blocks:
                if matched:  # the cached blocks it took go back
                    self.kv.free(req.block_table)
                    req.block_table, req.num_computed, req.num_registered_blocks = [], 0, 0
                skipped.append(req)
                break  # no blocks: later requests would not fit either (FIFO)
            if not req.admitted:
                req.admitted = True
                if req.cache_identity is not None:
                    self.prefix_queries += len(req.prompt_ids)
                    self.prefix_hits += matched * self.kv.block_size
                    req.num_cached_tokens = matched * self.kv.block_size
            if req.adapter is not None:
                try:
                    req.slot = self.pool.acquire_by_name(req.adapter, self.registry.get)
                except AdapterError as e:  # its files are gone or changed: this request fails, no other
                    self._fail(req, str(e))
                    continue
                except Exception as e:  # writing its slot failed: the same, with what went wrong
                    self._fail(req, f"adapter {req.adapter!r} could not be put in a LoRA slot: "
                                    f"{type(e).__name__}: {e}")
                    continue
            self._reserve(req, req.num_computed + n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return out

    def _match_prefix(self, req: Request) -> int:
        """A request being admitted with nothing computed takes the cached blocks of its longest cached prefix
        (at most its first num_tokens - 1 tokens: the last is computed for its logits); returns how many."""
        if req.cache_identity is None or req.num_computed or req.block_table or req.wants_prompt_logprobs:
            return 0
        bs = self.kv.block_size
        hashes = extend_hashes(req.block_hashes, req.ids_slice, req.num_tokens - 1, bs, req.cache_identity,
                               UNKNOWN_TOKEN)
        blocks = self.kv.match(hashes[: (req.num_tokens - 1) // bs])
        req.block_table, req.num_registered_blocks, req.num_computed = blocks, len(blocks), len(blocks) * bs
        return len(blocks)

    def register_blocks(self, req: Request) -> None:
        """Name the request's full blocks computed since the last call in the prefix cache (a block holding a
        token still on the device waits for a later call)."""
        if req.cache_identity is None or req.finished:
            return
        bs = self.kv.block_size
        full = min(req.num_computed // bs, len(req.block_table))
        if full <= req.num_registered_blocks:
            return
        hashes = extend_hashes(req.block_hashes, req.ids_slice, full * bs, bs, req.cache_identity, UNKNOWN_TOKEN)
        for i in range(req.num_registered_blocks, min(full, len(hashes))):
            self.kv.cache_block(req.block_table[i], hashes[i], req.cache_identity)
        req.num_registered_blocks = min(full, len(hashes))

    def take_failed(self) -> list[Request]:
        """The requests failed (finished with `error`) since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def _fail(self, req: Request, error: str) -> None:
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason, req.error = "abort", error
        self.failed.append(req)

    def finish(self, req: Request) -> None:
        """Free everything a request holds (finished or aborted)."""
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self.kv.blocks_needed(num_tokens, len(req.block_table))
        if need > self.kv.num_free_blocks:
            return False
        req.block_table.extend(self.kv.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.kv.free(req.block_table)
            req.block_table = []
        req.num_registered_blocks = 0
        if req.status is Status.RUNNING and req.adapter is not None and req.slot >= 0:
            self.pool.release(req.adapter)
        req.slot = -1

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
