"""CUDA graphs of the model's step: one graph per decode batch-size bucket (b sequences of one token) and, up to
--max-prefill-graph-tokens, per prefill / mixed step bucket (T tokens over at most S < T sequences: prompt chunks,
cached-prefix suffixes and decode rows together), each in four sets captured at start-up into one shared memory
pool: with LoRA kernels, without (base-only batches), LoRA on the dense weights only ("dense": batches whose
adapters adapt no routed expert, e.g. PEFT's default attention targets) and on the routed experts only ("experts").

Replay refreshes static buffers in place: token ids, positions, KV slots, block tables, per-sequence lengths (and
row offsets), and the LoRA slot groups. Rows past the real batch are padding: LoRA slot -1, KV writes into the
cache's dummy block, attention skipped (token_seq -1); sequences past it are empty.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from moelora.layers.lora_batch import LoRABatch
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.graph_inputs import DecodeHostInputs
from moelora.engine.kv_cache import KVCache
from moelora.layers.attention import AttentionMetadata
from moelora.layers.lora import LORA_SLOT_WRITES, LoRAWeights, lora_work_count, slot_target_groups

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
PREFILL_BUCKETS = (32, 64, 128, 256, 512)  # tokens of a prefill / mixed step graph
# The "dense" / "experts" variants: attention-only adapters at batch 64 fp8 cost 11.13 / 11.35 ms a step with 4 / 8
# adapters against 11.87 / 12.10 in the full LoRA graph (no adapter 10.46), experts-only 11.78 / 11.97 against 12.42
# / 12.65.
GRAPH_MODES: tuple[bool | str, ...] = (True, False, "dense", "experts")


def lora_graph_mode(slots: list[int], groups: list[tuple[bool, bool]]) -> bool | str:
    """Which graph serves a batch: False (no token on an adapter, or none of its slots adapts anything), True (LoRA
    kernels everywhere), "dense" / "experts" (the batch's slots adapt only dense weights / only routed experts).
    groups: slot_target_groups of the model."""
    used = {s for s in slots if s >= 0}
    if not used:
        return False
    dense = any(groups[s][0] for s in used)
    experts = any(groups[s][1] for s in used)
    if dense and experts:
        return True
    return "dense" if dense else ("experts" if experts else False)


class StepGraphs:
    def __init__(self, model, kv: KVCache, max_loras: int, max_batch_size: int, max_blocks_per_seq: int,
                 max_prefill_tokens: int = 0, max_num_seqs: int = 1) -> None:
        self.model, self.kv, self.max_loras = model, kv, max(max_loras, 1)
        self.buckets = [b for b in BUCKETS if b <= max_batch_size] or [1]
        B = self.buckets[-1]
        # prefill / mixed buckets (T, S): T tokens over at most S sequences, S < T (the prefill attention kernel)
        self.prefill_buckets = [(t, min(max_num_seqs, t - 1)) for t in PREFILL_BUCKETS if t <= max_prefill_tokens]
        T = max([B] + [t for t, _ in self.prefill_buckets])
        S = max([B] + [s for _, s in self.prefill_buckets])
        dev = model.device
        self.dummy_slot = kv.dummy_block * kv.block_size
        self._sizes = (T, S, max_blocks_per_seq)
        self._reset_buffers()
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)  # decode: one row a sequence, never rewritten
        rows = set(self.buckets) | {t for t, _ in self.prefill_buckets}
        self.lora_batches = {n: LoRABatch.static(n, self.max_loras, dev) for n in rows}
        # the step's host arrays, kept between steps (block tables updated in place; pinned: asynchronous copies)
        pin = dev.type == "cuda"
        self.host = DecodeHostInputs(B, max_blocks_per_seq, kv.block_size, self.dummy_slot, pin=pin)
        self._copied = torch.cuda.Event() if pin else None  # the last step's host-to-device copies
        # keys (bucket, mode): bucket b (decode) or (T, S) (prefill); mode True (LoRA), False (base only),
        # "dense" / "experts" (lora_graph_mode)
        self.graphs: dict[tuple[int | tuple[int, int], bool | str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # capture(): the pool every graph shares
        self.max_batch_size = B
        self.replays: dict[tuple, int] = {}  # (bucket, mode) -> replays, for tests and stats
        self.lora_layer_calls: dict[tuple, int] = {}  # LoRA computations recorded into each graph
        # per graph: (MoE block, its top-k ids, its router logits or None), outputs of the capture kept alive
        self._routing: dict[tuple, list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]]] = {}
        self._lora_weights = [m for m in model.modules() if isinstance(m, LoRAWeights)]
        self._groups_at, self._groups = -1, []  # slot_target_groups as of LORA_SLOT_WRITES == _groups_at

    def _attn(self, t: int, s: int, qsl: torch.Tensor) -> AttentionMetadata:
        """A bucket's metadata: t rows over s sequences, their row offsets qsl[: s + 1] (self.qsl: a decode
        bucket's, one row each); the host lists are placeholders (the device path reads none)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:s], seq_lens=[1] * s,
            query_start_loc=list(range(s + 1)), token_seq=self.token_seq[:t], seq_lens_t=self.seq_lens[:s],
            query_start_loc_t=qsl[: s + 1],
        )

    def _reset_buffers(self) -> None:
        """The static input buffers, made as padding (at construction and before each capture: a capture's forwards
        write KV at whatever slots the buffers hold; on a recapture an earlier step's, in blocks since given to other
        sequences)."""
        (T, S, width), dev = self._sizes, self.model.device
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((T,), self.dummy_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(S, width, dtype=torch.int32, device=dev)
        self.token_seq = torch.full((T,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(S, dtype=torch.int32, device=dev)
        self.prefill_qsl = torch.zeros(S + 1, dtype=torch.int32, device=dev)

    def _record(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, int]:
        """forward() once on a side stream (Triton compiles, cuBLAS picks kernels), then captured into the shared
        pool -> (graph, its output, the LoRA computations recorded into it)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        calls = lora_work_count()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()  # the graphs' shared memory pool (tests read its segments)
        return graph, out, lora_work_count() - calls

    @torch.no_grad()
    def capture(self) -> None:
        self._reset_buffers()
        self.pool = None
        shapes = [(b, b, self._attn(b, b, self.qsl)) for b in self.buckets]
        shapes += [((t, s), t, self._attn(t, s, self.prefill_qsl)) for t, s in self.prefill_buckets]
        shapes.sort(key=lambda x: -x[1])  # largest first: smaller graphs reuse its memory
        overlap = self.model.lora_overlap_state()
        for mode in GRAPH_MODES:
            for key, rows, attn in shapes:
                lora = self._lora_batch(rows, mode)
                # prefill graphs without the LoRA side stream: captured with it, a replay of a mixed step hit an
                # illegal address under asynchronous execution and its capture allocated pool memory on the side
                # stream (H100); the decode graphs keep it
                self.model.set_overlap(overlap and not isinstance(key, tuple))
                graph, out, calls = self._record(functools.partial(
                    self.model, self.input_ids[:rows], self.positions[:rows], attn, self.kv.caches, lora))
                self.graphs[(key, mode)] = (graph, out)
                self.lora_layer_calls[(key, mode)] = calls
                # each MoE block's routing output of this graph (statistics and tests read it after a replay)
                self._routing[(key, mode)] = [(m, m.last_topk_ids, getattr(m, "last_router_logits", None))
                                              for m in self.model.modules()
                                              if getattr(m, "last_topk_ids", None) is not None]
        self.model.set_overlap(overlap)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def recapture(self) -> None:
        """Drop the graphs and capture them again (after the model's kernel config or overlap changed: a graph keeps
        the kernels and streams it recorded)."""
        self.release()
        torch.cuda.empty_cache()
        self.capture()

    def _lora_batch(self, bs: int, mode: bool | str) -> LoRABatch | None:
        """The LoRA metadata a graph of this mode is captured with (the variants share the bucket's buffers)."""
        if mode is False:
            return None
        lb = self.lora_batches[bs]
        if mode is True:
            return lb
        return dataclasses.replace(lb, skip_experts=mode == "dense", skip_dense=mode == "experts")

    def mode(self, slots: list[int]) -> bool | str:
        """lora_graph_mode of a batch, the slots' target groups recomputed after any slot write."""
        if self._groups_at != LORA_SLOT_WRITES[0]:
            self._groups_at = LORA_SLOT_WRITES[0]
            self._groups = slot_target_groups(self._lora_weights, self.max_loras)
        return lora_graph_mode(slots, self._groups)

    def release(self) -> None:
        """Drop every captured graph and the pool they share. Under tensor/expert parallelism this must precede
        leaving the process group: NCCL will not destroy a communicator whose collectives a live graph holds
        (on the H200, destroy_process_group waited forever)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self._routing.clear()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def prefill_bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The smallest (T, S) bucket that holds a step of num_tokens over num_seqs sequences, or None."""
        return next(((t, s) for t, s in self.prefill_buckets if t >= num_tokens and s >= num_seqs), None)

    def _replay(self, key: int | tuple[int, int], rows: int, slots: list[int], mode: bool | str) -> torch.Tensor:
        """The graph of (key, mode) replayed with slots (one a row, padded with -1 to rows) -> its output."""
        if mode is not False:
            self.lora_batches[rows].update_static(slots + [-1] * (rows - len(slots)), self.max_loras)
        graph, out = self.graphs[(key, mode)]
        graph.replay()
        for module, topk_ids, router_logits in self._routing.get((key, mode), ()):
            module.last_topk_ids = topk_ids
            if router_logits is not None:
                module.last_router_logits = router_logits
        self.replays[(key, mode)] = self.replays.get((key, mode), 0) + 1
        return out

    @torch.no_grad()
    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], slots: list[int],
            input_tokens: torch.Tensor | None = None, mode: bool | str | None = None) -> torch.Tensor:
        """One decode token per sequence -> hidden states [n, H] (a view of the graph's output).
        input_tokens: [n] int64 on the device, the input ids instead of token_ids (asynchronous scheduling).
        mode: the graph set to replay (None: self.mode(slots); a test compares a variant with the full LoRA graph)."""
        n = len(token_ids)
        bs = self.bucket(n)
        if self._copied is not None:  # the kept host buffers are rewritten only once their last copy is done
            self._copied.synchronize()
        for name, t in self.host.build(token_ids, positions, block_tables, bs).items():
            getattr(self, name)[:bs].copy_(t, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if input_tokens is not None:  # after the host copy: these ids win
            self.input_ids[:n].copy_(input_tokens)
        return self._replay(bs, bs, slots, self.mode(slots) if mode is None else mode)[:n]

    @torch.no_grad()
    def run_mixed(self, seqs: list[SeqChunk]) -> torch.Tensor:
        """A prefill or mixed step (any new tokens of each sequence, T of them in all, within a prefill bucket) ->
        hidden states [T, H] of its flat batch (build_flat_batch's rows; a view of the graph's output). The flat
        batch padded to the bucket (t, s): rows past T id 0, position 0, the dummy slot, token_seq -1; sequences
        past the step's empty (row offsets T, length 1, block table 0)."""
        fb = build_flat_batch(seqs, self.kv.block_size)  # host tensors
        a, T, n = fb.attn, len(fb.token_slots), len(seqs)
        t, s = self.prefill_bucket(T, n)
        width = self.block_tables.shape[1]
        if a.block_tables.shape[1] > width:
            raise ValueError(f"a block table of {a.block_tables.shape[1]} blocks; the graphs hold at most {width}")
        for buf, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.slot_mapping, a.slot_mapping, self.dummy_slot), (self.token_seq, a.token_seq, -1)):
            buf[:t].copy_(F.pad(src, (0, t - T), value=pad))
        self.seq_lens[:s].copy_(F.pad(a.seq_lens_t, (0, s - n), value=1))
        self.prefill_qsl[: s + 1].copy_(F.pad(a.query_start_loc_t, (0, s - n), value=T))
        self.block_tables[:s].copy_(F.pad(a.block_tables, (0, width - a.block_tables.shape[1], 0, s - n)))
        return self._replay((t, s), t, fb.token_slots, self.mode(fb.token_slots))[:T]
