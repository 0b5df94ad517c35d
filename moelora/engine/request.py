"""A request as the engine tracks it: tokens, progress through the cache, adapter, outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moelora.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    arrival: int  # arrival order (FIFO)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens (prompt, then output) already in the KV cache
    block_table: list[int] = field(default_factory=list)
    slot: int = -1  # LoRA slot while running (-1 = base model)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why this request alone failed (finish_reason "abort"): e.g. its adapter's files
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    text: str = ""  # detokenized output (after stop-string handling)
    num_preemptions: int = 0
    first_token_time: float | None = None
    detok: object | None = None  # IncrementalDetokenizer when a tokenizer is present
    stopper: object | None = None  # StopChecker
    # prefix caching (engine/prefix_cache.py): what its keys and values are computed under (None: no caching),
    # the hash chain of its full blocks so far, how many of its table's blocks are in the cache index, and how
    # many prompt tokens its first admission found cached (usage.prompt_tokens_details.cached_tokens)
    cache_identity: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    admitted: bool = False  # admitted once (preemptions re-admit it)

    def ids_slice(self, start: int, stop: int) -> list[int]:
        """(prompt_ids + output_ids)[start:stop], the sum not built (a step reads one token of a long sequence)."""
        P = len(self.prompt_ids)
        if stop <= P:
            return self.prompt_ids[start:stop]
        if start >= P:
            return self.output_ids[start - P : stop - P]
        return self.prompt_ids[start:] + self.output_ids[: stop - P]

    def token_at(self, i: int) -> int:
        """(prompt_ids + output_ids)[i] (0 <= i < num_tokens), the sum not built."""
        P = len(self.prompt_ids)
        return self.prompt_ids[i] if i < P else self.output_ids[i - P]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)
