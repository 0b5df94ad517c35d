"""Start-up warm-up of the eager step (prefill chunks, mixed steps, decode beyond the graphs). Triton builds a kernel
variant at its first launch with a new specialization (each int argument 1, a multiple of 16 or neither) or launch
config (picked at power-of-two token or pair counts), and that step waits for it: seconds of a request's time to
first token. The decode graphs build theirs at capture; this runs each class of eager step once, so serving builds none.
"""

from __future__ import annotations

import torch

from moelora.engine.batch import build_flat_batch, dummy_chunks, split_tokens
from moelora.engine.kv_cache import KVCache
from moelora.engine.sampling_params import SamplingParams
from moelora.layers.lora_batch import LoRABatch


def warmup_token_counts(max_tokens: int) -> list[int]:
    """The token counts one warm-up forward each: every power of two p <= max_tokens and p + 1 (in each range
    between two thresholds an int of each class: a multiple of 16 and not), and max_tokens. Ascending."""
    powers = [1 << i for i in range(max_tokens.bit_length())]
    return sorted({max_tokens} | {n for p in powers for n in (p, p + 1) if n <= max_tokens})


def warm_up(model, kv: KVCache, args, max_model_len: int, sampler=None) -> int:
    """The engine's warm-up (EngineArgs.kernel_warmup, on a GPU; else nothing, 0): warm_up_eager up to
    max_num_batched_tokens tokens and max_num_seqs sequences, sampling on rank 0. Every rank derives the same."""
    if model.device.type != "cuda" or not args.kernel_warmup:
        return 0
    return warm_up_eager(model, kv, args.max_num_batched_tokens, args.max_loras, sampler, args.max_num_seqs,
                         max_model_len)


@torch.no_grad()
def warm_up_eager(model, kv: KVCache, max_tokens: int, max_loras: int, sampler=None, max_seqs: int = 1,
                  max_len: int = 1 << 30) -> int:
    """Eager forwards: per n of warmup_token_counts(max_tokens), n fresh tokens without LoRA, and a decode row beside
    n - 1 tokens after a cached block with every LoRA kernel on (tokens spread over the slots); per b > 1 of
    warmup_token_counts(max_seqs), b one-token rows, and b rows one of two tokens with LoRA; no sequence past max_len.
    Logits sampled by `sampler` if given. Call it before any request (it writes the first KV blocks)."""
    device, runs, bs = model.device, 0, kv.block_size
    step = max(1, max_len - bs - 1)  # no sequence past max_len (max_model_len) tokens
    cases = [c for n in warmup_token_counts(max_tokens)
             for c in ((split_tokens(n, step), 0, False), ([1] + split_tokens(n - 1, step), bs, True))]
    cases += [c for b in warmup_token_counts(max_seqs) if b > 1
              for c in (([1] * b, 0, False), ([2] + [1] * (b - 1), 0, True))]
    for lens, context, lora_on in cases:
        if (seqs := dummy_chunks(lens, context, bs, kv.num_blocks)) is None:  # the cache holds too few blocks
            continue
        fb = build_flat_batch(seqs, bs, device)
        T = len(fb.token_slots)  # without LoRA: as a step of base-model requests has it
        lora = LoRABatch.every_slot(T, max_loras, device) if lora_on else LoRABatch.empty(T, max(max_loras, 1), device)
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)[fb.last_token_rows])
        if sampler is not None:
            sampler.sample_tokens(logits, [SamplingParams(temperature=1.0)] * len(seqs), [None] * len(seqs))
        runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runs
