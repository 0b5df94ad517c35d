"""The host tensors of a CUDA-graph decode step (engine/graph_inputs.DecodeHostInputs: kept buffers, block tables
updated in place) against a row-by-row reference: ragged block tables, padding rows, many steps, and the errors for
a short or too-wide table."""

import pytest
import torch

from moelora.engine.graph_inputs import DecodeHostInputs


def _reference(token_ids, positions, block_tables, bs, block_size, width, dummy_slot):
    n, pad = len(token_ids), bs - len(token_ids)
    tables = torch.zeros(bs, width, dtype=torch.int32)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
    kv = [bt[p // block_size] * block_size + p % block_size for bt, p in zip(block_tables, positions)]
    return {
        "input_ids": torch.tensor(token_ids + [0] * pad, dtype=torch.int64),
        "positions": torch.tensor(positions + [0] * pad, dtype=torch.int64),
        "slot_mapping": torch.tensor(kv + [dummy_slot] * pad, dtype=torch.int64),
        "token_seq": torch.tensor(list(range(n)) + [-1] * pad, dtype=torch.int32),
        "seq_lens": torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32),
        "block_tables": tables,
    }


@pytest.mark.parametrize("n,bs,block_size", [(1, 1, 16), (3, 4, 16), (37, 48, 16), (250, 256, 16), (5, 8, 1)])
def test_host_inputs_equal_the_row_by_row_reference(n, bs, block_size):
    g = torch.Generator().manual_seed(n * 7 + bs)
    width = 12
    positions = torch.randint(0, width * block_size, (n,), generator=g).tolist()
    # each table long enough for its position, some longer (blocks reserved ahead), block ids scattered
    block_tables = [torch.randperm(4096, generator=g)[: min(width, p // block_size + 1 + int(k))].tolist()
                    for p, k in zip(positions, torch.randint(0, 3, (n,), generator=g))]
    token_ids = torch.randint(0, 151936, (n,), generator=g).tolist()
    host = DecodeHostInputs(bs, width, block_size, dummy_slot=7 * block_size)
    got = host.build(token_ids, positions, block_tables, bs)
    want = _reference(token_ids, positions, block_tables, bs, block_size, width, 7 * block_size)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_request_ids_slice_and_token_at_equal_the_whole_sequence():
    from moelora.engine.request import Request
    from moelora.engine.sampling_params import SamplingParams

    req = Request("r", [1, 2, 3, 4], SamplingParams(), None, 0, output_ids=[5, 6, 7])
    ids = req.prompt_ids + req.output_ids
    for start in range(len(ids) + 1):
        for stop in range(start, len(ids) + 1):
            assert req.ids_slice(start, stop) == ids[start:stop], (start, stop)
    assert [req.token_at(i) for i in range(len(ids))] == ids


def _step_views_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_incremental_host_inputs_equal_the_reference_over_many_steps():
    """DecodeHostInputs (kept buffers, block tables updated in place) gives the reference's arrays at every
    step of a random run: sequences decode (a new block every block_size positions, extended in place), finish
    and are replaced, are preempted (a new list, shorter), swap rows, the batch shrinks and grows across buckets;
    and a list rewritten in place behind its back (same object, same length) is caught by the last-block guard."""
    g = torch.Generator().manual_seed(5)
    block_size, width, max_batch = 4, 16, 16
    host = DecodeHostInputs(max_batch, width, block_size, dummy_slot=99 * block_size)
    next_block = iter(range(10_000, 100_000))
    seqs = []  # [position, block table list]

    def new_seq():
        p = int(torch.randint(0, 20, (1,), generator=g))
        return [p, [next(next_block) for _ in range(p // block_size + 1)]]

    for step in range(300):
        r = torch.rand(1, generator=g).item()
        if r < 0.1 and len(seqs) < max_batch:
            seqs.insert(int(torch.randint(0, len(seqs) + 1, (1,), generator=g)), new_seq())
        elif r < 0.18 and seqs:
            seqs.pop(int(torch.randint(0, len(seqs), (1,), generator=g)))
        elif r < 0.22 and len(seqs) > 1:
            i, j = torch.randperm(len(seqs), generator=g)[:2].tolist()
            seqs[i], seqs[j] = seqs[j], seqs[i]
        elif r < 0.25 and seqs:  # preempted and resumed: a new, shorter list
            s = seqs[int(torch.randint(0, len(seqs), (1,), generator=g))]
            s[0] = s[0] % block_size
            s[1] = [next(next_block)]
        for s in seqs:  # decode one token; past the table's end the scheduler extends it in place
            s[0] += 1
            if s[0] // block_size >= len(s[1]):
                if len(s[1]) == width:
                    s[0], s[1] = 0, [next(next_block)]
                else:
                    s[1].extend([next(next_block)])
        if step == 150 and seqs:  # an in-place rewrite of a whole list (not what the scheduler does)
            s = seqs[0]
            s[1][:] = [next(next_block) for _ in s[1]]
        n = len(seqs)
        bs = next(b for b in (1, 2, 4, 8, 16) if b >= max(n, 1))
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        pos, tables = [s[0] for s in seqs], [s[1] for s in seqs]
        want = _reference(ids, pos, tables, bs, block_size, width, 99 * block_size)
        _step_views_equal(host.build(ids, pos, tables, bs), want)


def test_host_inputs_refuse_a_table_short_of_its_position_or_wider_than_the_graphs():
    host = DecodeHostInputs(4, 4, 16, dummy_slot=0)
    with pytest.raises(ValueError, match="sequence 1: position 40 needs block 2 of a 2-block table"):
        host.build([1, 2], [3, 40], [[5], [6, 9]], 2)
    with pytest.raises(ValueError, match="sequence 0: block table of 5 blocks; the graphs hold at most 4"):
        host.build([1], [3], [[5, 6, 7, 8, 9]], 1)
