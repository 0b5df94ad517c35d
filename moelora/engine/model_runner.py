"""Runs one scheduled step through the model: flat batch, LoRA metadata, logits of the rows that matter."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moelora.layers.lora_batch import LoRABatch
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.cuda_graphs import StepGraphs
from moelora.engine.kv_cache import KVCache
from moelora.engine.scheduler import ScheduledChunk


@dataclass
class StepOutput:
    sample_logits: torch.Tensor  # [S, V] fp32, one row per chunk that samples (in `sampled` order)
    sampled: list[ScheduledChunk]
    prompt_logits: dict[int, torch.Tensor]  # index into chunks -> [n, V] logits of every row of that chunk


def graph_settings(args, model, device: torch.device, max_model_len: int) -> dict:
    """ModelRunner's CUDA-graph keywords from the engine arguments; every rank of a parallel engine derives
    them the same way, so all ranks capture the same graphs in the same order (their collectives pair up)."""
    cuda_graphs = (device.type == "cuda" and not args.enforce_eager and model.dtype in (torch.bfloat16, torch.float16)
                   and getattr(model, "supports_cuda_graphs", False))
    single = args.tensor_parallel_size * args.expert_parallel_size == 1  # eager steps are broadcast, not replayed
    prefill = single and getattr(model, "supports_prefill_graphs", False)
    return dict(cuda_graphs=cuda_graphs, max_graph_batch_size=min(args.max_graph_batch_size, args.max_num_seqs),
                max_blocks_per_seq=-(-max_model_len // args.block_size), max_num_seqs=args.max_num_seqs,
                max_prefill_graph_tokens=min(args.max_prefill_graph_tokens, args.max_num_batched_tokens) if prefill
                else 0)


class ModelRunner:
    def __init__(self, model, kv: KVCache, max_loras: int, cuda_graphs: bool = False, max_graph_batch_size: int = 64,
                 max_blocks_per_seq: int = 0, max_num_seqs: int = 1, max_prefill_graph_tokens: int = 0, broadcast=None,
                 broadcast_graph=None) -> None:
        """broadcast(seqs, sample_idx, prompt_idx): tensor/expert parallel, sends each eager step to the other ranks
        (engine/workers.py) before this rank runs it; broadcast_graph(token_ids, positions, block_tables, slots): the
        same for a decode step replayed from a CUDA graph (every rank replays its own capture). Under tensor/expert
        parallelism every rank constructs its runner at the same point (the captures' collectives pair up)."""
        self.model, self.kv, self.broadcast, self.broadcast_graph = model, kv, broadcast, broadcast_graph
        self.max_loras = max(max_loras, 1)
        self.graphs = None
        if cuda_graphs:
            self.graphs = StepGraphs(model, kv, max_loras, max_graph_batch_size, max_blocks_per_seq,
                                     max_prefill_graph_tokens, max_num_seqs)
            try:
                self.graphs.capture()
            except torch.cuda.OutOfMemoryError as e:
                raise RuntimeError(f"out of GPU memory while capturing CUDA graphs for decode batches up to "
                                   f"{max_graph_batch_size} and prefill steps up to {max_prefill_graph_tokens} tokens: "
                                   f"lower --max-graph-batch-size, --max-prefill-graph-tokens or "
                                   f"--gpu-memory-utilization (a smaller KV cache), or run with --enforce-eager ({e})"
                                   ) from None

    def release_graphs(self) -> None:
        """Free the CUDA graphs (before a parallel rank leaves its process group); later steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _graph_step(self, chunks: list[ScheduledChunk], input_tokens: torch.Tensor | None) -> StepOutput | None:
        """A pure decode step (one new token per sequence, nothing but sampling wanted) from a CUDA graph."""
        g = self.graphs
        if g is None or len(chunks) > g.max_batch_size:
            return None
        if any(c.num_tokens != 1 or not c.samples or c.request.wants_prompt_logprobs for c in chunks):
            return None
        inputs = ([c.request.token_at(c.start) for c in chunks], [c.start for c in chunks],
                  [c.request.block_table for c in chunks], [c.request.slot for c in chunks])
        if self.broadcast_graph is not None:  # tensor/expert parallel: the other ranks replay the same step
            self.broadcast_graph(*inputs)
        return StepOutput(self.replay(*inputs, input_tokens=input_tokens), list(chunks), {})

    @torch.no_grad()
    def replay(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
               slots: list[int], input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per sequence from the captured graph of its batch bucket -> logits [n, V]
        (compute_logits' collectives included: a parallel worker calls this for rank 0's graph steps).
        input_tokens: [n] on the device, used instead of token_ids (asynchronous scheduling)."""
        return self.model.compute_logits(
            self.graphs.run(token_ids, positions, block_tables, slots, input_tokens=input_tokens))

    @torch.no_grad()
    def execute(self, chunks: list[ScheduledChunk], input_tokens: torch.Tensor | None = None) -> StepOutput:
        """input_tokens: [len(chunks)] int64 on the model's device, the input token of each chunk, for a step whose
        chunks are all one-token decodes scheduled before their input tokens reached the host (asynchronous
        scheduling: the tokens the previous step sampled, still on the device)."""
        if input_tokens is not None and (self.broadcast is not None or any(c.num_tokens != 1 for c in chunks)):
            raise ValueError("input_tokens: only for one-token decode chunks on a single-rank engine")
        out = self._graph_step(chunks, input_tokens)
        if out is not None:
            return out
        seqs = [SeqChunk(c.request.ids_slice(c.start, c.start + c.num_tokens), c.start, c.request.block_table,
                         c.request.slot) for c in chunks]
        sample_idx = [i for i, c in enumerate(chunks) if c.samples]
        prompt_idx = [i for i, c in enumerate(chunks)
                      if c.request.wants_prompt_logprobs and c.start < len(c.request.prompt_ids)]
        g = self.graphs  # a prefill / mixed step from a graph (single rank: no broadcast; decode steps past the
        # decode graphs stay eager, on the decode attention kernel)
        if (g is not None and self.broadcast is None and not prompt_idx and input_tokens is None
                and any(c.num_tokens > 1 for c in chunks)
                and g.prefill_bucket(sum(c.num_tokens for c in chunks), len(chunks))):
            hidden = g.run_mixed(seqs)
            last = list(itertools.accumulate(c.num_tokens for c in chunks))
            return StepOutput(self.model.compute_logits(hidden[[last[i] - 1 for i in sample_idx]]),
                              [chunks[i] for i in sample_idx], {})
        if self.broadcast is not None:  # tensor/expert parallel: the other ranks run the same step
            self.broadcast(seqs, sample_idx, prompt_idx)
        sample_logits, prompt_logits = self.forward_step(seqs, sample_idx, prompt_idx, input_tokens)
        return StepOutput(sample_logits, [chunks[i] for i in sample_idx], prompt_logits)

    @torch.no_grad()
    def forward_step(self, seqs: list[SeqChunk], sample_idx: list[int], prompt_idx: list[int],
                     input_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One forward over seqs; logits [S, V] of the last row of each seqs[i], i in sample_idx, and per i in
        prompt_idx the logits [n_i, V] of all of seqs[i]'s rows. Every rank of a parallel model runs this with
        the same arguments (its collectives pair up). input_tokens: [len(seqs)] on the device, the input ids of
        one-token seqs (their host ids are placeholders)."""
        device = self.model.device
        fb = build_flat_batch(seqs, self.kv.block_size, device)
        if input_tokens is not None:
            fb.input_ids.copy_(input_tokens)
        lora = LoRABatch.build(fb.token_slots, self.max_loras, device)
        hidden = self.model(fb.input_ids, fb.positions, fb.attn, self.kv.caches, lora)  # [T, H]
        sample_logits = self.model.compute_logits(hidden[[fb.last_token_rows[i] for i in sample_idx]])
        q = fb.attn.query_start_loc
        prompt_logits = {i: self.model.compute_logits(hidden[q[i] : q[i + 1]]) for i in prompt_idx}
        return sample_logits, prompt_logits
