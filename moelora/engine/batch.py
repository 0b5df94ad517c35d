"""Flatten the new tokens of several sequences into one forward batch (prefill and decode mixed)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from moelora.layers.attention import AttentionMetadata


@dataclass
class SeqChunk:
    """The part of one sequence that this step computes.

    token_ids: the new tokens · num_cached: tokens of this sequence already in the cache
    block_table: the sequence's blocks, enough for num_cached + len(token_ids) tokens · slot: LoRA slot or -1"""

    token_ids: list[int]
    num_cached: int
    block_table: list[int]
    slot: int = -1


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    token_slots: list[int]  # [T]
    last_token_rows: list[int]  # per sequence, row of its last new token


def build_flat_batch(chunks: list[SeqChunk], block_size: int, device: torch.device | str = "cpu") -> FlatBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots_kv: list[int] = []  # each new token's KV slot
    token_slots: list[int] = []
    qsl, seq_lens, last_rows = [0], [], []
    max_blocks = max((len(c.block_table) for c in chunks), default=1) or 1
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        total = c.num_cached + n
        if -(-total // block_size) > len(c.block_table):
            raise ValueError(f"sequence {b}: {total} tokens need more than its {len(c.block_table)} blocks")
        ids.extend(c.token_ids)
        for p in range(c.num_cached, total):
            pos.append(p)
            slots_kv.append(c.block_table[p // block_size] * block_size + p % block_size)
        token_slots.extend([c.slot] * n)
        qsl.append(qsl[-1] + n)
        seq_lens.append(total)
        last_rows.append(qsl[-1] - 1)
        tables[b, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
    token_seq = [b for b, c in enumerate(chunks) for _ in c.token_ids]
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots_kv, dtype=torch.int64, device=device), block_tables=tables.to(device),
        seq_lens=seq_lens, query_start_loc=qsl, token_seq=torch.tensor(token_seq, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=device),
    )
    return FlatBatch(input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
                     positions=torch.tensor(pos, dtype=torch.int64, device=device), attn=attn, token_slots=token_slots,
                     last_token_rows=last_rows)


def split_tokens(n: int, most: int) -> list[int]:
    """n tokens as sequences of `most` tokens each, the last one shorter."""
    return [min(most, n - i) for i in range(0, n, most)]


def dummy_chunks(lens: list[int], context: int, block_size: int, num_blocks: int) -> list[SeqChunk] | None:
    """Placeholder sequences (profiling, warm-up): one per entry of lens, that many new tokens after `context`
    cached ones, on consecutive blocks from block 0; None when they need more than num_blocks."""
    sizes = [-(-(context + n) // block_size) for n in lens]  # blocks per sequence
    if sum(sizes) > num_blocks:
        return None
    return [SeqChunk([0] * n, context, list(range(s, s + b))) for n, s, b in zip(lens, accumulate([0] + sizes), sizes)]
