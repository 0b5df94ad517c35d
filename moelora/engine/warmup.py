"""Start-up warm-up of the eager step (prefill chunks, mixed steps, decode beyond the graphs). Triton builds a kernel
variant at its first launch with a new specialization (each int argument 1, a multiple of 16 or neither) or launch
config (picked at power-of-two token or pair counts), and that step waits for it: seconds of a request's time to
first token. The decode graphs build theirs at capture; this runs each class of eager step once, so serving builds none.
"""

from __future__ import annotations

import torch

from moelora.engine.batch import build_flat_batch, dummy_chunks
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
             for c in (([min(step, n - i) for i in range(0, n, step)], 0, False),
                       ([1] + [min(step, n - 1 - i) for i in range(0, n - 1, step)], bs, True))]
    cases += [c for b in warmup_token_counts(max_seqs) if b > 1
              for c in (([1] * b, 0, False), ([2] + [1] * (b - 1), 0, True))]
    for lens, context, lora_on in cases:
        seqs = dummy_chunks(lens, context, bs, kv.num_blocks)
        if seqs is None:
            continue
        fb = build_flat_batch(seqs, bs, device)
        if lora_on and max_loras:
            lora = LoRABatch.build([t % max_loras for t in range(len(fb.token_slots))], max_loras, device)
            lora.graph = True  # every LoRA kernel runs, whatever the slots hold (as in a captured graph)
        else:  # as a step of base-model requests has it
            lora = LoRABatch.build(fb.token_slots, max(max_loras, 1), device)
        hidden = model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
        logits = model.compute_logits(hidden[fb.last_token_rows])
        if sampler is not None:
            rows = logits.shape[0]
            sampler.sample_tokens(logits, [SamplingParams(temperature=1.0)] * rows, [None] * rows)
        runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runs
