"""Dense multi-LoRA Triton kernels vs their torch references (and the fast path's slot choice)."""

import pytest
import torch
import triton

from kernel_cases import DEVICE, DTYPES, NUM_TOKENS, ON_GPU, POPULARITY, token_slots, tolerance
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.shrink_expand import lora_expand_ref, lora_shrink_ref, lora_single_slot
from moelora.kernels.lora.shrink_expand_triton import lora_expand, lora_shrink, lora_shrink_buffer

S, R = 4, 16
# CPU (interpreter): small widths with slices of different sizes; GPU: a 4096-wide layer's qkv shape
H, OUTS = (2048, [4096, 512, 512]) if ON_GPU else (48, [40, 24, 24])


def _weights(dtype, gen):
    n = len(OUTS)
    ranks = torch.tensor([[16, 4, 0, 8], [16, 8, 4, 0], [2, 16, 8, 4]][:n], dtype=torch.int32)  # slot rank 0 somewhere
    a = torch.randn(n, S, R, H, generator=gen) * 0.1
    b = torch.randn(S, sum(OUTS), R, generator=gen) * 0.1
    off = [0]
    for o in OUTS:
        off.append(off[-1] + o)
    for i in range(n):  # buffers are zero past each slot's rank, as the slot pool writes them
        for s in range(S):
            a[i, s, ranks[i, s]:] = 0
            b[s, off[i]:off[i + 1], ranks[i, s]:] = 0
    scaling = torch.rand(n, S, generator=gen) + 0.5
    return (a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks.to(DEVICE), scaling.to(DEVICE),
            torch.tensor(off, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_shrink_expand_match_reference(popularity, num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 7 + len(popularity))
    a, b, ranks, scaling, off = _weights(dtype, gen)
    slots = token_slots(popularity, num_tokens, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    x = torch.randn(num_tokens, H, generator=gen).to(DEVICE, dtype)
    n = len(OUTS)
    h_ref = torch.zeros(n, num_tokens, R, device=DEVICE)
    h = torch.zeros(n, num_tokens, R, device=DEVICE)
    lora_shrink_ref(x, a, ranks, groups, h_ref)
    lora_shrink(x, a, ranks, groups, h)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
    y0 = torch.randn(num_tokens, sum(OUTS), generator=gen).to(DEVICE, dtype)
    y_ref, y = y0.clone(), y0.clone()
    lora_expand_ref(h_ref, b, off, ranks, scaling, groups, y_ref)
    lora_expand(h_ref, b, off, ranks, scaling, groups, y)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    base = (slots < 0).to(DEVICE)
    assert torch.equal(y[base], y0[base]), "rows without an adapter must stay untouched"
    # (slice, slot) pairs of rank 0 add exactly nothing
    for i in range(n):
        for s in range(S):
            if ranks[i, s] == 0:
                rows = (slots == s).to(DEVICE)
                o = off.tolist()
                assert torch.equal(y[rows, o[i]:o[i + 1]], y0[rows, o[i]:o[i + 1]])


def test_single_slot_fast_path_reads_its_slot():
    """Two adapters resident, the batch uses only slot 1: the fast path must equal the grouped path on
    slot 1 and differ from what slot 0 would give."""
    gen = torch.Generator().manual_seed(3)
    dtype = DTYPES[0]
    a, b, ranks, scaling, off = _weights(dtype, gen)
    ranks = torch.full_like(ranks, R)
    a = torch.randn(a.shape, generator=gen).to(DEVICE, dtype) * 0.1
    b = torch.randn(b.shape, generator=gen).to(DEVICE, dtype) * 0.1
    T = 5
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    y0 = torch.zeros(T, sum(OUTS), device=DEVICE, dtype=dtype)
    slots = torch.tensor([1, -1, 1, 1, -1], dtype=torch.int32)
    groups = SlotGroups.build(slots, S, DEVICE)
    fast = y0.clone()
    rows = groups.sorted_token_ids[: groups.counts[0]].long()
    lora_single_slot(x, a, b, off.tolist(), ranks.tolist(), scaling, 1, rows, fast)
    grouped = y0.clone()
    h = torch.zeros(len(OUTS), T, R, device=DEVICE)
    lora_shrink_ref(x, a, ranks, groups, h)
    lora_expand_ref(h, b, off, ranks, scaling, groups, grouped)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(fast, grouped, atol=atol, rtol=rtol)
    slot0 = y0.clone()
    lora_single_slot(x, a, b, off.tolist(), ranks.tolist(), scaling, 0, rows, slot0)
    assert (slot0 - fast).abs().max() > 10 * atol
    assert torch.equal(fast[[1, 4]], y0[[1, 4]])


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_partials_need_no_zeroed_buffer(split_k):
    """The shrink stores split-K partial sums (no atomics), the expand adds them: the buffer may hold anything
    beforehand (NaN here) and the result is the one-split result; the reference's partials sum to the same."""
    gen = torch.Generator().manual_seed(11 + split_k)
    dtype = DTYPES[0]
    a, b, ranks, scaling, off = _weights(dtype, gen)
    T = 24
    slots = token_slots(POPULARITY[-1], T, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    n = len(OUTS)
    parts = torch.full((split_k, n, T, R), float("nan"), device=DEVICE)
    lora_shrink(x, a, ranks, groups, parts)
    h_ref = torch.zeros(n, T, R, device=DEVICE)
    lora_shrink_ref(x, a, ranks, groups, h_ref)
    ref_parts = torch.full((split_k, n, T, R), float("nan"), device=DEVICE)
    lora_shrink_ref(x, a, ranks, groups, ref_parts)
    atol, rtol = tolerance(dtype)
    for i in range(n):
        for s in groups.slot_ids:
            rows = (slots == s).to(DEVICE)
            r = int(ranks[i, s])
            torch.testing.assert_close(parts[:, i, rows, :r].sum(0), h_ref[i, rows, :r], atol=atol, rtol=rtol)
            torch.testing.assert_close(ref_parts[:, i, rows, :r].sum(0), h_ref[i, rows, :r], atol=0, rtol=0)
    y0 = torch.randn(T, sum(OUTS), generator=gen).to(DEVICE, dtype)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand(parts, b, off, ranks, scaling, groups, y)
    lora_expand_ref(h_ref, b, off, ranks, scaling, groups, y_ref)
    assert not y.isnan().any(), "the expand read a partial the shrink did not write"
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    assert lora_shrink_buffer(n, T, R, H, "cpu").shape == (1, n, T, R)
    # B past each slot's rank is never used either (the kernel reads whole rank rows and zeroes those entries
    # after the load when the buffer's rank is a multiple of its rank tile): NaN there changes nothing
    b_nan = b.clone()
    for i in range(n):
        for s in range(S):
            b_nan[s, off[i]:off[i + 1], ranks[i, s]:] = float("nan")
    y_nan = y0.clone()
    lora_expand(parts, b_nan, off, ranks, scaling, groups, y_nan)
    assert torch.equal(y_nan, y)
    # the buffers' rank off the rank tile (B 16 wide past its rank NaN, h 16): the loads masked by the rank instead
    b_wide = torch.cat([b_nan, torch.full_like(b_nan, float("nan"))], dim=2)
    y_other = y0.clone()
    lora_expand(parts, b_wide, off, ranks, scaling, groups, y_other)
    assert torch.equal(y_other, y)


def test_single_slot_path_policy():
    """The single-adapter path (plain matmuls): one slot, outside a graph; on a GPU only from
    SINGLE_SLOT_MIN_TOKENS tokens (the grouped kernels are faster below), at any size on the CPU;
    DenseLoRAConfig.single_slot=False turns it off (the backends picked without it)."""
    from moelora.layers.lora_batch import LoRABatch
    from moelora.kernels.config import KernelConfig
    from moelora.layers.dense_lora import SINGLE_SLOT_MIN_TOKENS, ShrinkExpandLoRA, pick_dense_lora, single_slot_path

    one = LoRABatch.build([2, -1, 2], 4)
    two = LoRABatch.build([2, 1, 2], 4)
    assert one.single_slot == 2 and two.single_slot is None
    assert single_slot_path(one, 3, 0) and not single_slot_path(two, 3, 0)
    assert not single_slot_path(one, SINGLE_SLOT_MIN_TOKENS - 1, SINGLE_SLOT_MIN_TOKENS)
    assert single_slot_path(one, SINGLE_SLOT_MIN_TOKENS, SINGLE_SLOT_MIN_TOKENS)
    assert not single_slot_path(one, 3, None)
    graph = LoRABatch.static(3, 4, "cpu")
    graph.single_slot = 2
    assert not single_slot_path(graph, 3, 0)  # a graph serves every later mix of adapters
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    off = KernelConfig.from_dict({"dense_lora": {"single_slot": False}})
    assert pick_dense_lora(KernelConfig(), None, cpu, [0, 8])[0] == ShrinkExpandLoRA(False, 0)
    assert pick_dense_lora(off, None, cpu, [0, 8])[0] == ShrinkExpandLoRA(False, None)
    if ON_GPU:
        assert pick_dense_lora(KernelConfig(), None, gpu, [0, 8])[0] == ShrinkExpandLoRA(True, SINGLE_SLOT_MIN_TOKENS)
        assert pick_dense_lora(off, None, gpu, [0, 8])[0] == ShrinkExpandLoRA(True, None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_single_adapter_layer_takes_the_measured_path(fp8, monkeypatch):
    """A LoRALinear with one adapter in the batch: below SINGLE_SLOT_MIN_TOKENS the grouped kernels (or, on an
    FP8 base, the GEMM's epilogue) run, from it the single-slot matmuls on a bf16 base and still the epilogue on
    an FP8 one; each result equals the other path's within bf16 rounding."""
    from moelora.layers.lora_batch import LoRABatch
    from moelora.kernels.config import KernelConfig
    from moelora.layers import dense_lora, linear
    from moelora.layers.fp8 import Fp8State, to_fp8

    gen = torch.Generator(device="cuda").manual_seed(5)
    lin = linear.LoRALinear(2048, [4096, 512, 512], False, torch.bfloat16, "cuda")
    lin.weight.copy_(torch.randn(5120, 2048, device="cuda", generator=gen) * 2048**-0.5)
    if fp8:
        to_fp8(lin, Fp8State((128, 128), torch.bfloat16, None), quantize=True)
    lin.enable_lora(4, 16)
    for i, out in enumerate(lin.out_features):
        lin.lora.set_slot(i, 1, torch.randn(16, 2048, device="cuda", generator=gen) * 0.05,
                          torch.randn(out, 16, device="cuda", generator=gen) * 0.25, 2.0)
    calls = []
    real = dense_lora.lora_single_slot
    monkeypatch.setattr(dense_lora, "lora_single_slot", lambda *a: (calls.append(1), real(*a)))
    for T in (64, dense_lora.SINGLE_SLOT_MIN_TOKENS):
        x = torch.randn(T, 2048, device="cuda", generator=gen).bfloat16()
        batch = LoRABatch.build([1 if t % 3 else -1 for t in range(T)], 4, "cuda")
        calls.clear()
        lin.configure(KernelConfig())
        y = lin(x, batch)
        assert len(calls) == (0 if fp8 or T < dense_lora.SINGLE_SLOT_MIN_TOKENS else 1), (T, calls)
        lin.configure(KernelConfig.from_dict({"dense_lora": {"single_slot": False}}))
        other = lin(x, batch)
        assert (y.float() - other.float()).abs().max() <= 2.0**-6 * other.float().abs().max()
        assert (y.float() - lin(x).float()).abs().max() > 0.05  # the delta is there


def test_shrink_decode_k_tile_changes_no_result():
    """lora_shrink's block_k (the deferred shrink's DEFER_SHRINK_BLOCK_K): taken at decode sizes only, at most H's
    next power of two; the expand of its partials equals the reference."""
    from moelora.kernels.lora.shrink_expand_triton import _block_k

    gen, dtype, (a, b, ranks, scaling, off), groups, x = _mixed_case(5)
    T, n = x.shape[0], len(OUTS)
    y0 = torch.randn(T, sum(OUTS), generator=gen).to(DEVICE, dtype)
    y_ref = y0.clone()
    h_ref = torch.zeros(n, T, R, device=DEVICE)
    lora_shrink_ref(x, a, ranks, groups, h_ref)
    lora_expand_ref(h_ref, b, off, ranks, scaling, groups, y_ref)
    assert _block_k(H, T, 16) == 16 and _block_k(H, T, 4096) == triton.next_power_of_2(H)
    assert _block_k(H, None, 16) == _block_k(H) == 64 and _block_k(H, 10_000, 16) == 64
    parts = torch.full((2, n, T, R), float("nan"), device=DEVICE)
    lora_shrink(x, a, ranks, groups, parts, block_k=16)
    y = y0.clone()
    lora_expand(parts, b, off, ranks, scaling, groups, y)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


def _mixed_case(seed: int, T: int = 24):
    """(generator, dtype, _weights(...), SlotGroups of T tokens on the last popularity, x [T, H])."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[0]
    weights = _weights(dtype, gen)
    groups = SlotGroups.build(token_slots(POPULARITY[-1], T, S, gen), S, DEVICE)
    return gen, dtype, weights, groups, torch.randn(T, H, generator=gen).to(DEVICE, dtype)


def test_expand_prefill_tile_gives_the_same_sums():
    """Above 256 tokens lora_expand runs at EXPAND_PREFILL_TILE (as launched) with the reference's result; rows
    without an adapter untouched."""
    from moelora.kernels.lora import shrink_expand_triton as lt

    gen = torch.Generator().manual_seed(5)
    dtype = DTYPES[0]
    a, b, ranks, scaling, off = _weights(dtype, gen)
    T = 300  # above SHRINK_SPLIT_MAX_TOKENS
    slots = token_slots(POPULARITY[0], T, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    h = torch.randn(len(OUTS), T, R, generator=gen).to(DEVICE)
    y0 = torch.randn(T, sum(OUTS), generator=gen).to(DEVICE, dtype)
    y_ref, y = y0.clone(), y0.clone()
    lora_expand_ref(h, b, off, ranks, scaling, groups, y_ref)
    launched = []
    real = lt._expand_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs.get("num_warps", 4)))
                return real[grid](*args, **kwargs)
            return launch

    lt._expand_kernel = Spy()
    try:
        lora_expand(h, b, off, ranks, scaling, groups, y)
    finally:
        lt._expand_kernel = real
    bm, bn, w = lt.EXPAND_PREFILL_TILE
    assert launched == [(bm, min(bn, triton.next_power_of_2(sum(OUTS))), w)] == [(128, 64, 4)]
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    base = (slots < 0).to(DEVICE)
    assert torch.equal(y[base], y0[base])
