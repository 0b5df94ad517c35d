"""Start-up warm-up of the eager step (prefill chunks, mixed prefill + decode steps, decode beyond the graphs).

Triton builds a kernel variant at the first launch with a new specialization (each int argument 1, a multiple of
16 or neither) or launch config (picked at token or pair counts that are powers of two), and that step waits for
it: seconds in a request's time to first token. The CUDA graphs build the decode step's variants at capture; this
runs the eager forward once per class of token count, with and without LoRA kernels, so that serving builds none.
"""

from __future__ import annotations

import torch

from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.engine.sampling_params import SamplingParams
from moelora.layers.lora_batch import LoRABatch


def warmup_token_counts(max_tokens: int) -> list[int]:
    """The token counts one warm-up forward each: every power of two p <= max_tokens and p + 1 (in each range
    between two thresholds an int of each class: a multiple of 16 and not), and max_tokens. Ascending."""
    counts, p = {max_tokens}, 1
    while p <= max_tokens:
        counts.update(n for n in (p, p + 1) if n <= max_tokens)
        p *= 2
    return sorted(counts)


def _chunks(num_tokens: int, context: int, block_size: int, num_blocks: int, slot: int) -> list[SeqChunk] | None:
    """num_tokens new tokens with `context` tokens cached before them: one sequence, or (context > 0, two tokens
    or more) a one-token decode row beside a chunk of the rest, as a mixed step has. The blocks are the cache's
    first ones (nothing is cached yet at start-up); None when they do not fit."""
    lens = [num_tokens] if context == 0 or num_tokens < 2 else [1, num_tokens - 1]
    out, nxt = [], 0
    for n in lens:
        b = -(-(context + n) // block_size)
        if nxt + b > num_blocks:
            return None
        out.append(SeqChunk([0] * n, context, list(range(nxt, nxt + b)), slot))
        nxt += b
    return out


def warm_up(model, kv: KVCache, args, sampler=None) -> int:
    """The engine's warm-up (EngineArgs.kernel_warmup, on a GPU; else nothing, 0): warm_up_eager up to
    max_num_batched_tokens, the sampler (rank 0's) up to max_num_seqs rows. Every rank derives the same."""
    if model.device.type != "cuda" or not args.kernel_warmup:
        return 0
    return warm_up_eager(model, kv, args.max_num_batched_tokens, args.max_loras, sampler, args.max_num_seqs)


@torch.no_grad()
def warm_up_eager(model, kv: KVCache, max_tokens: int, max_loras: int, sampler=None,
                  max_rows: int = 0) -> int:
    """Run the eager forward for each of warmup_token_counts(max_tokens) twice: a fresh sequence without LoRA,
    then rows after a cached block (a decode row beside a chunk) with every LoRA kernel on, the tokens spread over
    the slots (their ranks are read on the device: empty slots add nothing but build the same variants). Writes
    the first KV blocks: call it before any request has one. sampler (rank 0's Sampler): then samples [n, V]
    logits at temperature 1 for each of warmup_token_counts(max_rows) rows. Returns the forwards run. Every rank
    of a parallel engine runs the same forwards (their collectives pair up)."""
    device, runs, logits = model.device, 0, None
    for n in warmup_token_counts(max_tokens):
        for lora_on in (False, True):
            seqs = _chunks(n, kv.block_size if lora_on else 0, kv.block_size, kv.num_blocks, -1)
            if seqs is None:
                continue
            fb = build_flat_batch(seqs, kv.block_size, device)
            if lora_on and max_loras:
                lora = LoRABatch.build([t % max_loras for t in range(n)], max_loras, device)
                lora.graph = True  # every LoRA kernel runs, whatever the slots hold (as in a captured graph)
            else:  # as a step of base-model requests has it
                lora = LoRABatch.build(fb.token_slots, max(max_loras, 1), device)
            hidden = model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
            logits = model.compute_logits(hidden[fb.last_token_rows])
            runs += 1
    if sampler is not None and logits is not None:
        for n in warmup_token_counts(max_rows):
            sampler.sample_tokens(logits[:1].expand(n, -1).contiguous(), [SamplingParams(temperature=1.0)] * n,
                                  [None] * n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runs
