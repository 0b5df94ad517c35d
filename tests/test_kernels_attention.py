"""Paged attention Triton kernel vs the reference: prefill, chunked prefill against a cached prefix,
decode, GQA, sliding windows, shuffled blocks, padding rows."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, tolerance
from moelora.kernels.attention import paged_attention_ref
from moelora.kernels.attention_triton import paged_attention

HQ, HKV, D = (32, 4, 128) if ON_GPU else (4, 2, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_reference(block_size, window, dtype):
    gen = torch.Generator().manual_seed(block_size + (window or 0))
    # (tokens already cached, new tokens this step): prefill, chunked prefill, decode
    seqs = [(0, 9), (7, 5), (12, 1), (0, 1), (30, 1)]
    nb = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.randn(nb, block_size, HKV, D, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(nb, block_size, HKV, D, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(nb, generator=gen).tolist()  # blocks scattered over the cache
    tables, lens, qsl, token_seq = [], [], [0], []
    for b, (c, n) in enumerate(seqs):
        need = -(-(c + n) // block_size)
        tables.append([perm.pop() for _ in range(need)])
        lens.append(c + n)
        qsl.append(qsl[-1] + n)
        token_seq += [b] * n
    T = qsl[-1]
    token_seq += [-1, -1]  # two padding rows
    mb = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (mb - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(T + 2, HQ, D, generator=gen).to(DEVICE, dtype)
    scale = D**-0.5
    ref = paged_attention_ref(q[:T], k_cache, v_cache, bt, lens, qsl, scale, window)
    out = torch.full_like(q, 7.0)
    paged_attention(q, k_cache, v_cache, bt, torch.tensor(token_seq, dtype=torch.int32, device=DEVICE),
                    torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                    torch.tensor(qsl, dtype=torch.int32, device=DEVICE), scale, window, out)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(out[:T], ref, atol=atol, rtol=rtol)
    assert torch.all(out[T:] == 7.0), "padding rows must stay untouched"
