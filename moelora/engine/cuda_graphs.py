"""CUDA graphs of the decode step: one graph per batch-size bucket, in four sets captured at start-up into one
shared memory pool: with LoRA kernels, without (base-only batches), LoRA on the dense weights only ("dense":
batches whose adapters adapt no routed expert, e.g. PEFT's default attention targets) and on the routed experts only
("experts").

Replay refreshes static buffers in place: token ids, positions, KV slots, block tables, per-row
sequence lengths, and the LoRA slot groups. Rows past the real batch are padding: LoRA slot -1, KV
writes into the cache's dummy block, attention skipped (token_seq -1).
"""

from __future__ import annotations

import dataclasses

import torch

from moelora.layers.lora_batch import LoRABatch
from moelora.engine.graph_inputs import DecodeHostInputs
from moelora.engine.kv_cache import KVCache
from moelora.layers.attention import AttentionMetadata
from moelora.layers.lora import LORA_SLOT_WRITES, LoRAWeights, lora_work_count, slot_target_groups

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
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


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, max_loras: int, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.model, self.kv, self.max_loras = model, kv, max(max_loras, 1)
        self.buckets = [b for b in BUCKETS if b <= max_batch_size] or [1]
        B = self.buckets[-1]
        dev = model.device
        self.dummy_slot = kv.dummy_block * kv.block_size
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((B,), self.dummy_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(B, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.token_seq = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.lora_batches = {bs: LoRABatch.static(bs, self.max_loras, dev) for bs in self.buckets}
        # the step's host arrays, kept between steps (block tables updated in place; pinned: asynchronous copies)
        self.host = DecodeHostInputs(B, max_blocks_per_seq, kv.block_size, self.dummy_slot, pin=dev.type == "cuda")
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None  # the last step's host-to-device copies
        # keys (bucket, mode): mode True (LoRA), False (base only), "dense" / "experts" (lora_graph_mode)
        self.graphs: dict[tuple[int, bool | str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # capture(): the pool every graph shares
        self.max_batch_size = B
        self.replays: dict[tuple[int, bool | str], int] = {}  # (bucket, mode) -> replays, for tests and stats
        self.lora_layer_calls: dict[tuple[int, bool | str], int] = {}  # LoRA computations recorded into each graph
        # per graph: (MoE block, its top-k ids, its router logits or None), outputs of the capture kept alive
        self._routing: dict[tuple[int, bool | str],
                            list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]]] = {}
        self._lora_weights = [m for m in model.modules() if isinstance(m, LoRAWeights)]
        self._groups_at, self._groups = -1, []  # slot_target_groups as of LORA_SLOT_WRITES == _groups_at

    def _attn(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs], seq_lens=[1] * bs,
            query_start_loc=list(range(bs + 1)), token_seq=self.token_seq[:bs], seq_lens_t=self.seq_lens[:bs],
            query_start_loc_t=self.qsl[: bs + 1],
        )

    @torch.no_grad()
    def capture(self) -> None:
        pool = None
        for mode in GRAPH_MODES:
            for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                lora = self._lora_batch(bs, mode)
                args = (self.input_ids[:bs], self.positions[:bs], self._attn(bs), self.kv.caches, lora)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks kernels
                    self.model(*args)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                calls = lora_work_count()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.pool = pool  # the graphs' shared memory pool (tests read its segments)
                self.graphs[(bs, mode)] = (graph, out)
                self.lora_layer_calls[(bs, mode)] = lora_work_count() - calls
                # each MoE block's routing output of this graph (statistics and tests read it after a replay)
                self._routing[(bs, mode)] = [(m, m.last_topk_ids, getattr(m, "last_router_logits", None))
                                             for m in self.model.modules()
                                             if getattr(m, "last_topk_ids", None) is not None]
        torch.cuda.synchronize()

    def recapture(self) -> None:
        """Drop the graphs and capture them again (after the model's kernel config or overlap changed: a graph keeps
        the kernels and streams it recorded)."""
        self.graphs.clear()
        self._routing.clear()
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
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    @torch.no_grad()
    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], slots: list[int],
            input_tokens: torch.Tensor | None = None, mode: bool | str | None = None) -> torch.Tensor:
        """One decode token per sequence -> hidden states [n, H] (a view of the graph's output).
        input_tokens: [n] int64 on the device, the input ids instead of token_ids (asynchronous scheduling).
        mode: the graph set to replay (None: self.mode(slots); a test compares a variant with the full LoRA graph)."""
        n = len(token_ids)
        bs = self.bucket(n)
        pad = bs - n
        if self._copied is not None:  # the kept host buffers are rewritten only once their last copy is done
            self._copied.synchronize()
        for name, t in self.host.build(token_ids, positions, block_tables, bs).items():
            getattr(self, name)[:bs].copy_(t, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if input_tokens is not None:  # after the host copy: these ids win
            self.input_ids[:n].copy_(input_tokens)
        mode = self.mode(slots) if mode is None else mode
        if mode is not False:
            self.lora_batches[bs].update_static(slots + [-1] * pad, self.max_loras)
        graph, out = self.graphs[(bs, mode)]
        graph.replay()
        for module, topk_ids, router_logits in self._routing.get((bs, mode), ()):
            module.last_topk_ids = topk_ids
            if router_logits is not None:
                module.last_router_logits = router_logits
        self.replays[(bs, mode)] = self.replays.get((bs, mode), 0) + 1
        return out[:n]
