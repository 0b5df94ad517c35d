"""The host side of a CUDA-graph decode step, kept between steps: the padded input arrays of a bucket, with the
block tables updated in place (only the blocks a sequence gained since the last step are written).

Rebuilding every array from the requests' Python lists each step costs, at batch 256 and context 1,024, ~16,000
Python ints of block tables a step (0.70 ms of host time on a 2-core CPU, scripts/bench_host_step.py), while the
GPU waits. In steady decode a sequence gains one block every block_size steps, so this keeps the [B, width] table
and, per row, the list it was filled from and how much.

The invariant it relies on (the scheduler's): a sequence's block table only grows in place (list.extend) until
it is freed, which replaces it with a new list. A row whose list object changed, or whose list got shorter, or
whose last copied block differs (a guard against an in-place rewrite), is rewritten whole.
"""

from __future__ import annotations

import numpy as np
import torch


class DecodeHostInputs:
    """Host arrays of the graph buffers: input_ids, positions, slot_mapping [B] int64; token_seq, seq_lens [B] int32;
    block_tables [B, width] int32 — at every step the arrays of the step's lists alone (see build). pin: page-locked
    host memory (a GPU engine), so the copies to the graph's buffers are asynchronous; the engine reads each step's
    tokens back before building the next step, which orders the copies before the next overwrite."""

    def __init__(self, max_batch: int, width: int, block_size: int, dummy_slot: int, pin: bool = False) -> None:
        self.width, self.block_size, self.dummy_slot = width, block_size, dummy_slot

        def buf(shape, dtype):
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        self.tensors = dict(input_ids=buf(max_batch, torch.int64), positions=buf(max_batch, torch.int64),
                            slot_mapping=buf(max_batch, torch.int64), token_seq=buf(max_batch, torch.int32),
                            seq_lens=buf(max_batch, torch.int32), block_tables=buf((max_batch, width), torch.int32))
        self.np = {k: v.numpy() for k, v in self.tensors.items()}
        self._owner: list[list[int] | None] = [None] * max_batch  # the list row i was filled from
        self._filled = [0] * max_batch  # blocks of row i written (the rest of the row is 0)
        self._last = [-1] * max_batch  # the last block written to row i (the in-place rewrite guard)
        self._rows = 0  # rows holding a sequence at the last step (rows past it are all zero)

    def _table_rows(self, block_tables: list[list[int]]) -> None:
        tables, owner, filled, last, width = self.np["block_tables"], self._owner, self._filled, self._last, self.width
        for i, bt in enumerate(block_tables):
            n_new, f = len(bt), filled[i]
            if n_new > width:
                raise ValueError(f"sequence {i}: block table of {n_new} blocks; the graphs hold at most {width}")
            if owner[i] is bt and n_new >= f and (f == 0 or bt[f - 1] == last[i]):
                if n_new == f:  # steady decode: nothing new in this row
                    continue
                tables[i, f:n_new] = bt[f:]
            else:
                tables[i, :n_new] = bt
                if f > n_new:
                    tables[i, n_new:f] = 0
                owner[i] = bt
            filled[i] = n_new
            last[i] = bt[-1] if n_new else -1

    def build(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
              bs: int) -> dict[str, torch.Tensor]:
        """The first bs rows of each array for this step (views of the kept buffers), for n = len(token_ids)
        sequences padded to bs rows: input_ids (0 past n), positions (0), slot_mapping (the KV slot of each position,
        block_tables[i][p // block_size] * block_size + p % block_size; dummy_slot past n), token_seq (i, -1 past
        n), seq_lens (p + 1, 1 past n), block_tables (zero-padded). A table shorter than its position needs or
        wider than the buffers is a ValueError naming the sequence."""
        n = len(token_ids)
        self._table_rows(block_tables)
        tables = self.np["block_tables"]
        for i in range(n, self._rows):  # rows that held a sequence last step and hold none now
            tables[i, : self._filled[i]] = 0
            self._filled[i], self._owner[i], self._last[i] = 0, None, -1
        self._rows = n
        pos = self.np["positions"]
        pos[:n] = positions
        pos[n:bs] = 0
        blk = pos[:n] // self.block_size
        lens = np.asarray(self._filled[:n], dtype=np.int64)
        short = np.nonzero(blk >= lens)[0]
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {i}: position {int(pos[i])} needs block {int(blk[i])} of a "
                             f"{int(lens[i])}-block table")
        slots = tables[np.arange(n), blk].astype(np.int64) * self.block_size + pos[:n] % self.block_size
        for key, rows, pad in (("input_ids", token_ids, 0), ("slot_mapping", slots, self.dummy_slot),
                               ("token_seq", np.arange(n), -1), ("seq_lens", pos[:n] + 1, 1)):
            self.np[key][:n] = rows
            self.np[key][n:bs] = pad
        return {k: v[:bs] for k, v in self.tensors.items()}
