"""Runs one scheduled step through the model: flat batch, LoRA metadata, logits of the rows that matter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.adapters.metadata import LoRABatch
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.engine.scheduler import ScheduledChunk


@dataclass
class StepOutput:
    sample_logits: torch.Tensor  # [S, V] fp32, one row per chunk that samples (in `sampled` order)
    sampled: list[ScheduledChunk]
    prompt_logits: dict[int, torch.Tensor]  # index into chunks -> [n, V] logits of every row of that chunk


class ModelRunner:
    def __init__(self, model, kv: KVCache, max_loras: int) -> None:
        self.model = model
        self.kv = kv
        self.max_loras = max(max_loras, 1)

    @torch.no_grad()
    def execute(self, chunks: list[ScheduledChunk]) -> StepOutput:
        device = self.model.device
        seqs = [
            SeqChunk(c.request.all_ids[c.start : c.start + c.num_tokens], c.start, c.request.block_table, c.request.slot)
            for c in chunks
        ]
        fb = build_flat_batch(seqs, self.kv.block_size, device)
        lora = LoRABatch.build(fb.token_slots, self.max_loras, device)
        hidden = self.model(fb.input_ids, fb.positions, fb.attn, self.kv.caches, lora)  # [T, H]
        sampled = [c for c in chunks if c.samples]
        rows = [fb.last_token_rows[i] for i, c in enumerate(chunks) if c.samples]
        sample_logits = self.model.compute_logits(hidden[rows])
        prompt_logits = {}
        q = fb.attn.query_start_loc
        for i, c in enumerate(chunks):
            if c.request.wants_prompt_logprobs and c.start < len(c.request.prompt_ids):
                prompt_logits[i] = self.model.compute_logits(hidden[q[i] : q[i + 1]])
        return StepOutput(sample_logits, sampled, prompt_logits)
