"""Asynchronous scheduling: the next decode step is scheduled and launched before this step's tokens reach the host.

A synchronous decode step ends with the sampled tokens read back (a device synchronisation); the scheduler, the
graph inputs, sampling's launches and the per-request bookkeeping then run while the GPU idles (0.4-0.9 ms a
step at batch 64 on the H200, `bench decode`'s host_ms). Here, when step N's batch is pure decode and will still
be next step (nothing waiting, no request ending by length with N's token, KV blocks for every row):
    1. step N's sampling stays on the device and its tokens are copied to pinned host memory behind an event;
    2. each request gets a placeholder for its step-N token; the scheduler schedules step N+1 as usual;
    3. step N+1 is launched with step N's device tokens as its input ids (LLMEngine._execute(..., input_tokens));
    4. only then is step N read (the event: step N's work, not N+1's), placeholders replaced, stop checks run —
       while the GPU runs step N+1.
A request that stops on step N's token (EOS, a stop string) was computed once more in step N+1 for nothing: that
row is dropped when step N+1 is read (its KV writes land in blocks freed after it in stream order). Rows asking
for logprobs or penalties, prompt logprobs, and tensor/expert-parallel engines keep the synchronous step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.engine.kv_cache import KVCache
from moelora.engine.model_runner import StepOutput
from moelora.engine.request import Request
from moelora.engine.sampler import Sampler, apply_logit_bias, to_device
from moelora.engine.scheduler import UNKNOWN_TOKEN, ScheduledChunk, Scheduler

PLACEHOLDER = UNKNOWN_TOKEN  # a request's step-N token while step N+1 is scheduled on it (replaced when step N is read)


@dataclass
class PendingStep:
    """A step whose tokens are still on the device: requests[i] sampled tokens[i]."""

    requests: list[Request]
    tokens: torch.Tensor  # [n] int64 on the device
    host: torch.Tensor  # [n] int64, pinned, filled by an asynchronous copy
    copied: torch.cuda.Event | None  # recorded after the copy (None on the CPU)

    def read(self) -> list[tuple[Request, int]]:
        """(request, token) pairs, waiting for this step's work only (not for steps launched after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        return list(zip(self.requests, self.host.tolist()))


@dataclass
class AheadStep:
    chunks: list[ScheduledChunk]
    input_tokens: torch.Tensor  # [len(chunks)] on the device: each chunk's input id


def can_defer(out: StepOutput) -> bool:
    """A step whose sampling can stay on the device: it samples, reports no logprobs and applies no penalties
    (those read the host's token lists), and wants no prompt logprobs."""
    return bool(out.sampled) and not out.prompt_logits and all(
        c.request.params.logprobs is None and not c.request.params.needs_penalties for c in out.sampled)


def launch_sampling(sampler: Sampler, out: StepOutput) -> PendingStep:
    """Sample out's rows on the device and start copying the tokens to the host; nothing waits."""
    reqs = [c.request for c in out.sampled]
    params = [r.params for r in reqs]
    tokens = sampler.sample_tokens(apply_logit_bias(out.sample_logits, params), params, [r.generator for r in reqs])
    if not tokens.is_cuda:
        return PendingStep(reqs, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return PendingStep(reqs, tokens, host, copied)


def schedule_ahead(scheduler: Scheduler, kv: KVCache, pending: PendingStep, max_model_len: int) -> AheadStep | None:
    """Schedule the decode step after `pending` before its tokens are read, or None (then the engine reads them
    first and schedules as usual): the running requests must be exactly pending's, fully computed, none ending
    by length with its pending token, nothing waiting, and the KV cache able to extend every one (no
    preemption). Appends a PLACEHOLDER to each request's outputs."""
    reqs = pending.requests
    if (scheduler.waiting or len(scheduler.running) != len(reqs)
            or {id(r) for r in scheduler.running} != {id(r) for r in reqs}):
        return None
    need = 0
    for r in reqs:
        if (r.finished or r.num_computed != r.num_tokens or r.num_tokens + 1 >= max_model_len
                or (r.params.max_tokens is not None and len(r.output_ids) + 1 >= r.params.max_tokens)):
            return None
        need += kv.blocks_needed(r.num_tokens + 1, len(r.block_table))
    if need > kv.num_free_blocks:
        return None
    for r in reqs:
        r.output_ids.append(PLACEHOLDER)
    chunks = scheduler.schedule()
    if len(chunks) != len(reqs) or any(c.num_tokens != 1 or not c.samples for c in chunks):
        raise RuntimeError(f"asynchronous scheduling: expected {len(reqs)} one-token decode chunks, the scheduler "
                           f"gave {[(c.request.request_id, c.num_tokens) for c in chunks]}")
    row = {id(r): i for i, r in enumerate(reqs)}
    idx = [row[id(c.request)] for c in chunks]
    if idx == list(range(len(reqs))):
        return AheadStep(chunks, pending.tokens)
    return AheadStep(chunks, pending.tokens[to_device(idx, torch.int64, pending.tokens.device)])
