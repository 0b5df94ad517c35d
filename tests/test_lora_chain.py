"""The deferred dense LoRA chain in one launch (kernels/lora_chain_triton.py, set_dense_defer_one_launch): against
its torch reference and against the two-launch chain (lora_shrink then lora_delta), under TRITON_INTERPRET=1 on the
CPU (fp32 / fp16) and compiled on a GPU (bf16, the qkv shape of Qwen3-30B-A3B)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, ON_GPU, token_slots, tolerance  # sets TRITON_INTERPRET=1 without a GPU

from moelora.kernels import _triton
from moelora.kernels.groups import SlotGroups
from moelora.kernels.lora_chain_triton import chain_counters, lora_chain, lora_chain_ref, set_lora_chain_block_n

pytestmark = pytest.mark.usefixtures("one_thread")
S, R = 4, 16
# CPU: small widths, slices on the 64-column tiles (qkv-like: three slices; o_proj-like: one); GPU: Qwen3-30B-A3B's
H, OUTS = (2048, [4096, 512, 512]) if ON_GPU else (96, [128, 64, 64])


def _factors(dtype, gen, outs):
    n = len(outs)
    ranks = torch.tensor([[16, 4, 0, 8], [16, 8, 4, 0], [2, 16, 8, 4]][:n], dtype=torch.int32)  # rank 0 somewhere
    a = torch.randn(n, S, R, H, generator=gen) * 0.1
    b = torch.randn(S, sum(outs), R, generator=gen) * 0.1
    off = [0]
    for o in outs:
        off.append(off[-1] + o)
    for i in range(n):
        for s in range(S):
            a[i, s, ranks[i, s]:] = 0  # zero past each rank, as the slot pool writes them
            b[s, off[i]:off[i + 1], ranks[i, s]:] = 0
    scaling = torch.rand(n, S, generator=gen) + 0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks.to(DEVICE), scaling.to(DEVICE), off


def _run(x, a, b, off, ranks, scaling, groups, split_k, counters, block_k=32, shrink="grouped", with_h=False):
    T = x.shape[0]
    h = torch.full((split_k, a.shape[0], T, R), float("nan"), device=DEVICE)  # the workspace: any contents
    delta = torch.full((T, b.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    lora_chain(x, a, b, off_t, tuple(off), ranks, scaling, groups.token_slots, groups.active_slots, h, delta,
               counters, block_k=block_k, groups=groups if shrink == "grouped" else None)
    return (delta, h) if with_h else delta


@pytest.mark.parametrize("shrink", ["grouped", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,popularity,split_k,outs", [
    (1, "distinct", 2, OUTS), (7, "with_base_rows", 3, OUTS), (40, "uniform", 1, OUTS),
    (70, "with_base_rows", 2, OUTS),  # more rows than a program's block: the shrink walks two row blocks
    (70, "identical", 2, OUTS),  # one group of more rows than a program's block: two grouped row blocks
    (9, "identical", 4, OUTS[:1]),  # one slice (o_proj-like)
])
def test_lora_chain_matches_reference_and_writes_every_entry(num_tokens, popularity, split_k, outs, dtype, shrink):
    """Every entry of a NaN-filled delta written; against lora_chain_ref; rows without an adapter and slices of rank
    0 exactly 0; the counters left at zero, so a second launch on them gives the same delta bit for bit. Both shrink
    forms: grouped (lora_shrink's programs over each group's rows; the default) and stacked (session 32's)."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + split_k)
    a, b, ranks, scaling, off = _factors(dtype, gen, outs)
    slots = token_slots(popularity, num_tokens, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    x = torch.randn(num_tokens, H, generator=gen).to(DEVICE, dtype)
    counters = chain_counters(DEVICE)
    delta = _run(x, a, b, off, ranks, scaling, groups, split_k, counters, shrink=shrink)
    assert not delta.isnan().any()
    assert counters.tolist() == [0, 0]
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    want = lora_chain_ref(x, a, b, off_t, ranks, scaling, groups, dtype)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(delta, want, atol=atol, rtol=rtol)
    base = (slots < 0).to(DEVICE)
    assert (delta[base] == 0).all()
    rk = ranks.cpu()
    for i in range(len(outs)):
        for s in range(S):
            if rk[i, s] == 0:
                assert (delta[(slots == s).to(DEVICE), off[i]:off[i + 1]] == 0).all()
    if (~base).any():
        assert delta[~base].abs().max() > 0.01  # the adapters are there
    assert torch.equal(_run(x, a, b, off, ranks, scaling, groups, split_k, counters, shrink=shrink), delta)
    assert counters.tolist() == [0, 0]


@pytest.mark.parametrize("shrink", ["grouped", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_chain_is_the_two_launch_chain(dtype, shrink):
    """The same delta as lora_shrink into split-K partials then lora_delta (the default deferred chain), up to fp32
    summation order, at each column tile of set_lora_chain_block_n; with the grouped shrink its partials are
    lora_shrink's bit for bit (the same programs), which a shrink that dropped a group's rows would not give."""
    from moelora.kernels.lora_delta_triton import lora_delta
    from moelora.kernels.lora_triton import lora_shrink

    gen = torch.Generator().manual_seed(11)
    a, b, ranks, scaling, off = _factors(dtype, gen, OUTS)
    slots = token_slots("with_base_rows", 13, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    x = torch.randn(13, H, generator=gen).to(DEVICE, dtype)
    h = torch.full((2, len(OUTS), 13, R), float("nan"), device=DEVICE)
    lora_shrink(x, a, ranks, groups, h, block_k=32)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    two = torch.empty(13, sum(OUTS), dtype=dtype, device=DEVICE)
    lora_delta(h, b, off_t, tuple(off), ranks, scaling, groups.token_slots, groups.active_slots, two)
    atol, rtol = tolerance(dtype)
    try:
        for block_n in (0, 64, 256):  # 256: not on every slice bound (128 / 64 wide): the 64 tile instead
            set_lora_chain_block_n(block_n)
            one, h_one = _run(x, a, b, off, ranks, scaling, groups, 2, chain_counters(DEVICE), shrink=shrink,
                              with_h=True)
            torch.testing.assert_close(one, two, atol=atol, rtol=rtol)
            if shrink == "grouped":  # the entries lora_shrink writes, and only those, bit for bit
                assert torch.equal(h_one.isnan(), h.isnan()) and (~h.isnan()).any()
                assert torch.equal(h_one.nan_to_num(), h.nan_to_num())
    finally:
        set_lora_chain_block_n(0)
    with pytest.raises(ValueError, match="0, 64, 128 or 256"):
        set_lora_chain_block_n(96)


def test_lora_chain_refuses_what_it_cannot_serve():
    """Errors name the tensor, the expected and the found shape."""
    gen = torch.Generator().manual_seed(2)
    a, b, ranks, scaling, off = _factors(torch.float32, gen, OUTS)
    groups = SlotGroups.build(torch.tensor([0, 1], dtype=torch.int32), S, DEVICE)
    x = torch.randn(2, H, device=DEVICE)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    h = torch.empty(1, len(OUTS), 2, R, device=DEVICE)
    ok = dict(x=x, a=a, b_cat=b, slice_offsets=off_t, slice_bounds=tuple(off), ranks=ranks, scaling=scaling,
              token_slots=groups.token_slots, active_slots=groups.active_slots, h=h,
              delta=torch.empty(2, sum(OUTS), device=DEVICE), counters=chain_counters(DEVICE))
    for bad, msg in [({"x": torch.randn(2, H + 1, device=DEVICE)}, "x must be"),
                     ({"delta": torch.empty(3, sum(OUTS), device=DEVICE)}, "delta"),
                     ({"h": torch.empty(1, len(OUTS), 2, R + 1, device=DEVICE)}, "h \\[split_k"),
                     ({"slice_bounds": (0, 100, 164, sum(OUTS))}, "slice bounds"),
                     ({"counters": torch.zeros(2, device=DEVICE)}, "counters must be int32"),
                     ({"groups": SlotGroups.build(torch.tensor([0, 1], dtype=torch.int32), 2, DEVICE)},
                      "groups must be the batch's")]:
        with pytest.raises(ValueError, match=msg):
            lora_chain(**{**ok, **bad})


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_deferred_one_launch(dtype, monkeypatch):
    """set_dense_defer_one_launch: forward_deferred's delta from one lora_chain launch (no lora_shrink, no lora_delta)
    on the layer's own counters, equal to the two-launch chain's up to fp32 order, every entry written (the buffers
    start as NaN), rows without an adapter exactly 0."""
    from test_dense_lora_defer import _defer, _deferred_case

    from moelora.kernels import lora_chain_triton, lora_delta_triton, lora_triton
    from moelora.layers import linear

    slots = [0, -1, 3, 1, 2, 0, -1, 1, 3]
    lin, _, lora, x = _deferred_case(dtype, 9, slots=slots)
    calls = {"shrink": 0, "delta": 0, "chain": 0}

    seen = []

    def spy(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or seen.append(k) or fn(*a, **k)

    nan_empty = torch.empty
    monkeypatch.setattr(lora_triton, "lora_shrink", spy("shrink", lora_triton.lora_shrink))
    monkeypatch.setattr(lora_delta_triton, "lora_delta", spy("delta", lora_delta_triton.lora_delta))
    monkeypatch.setattr(lora_chain_triton, "lora_chain", spy("chain", lora_chain_triton.lora_chain))
    monkeypatch.setattr(linear.torch, "empty", lambda *a, **k: nan_empty(*a, **k).fill_(float("nan")))
    before = _triton.dense_defer_one_launch()
    try:
        with torch.no_grad(), _defer(True):
            _, own = lin.forward_deferred(x, lora)
            assert calls == {"shrink": 1, "delta": 1, "chain": 0}
            _triton.set_dense_defer_one_launch(True)
            _, one = lin.forward_deferred(x, lora)
            assert calls == {"shrink": 1, "delta": 1, "chain": 1}
            assert seen[-1]["groups"] is lora.groups  # the grouped shrink by default
            lora_chain_triton.set_lora_chain_shrink("stacked")
            _, stacked = lin.forward_deferred(x, lora)
            assert calls["chain"] == 2 and seen[-1]["groups"] is None
    finally:
        _triton.set_dense_defer_one_launch(before)
        lora_chain_triton.set_lora_chain_shrink("grouped")
    assert not one.isnan().any() and lin.chain_counters.tolist() == [0, 0]
    assert (one[(torch.tensor(slots) < 0).to(DEVICE)] == 0).all()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(one, own, atol=atol, rtol=rtol)
    torch.testing.assert_close(stacked, own, atol=atol, rtol=rtol)
    assert own.abs().max() > 0.05



@pytest.mark.gpu
@pytest.mark.parametrize("shrink", ["grouped", "stacked"])
def test_lora_chain_spin_sleep_gives_the_same_delta(shrink):
    """set_lora_chain_spin_sleep (nanosleep between the delta programs' polls, GPU only): the same delta bit for
    bit, the counters left at zero, at the qkv shape with 64 tokens over 4 adapters and base rows."""
    from moelora.kernels.lora_chain_triton import set_lora_chain_spin_sleep

    gen = torch.Generator().manual_seed(5)
    a, b, ranks, scaling, off = _factors(torch.bfloat16, gen, OUTS)
    slots = token_slots("with_base_rows", 64, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    x = torch.randn(64, H, generator=gen).to(DEVICE, torch.bfloat16)
    counters = chain_counters(DEVICE)
    plain = _run(x, a, b, off, ranks, scaling, groups, 4, counters, block_k=128, shrink=shrink)
    try:
        set_lora_chain_spin_sleep(True)
        slept = _run(x, a, b, off, ranks, scaling, groups, 4, counters, block_k=128, shrink=shrink)
    finally:
        set_lora_chain_spin_sleep(False)
    assert torch.equal(slept, plain) and counters.tolist() == [0, 0]
    assert plain.abs().max() > 0.01
