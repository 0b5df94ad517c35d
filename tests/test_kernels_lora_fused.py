"""The fused decode routed-expert LoRA kernel (moe_lora_fused_triton.py) vs its reference, and the set_fused_lora
switch in fused_moe_pairs.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes in fp32/fp16. GPU (marked gpu): Qwen3-30B-A3B
shapes in bf16, CUDA-graph replay, the side-stream (store mode) path."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, POPULARITY, token_slots, tolerance
from moelora.kernels._triton import fused_lora, set_fused_lora
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref

S = 4
TOKENS = [1, 3, 7, 33]
# CPU: small widths (gate/up 24 wide, down 48) with several output tiles at forced splits; GPU: Qwen3-30B-A3B
E, K, H, I = (128, 8, 2048, 768) if ON_GPU else (8, 2, 48, 24)
RANK_TABLE = [[16, 4, 0, 8], [8, 16, 4, 2], [2, 16, 8, 4]]  # per (slice, slot); rank 0 for slice 0 at slot 2


def _ranks(n: int, R: int) -> torch.Tensor:
    return (torch.tensor(RANK_TABLE[:n], dtype=torch.int32) * R // 16).to(torch.int32)


def _offsets(outs: list[int]) -> list[int]:
    off = [0]
    for o in outs:
        off.append(off[-1] + o)
    return off


def _moe_factors(n, D, outs, dtype, gen, R=16, shared_a=False, shared_b=False):
    """a: [n, S, E|1, R, D] · b: [S, E|1, O, R], zero past each (slice, slot)'s rank as the slot pool writes them."""
    ranks = _ranks(n, R)
    a = torch.randn(n, S, 1 if shared_a else E, R, D, generator=gen) * 0.1
    b = torch.randn(S, 1 if shared_b else E, sum(outs), R, generator=gen) * 0.1
    off = _offsets(outs)
    for i in range(n):
        for s in range(S):
            a[i, s, :, ranks[i, s]:] = 0
            b[s, :, off[i]:off[i + 1], ranks[i, s]:] = 0
    scaling = torch.rand(n, S, generator=gen) + 0.5
    return (a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks.to(DEVICE), scaling.to(DEVICE),
            torch.tensor(off, dtype=torch.int32, device=DEVICE))


def _moe_case(site, popularity, T, dtype, gen, R=16, shared=False):
    slots = token_slots(popularity, T, S, gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEVICE)
    if site == "gate_up":  # input per token, two slices (gate, up) with their own A
        n, D, outs, x, per_pair, w = 2, H, [I, I], torch.randn(T, H, generator=gen), False, None
    else:  # down: input per pair, one slice, router weight applied
        n, D, outs, x, per_pair = 1, I, [H], torch.randn(T * K, I, generator=gen), True
        w = torch.rand(T * K, generator=gen).to(DEVICE)
    a, b, ranks, scaling, off = _moe_factors(n, D, outs, dtype, gen, R, shared_a=shared and site == "gate_up",
                                             shared_b=shared and site == "down")
    y0 = torch.randn(T * K, sum(outs), generator=gen).to(DEVICE, dtype)
    return dict(x=x.to(DEVICE, dtype), a=a, b=b, off=off, ranks=ranks, scaling=scaling, ids=ids, slots=slots,
                per_pair=per_pair, w=w, y0=y0)


def _moe_call(fn, c, y, **kw):
    fn(c["x"], c["a"], c["b"], c["off"], c["ranks"], c["scaling"], c["ids"], c["slots"], E, y, c["per_pair"], c["w"], **kw)


def _untouched_checks(y, y0, slots, ranks, off, rows_per_token):
    """Rows of slot -1 and (slice, slot) pairs of rank 0 stay bit-identical (add mode)."""
    base = (slots < 0).repeat_interleave(rows_per_token)
    assert torch.equal(y[base], y0[base]), "rows without an adapter must stay untouched"
    row_slot = slots.long().repeat_interleave(rows_per_token)
    o = off.tolist()
    for i in range(ranks.shape[0]):
        for s in range(S):
            if ranks[i, s] == 0:
                rows = row_slot == s
                assert torch.equal(y[rows, o[i]:o[i + 1]], y0[rows, o[i]:o[i + 1]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_moe_fused_matches_reference(site, popularity, num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 13 + len(popularity))
    c = _moe_case(site, popularity, num_tokens, dtype, gen)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _moe_call(moe_lora_fused, c, y)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    _untouched_checks(y, c["y0"], c["slots"], c["ranks"], c["off"], K)
    if (c["slots"] >= 0).any():
        assert not torch.equal(y, c["y0"])


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("delta", [None, "same", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_fused_act_in_reads_the_activation_silu_and_mul_writes(dtype, delta, store):
    """moe_lora_fused(act_in=True) on gate_up's output [P, 2I] (and its delta, in the activations' dtype or fp32)
    gives what it gives on silu_and_mul's output from the same inputs, bit for bit (the same operations on the same
    numbers; set_moe_lora_early_down relies on it), and its reference what the reference gives on
    silu_and_mul_ref's; the two agree within the dtype's tolerance. Wrong shapes are refused by name."""
    from moelora.kernels.moe.experts_triton import silu_and_mul, silu_and_mul_ref

    gen = torch.Generator().manual_seed(29)
    c = _moe_case("down", "with_base_rows", 7, dtype, gen)
    P = c["x"].shape[0]
    gu = (torch.randn(P, 2 * I, generator=gen) * 2).to(DEVICE, dtype)
    xd = None if delta is None else (torch.randn(P, 2 * I, generator=gen) * 0.5).to(
        DEVICE, torch.float32 if delta == "fp32" else dtype)
    act = silu_and_mul(gu, delta=xd)  # [P, I]
    act_ref = silu_and_mul_ref(gu if xd is None else (gu.float() + xd.float()).to(dtype))

    def run(fn, x, **kw):
        y = c["y0"].clone()
        fn(x, c["a"], c["b"], c["off"], c["ranks"], c["scaling"], c["ids"], c["slots"], E, y, True, c["w"],
           store=store, **kw)
        return y

    got = run(moe_lora_fused, gu, act_in=True, act_delta=xd)
    assert torch.equal(got, run(moe_lora_fused, act))
    ref = run(moe_lora_fused_ref, gu, act_in=True, act_delta=xd)
    assert torch.equal(ref, run(moe_lora_fused_ref, act_ref))
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    assert not torch.equal(got, c["y0"])
    with pytest.raises(ValueError, match=rf"x \[{P}, {2 * I}\].*found \({P}, {I}\)"):
        run(moe_lora_fused, act, act_in=True)
    with pytest.raises(ValueError, match="act_delta must be"):
        run(moe_lora_fused, gu, act_in=True, act_delta=gu[:, :I])
    with pytest.raises(ValueError, match="only with act_in"):
        run(moe_lora_fused_ref, act, act_delta=gu)


@pytest.mark.parametrize("site", ["gate_up", "down"])
@pytest.mark.parametrize("popularity", ["with_base_rows", "identical", "distinct"])
def test_moe_fused_store_mode_writes_every_entry(site, popularity):
    """store=True into an uninitialised (NaN) fp32 buffer: the delta where a slot has rank > 0, else exactly 0."""
    gen = torch.Generator().manual_seed(17)
    c = _moe_case(site, popularity, 7, DTYPES[0], gen)
    P, O = c["y0"].shape
    ref = torch.full((P, O), float("nan"), device=DEVICE)
    got = ref.clone()
    _moe_call(moe_lora_fused_ref, c, ref, store=True)
    _moe_call(moe_lora_fused, c, got, store=True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-4 if DTYPES[0] == torch.float32 else 2e-2, rtol=1e-3)
    base = (c["slots"] < 0).repeat_interleave(K)
    assert torch.equal(got[base], torch.zeros_like(got[base]))
    # store into a buffer of the activations' dtype (set_lora_delta_dtype("activation")): the fp32 delta rounded once
    if DTYPES[0] != torch.float32:
        low = torch.full((P, O), float("nan"), device=DEVICE, dtype=DTYPES[0])
    else:
        low = torch.full((P, O), float("nan"), device=DEVICE, dtype=torch.float16)
    _moe_call(moe_lora_fused, c, low, store=True)
    assert torch.equal(low, got.to(low.dtype))
    # store then add onto y0 equals the in-place (add mode) result
    y_add = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y_add)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close((c["y0"].float() + got).to(y_add.dtype), y_add, atol=atol, rtol=rtol)


@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_moe_fused_shared_outer_matches_expanded_factors(site):
    """gate_up A and down B with an expert dim of 1: the same as those factors copied to every expert."""
    gen = torch.Generator().manual_seed(23)
    c = _moe_case(site, "with_base_rows", 9, DTYPES[0], gen, shared=True)
    assert (c["a"].shape[2] == 1) == (site == "gate_up") and (c["b"].shape[1] == 1) == (site == "down")
    y_shared, y_full, y_ref = c["y0"].clone(), c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused, c, y_shared)
    _moe_call(moe_lora_fused_ref, c, y_ref)
    full = dict(c, a=c["a"].expand(-1, -1, E, -1, -1).contiguous(), b=c["b"].expand(-1, E, -1, -1).contiguous())
    _moe_call(moe_lora_fused, full, y_full)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close(y_shared, y_full, atol=atol, rtol=rtol)
    torch.testing.assert_close(y_shared, y_ref, atol=atol, rtol=rtol)


def test_moe_fused_gate_and_up_use_their_own_a():
    """Zeroing up's A leaves the up columns untouched and the gate columns as before."""
    gen = torch.Generator().manual_seed(29)
    c = _moe_case("gate_up", "uniform", 5, DTYPES[0], gen)
    y_both = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y_both)
    a = c["a"].clone()
    a[1] = 0
    y_gate = c["y0"].clone()
    _moe_call(moe_lora_fused, dict(c, a=a), y_gate)
    assert torch.equal(y_gate[:, I:], c["y0"][:, I:])
    assert torch.equal(y_gate[:, :I], y_both[:, :I])
    assert not torch.equal(y_both[:, I:], c["y0"][:, I:])


@pytest.mark.parametrize("store", [False, True])
def test_moe_fused_reads_a_from_the_slice_a_src_names(store):
    check_reads_a_through_a_src(moe_lora_fused, store)


@pytest.mark.parametrize("store", [False, True])
def test_moe_fused_slice_first_grid_changes_nothing(store):
    """set_fused_lora_slice_first: the (slice, pair, split) grid computes bit for bit what the (pair, slice, split) one
    does (each program's work is the same), with and without a shared A read through a_src; differs from y0."""
    from moelora.kernels.moe_lora import fused_triton as mlf

    gen = torch.Generator().manual_seed(41)
    c = _moe_case("gate_up", "with_base_rows", 7, DTYPES[0], gen)
    a_src = torch.tensor([[0] * S, [0, 1, 0, 1]], dtype=torch.int32, device=DEVICE)
    c_shared = dict(c, a=torch.cat([c["a"][:1], c["a"][:1]]), ranks=torch.cat([c["ranks"][:1], c["ranks"][:1]]))
    before = mlf.fused_lora_slice_first()
    outs = {}
    try:
        for first in (False, True):
            mlf.set_fused_lora_slice_first(first)
            for name, case, kw in (("own", c, {}), ("shared", c_shared, {"a_src": a_src})):
                outs[first, name] = c["y0"].clone()
                _moe_call(moe_lora_fused, case, outs[first, name], store=store, **kw)
    finally:
        mlf.set_fused_lora_slice_first(before)
    for name in ("own", "shared"):
        assert torch.equal(outs[True, name], outs[False, name]), name
        assert not torch.equal(outs[True, name], c["y0"]), name


def check_reads_a_through_a_src(fn, store: bool) -> None:
    """a_src [n, S]: slice 1 (up) of the slots it names reads slice 0's A. With up's A set equal to gate's
    (the shared-A layout) the result is bit-equal to reading its own copy; with up's own copy then spoiled (NaN)
    where a_src points away from it, still the same — the kernel does not touch that copy — while the slots that
    keep their own A see the NaN. (fn: moe_lora_fused, or the grouped kernel: test_kernels_moe_lora_grouped.py)"""
    gen = torch.Generator().manual_seed(31)
    c = _moe_case("gate_up", "distinct", 9, DTYPES[0], gen)
    ranks = c["ranks"].clone()
    ranks[1] = ranks[0]  # shared A: equal ranks, equal factors
    a = c["a"].clone()
    a[1] = a[0]
    c = dict(c, a=a, ranks=ranks)
    a_src = torch.tensor([[0] * S, [0, 0, 1, 0]], dtype=torch.int32, device=DEVICE)  # slot 2 reads its own
    own, named = c["y0"].clone(), c["y0"].clone()
    _moe_call(fn, c, own, store=store)
    _moe_call(fn, c, named, store=store, a_src=a_src)
    assert torch.equal(named, own)
    spoiled = a.clone()
    spoiled[1] = float("nan")
    got = c["y0"].clone()
    _moe_call(fn, dict(c, a=spoiled), got, store=store, a_src=a_src)
    rows = (c["slots"] >= 0) & (c["slots"] != 2) & (ranks[1][c["slots"].clamp(min=0).long()] > 0)
    rows = rows.repeat_interleave(K)
    assert rows.any() and torch.equal(got[rows], own[rows])
    two = (c["slots"] == 2).repeat_interleave(K)
    if two.any() and ranks[1, 2] > 0:
        assert got[two][:, I:].isnan().all()
    with pytest.raises(ValueError, match="a_src must be"):
        _moe_call(fn, c, got, a_src=a_src.long())


def test_lora_weights_name_a_shared_a():
    """LoRAWeights.a_src: set where gate and up of a slot get the same A (either order), back to each slice's own
    when either is rewritten with another A or cleared; dense weights never share."""
    from moelora.layers.lora import LoRAWeights

    g = torch.Generator().manual_seed(3)
    w = LoRAWeights(H, [I, I], max_loras=S, max_lora_rank=16, num_experts=E)
    a, b = torch.randn(E, 8, H, generator=g), torch.randn(E, I, 8, generator=g)
    w.set_slot(0, 1, a, b, 2.0)
    w.set_slot(1, 1, a, b, 2.0)
    w.set_slot(1, 2, a, b, 2.0)  # up first, then gate: found too
    w.set_slot(0, 2, a.clone(), b, 2.0)
    w.set_slot(0, 3, a, b, 2.0)
    w.set_slot(1, 3, a * 2, b, 2.0)  # another A
    assert w.a_src.tolist() == [[0, 0, 0, 0], [1, 0, 0, 1]] and w.a_src_host == w.a_src.tolist()
    w.set_slot(0, 1, a * 3, b, 2.0)  # gate rewritten: up reads its own again
    w.clear(0, 2)
    assert w.a_src.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]] and w.a_src_host == w.a_src.tolist()
    w.set_slot(1, 1, a * 3, b * 5, 1.0)  # the same A again, another B and scaling: shared
    assert w.a_src[1, 1] == 0
    w.set_slot(1, 1, a[:, :4] * 3, b[:, :, :4], 1.0)  # rank 4 against 8: not shared
    assert w.a_src[1, 1] == 1
    dense = LoRAWeights(H, [I, I], max_loras=S, max_lora_rank=16)
    dense.set_slot(0, 0, a[0], b[0], 2.0)
    dense.set_slot(1, 0, a[0], b[0], 2.0)
    assert dense.a_src.tolist() == [[0] * S, [1] * S]


@pytest.mark.parametrize("R", [32, 64])
def test_moe_fused_larger_ranks(R):
    """Max rank 32/64 (rank tile and input/output tiles change), per-slot ranks below it and 0."""
    gen = torch.Generator().manual_seed(R)
    for site in ("gate_up", "down"):
        c = _moe_case(site, "with_base_rows", 7, DTYPES[0], gen, R=R)
        y_ref, y = c["y0"].clone(), c["y0"].clone()
        _moe_call(moe_lora_fused_ref, c, y_ref)
        _moe_call(moe_lora_fused, c, y)
        atol, rtol = tolerance(DTYPES[0])
        torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("R", [16, 24])
@pytest.mark.parametrize("site", ["gate_up", "down"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_moe_fused_never_uses_factors_past_each_rank(site, R, pipelined, monkeypatch):
    """A and B past each (slice, slot)'s rank hold NaN: the result equals the zero-padded one, bit for bit, in add
    and store mode. Pipelined (both loops 3 deep, as 4-warp launches run) with R 16: the buffer's rank equals the
    rank tile, so B is read in whole rank rows and the entries past the rank zeroed after the load; otherwise, and
    with R 24 (a rank tile of 32), masked in the load."""
    from moelora.kernels.moe_lora import fused_triton as mf

    if pipelined:
        monkeypatch.setattr(mf, "_D_STAGES", [3])
        monkeypatch.setattr(mf, "_E_STAGES", [3])
    gen = torch.Generator().manual_seed(70 + R)
    c = _moe_case(site, "with_base_rows", 5, DTYPES[0], gen, R=R)
    a_nan, b_nan = c["a"].clone(), c["b"].clone()
    off = c["off"].tolist()
    for i in range(a_nan.shape[0]):
        for s in range(S):
            r = int(c["ranks"][i, s])
            a_nan[i, s, :, r:] = float("nan")
            b_nan[s, :, off[i]:off[i + 1], r:] = float("nan")
    for store in (False, True):
        y, y_nan = c["y0"].clone(), c["y0"].clone()
        _moe_call(moe_lora_fused, c, y, store=store)
        _moe_call(moe_lora_fused, {**c, "a": a_nan, "b": b_nan}, y_nan, store=store)
        assert not y_nan.isnan().any() and torch.equal(y_nan, y), (site, R, store)


def test_moe_fused_split_n_does_not_change_results():
    """SPLIT_N only spreads output tiles over programs: every split gives the same bits (fp32); the warp count
    (and the tiles that scale with it) the same values."""
    gen = torch.Generator().manual_seed(31)
    c = _moe_case("down", "uniform", 3, torch.float32, gen)
    outs = []
    for split in (1, 2, 3, 64):
        y = c["y0"].clone()
        _moe_call(moe_lora_fused, c, y, split_n=split, num_warps=4)
        outs.append(y)
    for warps in (8, 16):
        y = c["y0"].clone()
        _moe_call(moe_lora_fused, c, y, num_warps=warps)
        torch.testing.assert_close(y, outs[0], atol=1e-5, rtol=1e-5)
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


@pytest.mark.parametrize("experiment", ["stages", "expand_stages"])
def test_moe_fused_launch_experiments_keep_the_results(experiment, monkeypatch):
    """MOELORA_FUSED_LORA_STAGES / _EXPAND_STAGES (the shrink / expand loops pipelined through shared memory; on the
    GPU the Qwen3 input dim takes 8 tiles): they change how the kernel runs, not what it computes."""
    from moelora.kernels.moe_lora import fused_triton as mf

    gen = torch.Generator().manual_seed(32)
    # rank 64 for the expand's stages: at 1 warp its tiles are then 16 wide, several per slice and per input row
    c = _moe_case("gate_up", "uniform", 3, torch.float32, gen, R=64 if experiment == "expand_stages" else 16)
    y0 = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y0)
    kw = {}
    if experiment == "stages":
        monkeypatch.setattr(mf, "_D_STAGES", [3])
        with pytest.raises(ValueError, match="stages"):
            mf.set_fused_lora_stages(-1)
        monkeypatch.setattr(mf, "_AUTO_PIPELINE", [False])
        assert mf.fused_stages(4) == (3, 1)  # forced shrink depth, the launch's expand depth
        monkeypatch.setattr(mf, "_D_STAGES", [0])
        assert mf.fused_stages(4) == (1, 1)
        mf.set_fused_lora_pipeline(True)
        assert mf.fused_stages(4) == (mf.PIPELINED_STAGES,) * 2 and mf.fused_stages(16) == (1, 1)
        monkeypatch.setattr(mf, "_D_STAGES", [3])
    elif experiment == "expand_stages":
        monkeypatch.setattr(mf, "_E_STAGES", [3])
        kw = {"num_warps": 1}
        with pytest.raises(ValueError, match="expand_stages"):
            mf.set_fused_lora_stages(1, -1)
    y = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y, **kw)
    torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    assert not torch.equal(y, c["y0"])


# ---------------------------------------------------------------- the switch


@pytest.fixture
def fused_switch():
    before = fused_lora()
    yield set_fused_lora
    set_fused_lora(before)


def _moe_layer(T, dtype, gen, popularity="with_base_rows"):
    from moelora.kernels.moe.experts import ExpertLoRAArgs, route_topk_ref

    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEVICE, dtype)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    a_gu, b_gu, r_gu, s_gu, off_gu = _moe_factors(2, H, [I, I], dtype, gen)
    a_d, b_d, r_d, s_d, off_d = _moe_factors(1, I, [H], dtype, gen)
    slots = token_slots(popularity, T, S, gen).to(DEVICE)
    # offsets on the device up front, as the engine passes them (no host copy inside a graph capture)
    return x, w_gu, w_d, weights, ids, ExpertLoRAArgs(slots, a_gu, b_gu, s_gu, r_gu, a_d, b_d, s_d, r_d, off_gu, off_d)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_fused_moe_pairs_switch_on_equals_off(kernels, fused_switch):
    from moelora.kernels.moe.experts import fused_moe_pairs
    from moelora.kernels.moe_lora.chain import moe_lora_expand_ref, moe_lora_shrink_ref
    from moelora.kernels.moe_lora.chain_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink

    gen = torch.Generator().manual_seed(61)
    dtype = DTYPES[0]
    x, w_gu, w_d, weights, ids, args = _moe_layer(11, dtype, gen)
    ops = (moe_lora_shrink_ref, moe_lora_expand_ref, None) if kernels == "reference" else (
        moe_lora_shrink, moe_lora_expand, moe_lora_plan)
    fused_switch(False)
    off = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
    fused_switch(True)
    on = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
    fused_switch(False)
    no_lora = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", None, *ops)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    rel = ((on.float() - off.float()).norm() / off.float().norm()).item()
    assert rel < bound, f"relative error {rel:.2e} >= {bound}"
    assert ((no_lora.float() - off.float()).norm() / off.float().norm()).item() > 10 * bound


def test_fused_switch_takes_the_fused_kernel(fused_switch, monkeypatch):
    """Switch on: fused_moe_pairs calls the fused op, never shrink/expand; off: never the fused op."""
    from moelora.kernels.moe_lora import fused_triton as mf
    from moelora.kernels.moe.experts import fused_moe_pairs
    from moelora.kernels.moe_lora.chain import moe_lora_expand_ref, moe_lora_shrink_ref

    calls = {"fused": 0, "shrink": 0}
    real = mf.moe_lora_fused_ref

    def counting_fused(*a, **kw):
        calls["fused"] += 1
        real(*a, **kw)

    def counting_shrink(*a, **kw):
        calls["shrink"] += 1
        moe_lora_shrink_ref(*a, **kw)

    monkeypatch.setattr(mf, "moe_lora_fused_ref", counting_fused)
    monkeypatch.setattr(mf, "fused_for", lambda shrink: counting_fused)
    gen = torch.Generator().manual_seed(67)
    x, w_gu, w_d, weights, ids, args = _moe_layer(3, DTYPES[0], gen)
    fused_switch(True)
    fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, counting_shrink, moe_lora_expand_ref)
    assert calls == {"fused": 2, "shrink": 0}
    fused_switch(False)
    fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, counting_shrink, moe_lora_expand_ref)
    assert calls == {"fused": 2, "shrink": 2}


def test_switch_env_defaults():
    """Routed-expert fused LoRA on unless MOELORA_FUSED_LORA=0."""
    import os
    import subprocess
    import sys

    code = "from moelora.kernels._triton import fused_lora; print(fused_lora())"
    env = {k: v for k, v in os.environ.items() if k != "MOELORA_FUSED_LORA"}

    def run(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert run() == "True"
    assert run(MOELORA_FUSED_LORA="0") == "False"


def test_pipeline_switch_env_defaults():
    """The pipelined routed LoRA form and the dense whole-rank-row reads are on unless MOELORA_FUSED_LORA_PIPELINE=0
    / MOELORA_LORA_EVEN_R=0 (both measured end to end); forced depths from the environment win."""
    import os
    import subprocess
    import sys

    code = ("from moelora.kernels._triton import lora_even_r; "
            "from moelora.kernels.moe_lora.fused_triton import fused_stages; "
            "print(lora_even_r(), fused_stages(4), fused_stages(8))")
    env = {k: v for k, v in os.environ.items() if k not in (
        "MOELORA_FUSED_LORA_PIPELINE", "MOELORA_LORA_EVEN_R", "MOELORA_FUSED_LORA_STAGES",
        "MOELORA_FUSED_LORA_EXPAND_STAGES")}

    def run(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert run() == "True (3, 3) (1, 1)"
    assert run(MOELORA_FUSED_LORA_PIPELINE="0", MOELORA_LORA_EVEN_R="0") == "False (1, 1) (1, 1)"
    early_down = "from moelora.kernels._triton import moe_lora_early_down; print(moe_lora_early_down())"
    for value, want in ((None, "True"), ("0", "False"), ("1", "True")):  # on unless =0
        extra = {} if value is None else {"MOELORA_MOE_LORA_EARLY_DOWN": value}
        base = {k: v for k, v in env.items() if k != "MOELORA_MOE_LORA_EARLY_DOWN"}
        got = subprocess.run([sys.executable, "-c", early_down], env={**base, **extra}, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert got == want, (value, got)
    assert run(MOELORA_LORA_EVEN_R="0", MOELORA_FUSED_LORA_EXPAND_STAGES="2") == "False (3, 2) (1, 2)"


# ---------------------------------------------------------------- GPU: real shapes, bf16, graphs, side stream


@pytest.mark.gpu
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 128, 256])
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_gpu_moe_fused_qwen3_shapes(site, num_tokens, R):
    gen = torch.Generator().manual_seed(num_tokens + R)
    c = _moe_case(site, "uniform", num_tokens, torch.bfloat16, gen, R=R)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _moe_call(moe_lora_fused, c, y)
    torch.testing.assert_close(y, y_ref, atol=3e-2, rtol=3e-2)
    d_ref = torch.empty(y.shape, dtype=torch.float32, device=DEVICE)
    d = torch.empty_like(d_ref)
    _moe_call(moe_lora_fused_ref, c, d_ref, store=True)
    _moe_call(moe_lora_fused, c, d, store=True)
    torch.testing.assert_close(d, d_ref, atol=3e-2, rtol=3e-2)  # the reference rounds h to bf16, the kernel keeps fp32


def _replayed_on_new_inputs(run, x, weights, ids, args, gen) -> torch.Tensor:
    """run() warmed up on a side stream, captured in a CUDA graph, then replayed after new x, routing and slots (a
    64-token _moe_layer with uniform popularity) are written into the captured inputs; returns the graph's output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    x2, _, _, weights2, ids2, args2 = _moe_layer(64, torch.bfloat16, gen, popularity="uniform")
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    args.token_slots.copy_(args2.token_slots)
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True, "fp32_delta"])
def test_gpu_fused_moe_pairs_graph_replay_and_overlap(overlap, fused_switch, monkeypatch):
    """Switch on: fused_moe_pairs (Triton base + fused LoRA; store mode on the side stream when overlapping)
    equals the unfused path, and a CUDA-graph replay equals eager after new routing and slots are written.
    True: overlapping, the deltas in the activations' dtype (set_lora_delta_dtype's default); fp32_delta:
    overlapping with fp32 deltas (set_lora_delta_dtype("fp32"))."""
    from moelora.kernels import _triton
    from moelora.kernels.moe.experts import fused_moe_pairs

    monkeypatch.setattr(_triton, "_LORA_DELTA", ["fp32" if overlap == "fp32_delta" else "activation"])
    from moelora.kernels.moe_lora.chain_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink
    from moelora.kernels.streams import side_stream

    gen = torch.Generator().manual_seed(83)
    x, w_gu, w_d, weights, ids, args = _moe_layer(64, torch.bfloat16, gen)
    side = side_stream(x.device) if overlap else None
    ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan)
    fused_switch(False)
    ref = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops, side)
    fused_switch(True)
    eager = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops, side)
    rel = ((eager.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2
    out = _replayed_on_new_inputs(lambda: fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops, side),
                                  x, weights, ids, args, gen)
    expect = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops, side)
    torch.testing.assert_close(out, expect)  # bf16 tolerances: stale routing or slots would differ by far more
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() > 1e-1  # new inputs, new result


def test_moe_lora_early_switch():
    """set_moe_lora_early: mode "2" by default, set and read back; bad values raise; set_moe_lora_early_down: on by
    default."""
    from moelora.kernels import _triton

    assert _triton.moe_lora_early() and _triton.moe_lora_early_mode() == "2"  # the default
    if "MOELORA_MOE_LORA_EARLY_DOWN" not in __import__("os").environ:
        assert _triton.moe_lora_early_down()  # on: +0.75%
    try:
        _triton.set_moe_lora_early(True)
        assert _triton.moe_lora_early() and _triton.moe_lora_early_mode() == "1"
        _triton.set_moe_lora_early("2")  # the alignment on its own stream, above the side stream's priority
        assert _triton.moe_lora_early() and _triton.moe_lora_early_mode() == "2"
        _triton.set_moe_lora_early("0")
        assert not _triton.moe_lora_early()
        with pytest.raises(ValueError, match="set_moe_lora_early"):
            _triton.set_moe_lora_early("3")
    finally:
        _triton.set_moe_lora_early("2")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["early", "early_fp32", "early_align", "early_down", "early_down_fp32"])
def test_gpu_moe_lora_early_changes_nothing(order, fused_switch, monkeypatch):
    """set_moe_lora_early on a GPU, overlapping on the side stream (gate_up's LoRA issued beside the alignment),
    with deltas in bf16 and in fp32: the output of the plain order bit for bit, eagerly and from a CUDA-graph replay
    after new routing and slots are written; the early launch with the alignment on its own stream (mode "2"),
    whose priority is above the side stream's; and with set_moe_lora_early_down too (down's LoRA reading gate_up's
    output and delta, act_in), deltas in bf16 and fp32."""
    from moelora.kernels import _triton
    from moelora.kernels.moe.experts import fused_moe_pairs
    from moelora.kernels.moe_lora.chain_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink
    from moelora.kernels.streams import side_stream

    gen = torch.Generator().manual_seed(84)
    x, w_gu, w_d, weights, ids, args = _moe_layer(64, torch.bfloat16, gen)
    side = side_stream(x.device)
    ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan)
    fused_switch(True)
    if order.endswith("fp32"):
        monkeypatch.setattr(_triton, "_LORA_DELTA", ["fp32"])
    monkeypatch.setattr(_triton, "_MOE_LORA_EARLY_DOWN", [False])

    def run():
        return fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops, side)

    monkeypatch.setattr(_triton, "_MOE_LORA_EARLY", ["0"])  # the reference: no early launch
    ref = run()
    from moelora.kernels.moe_lora import fused_triton as mlf
    from test_fp8_gpu import launch_records

    monkeypatch.setattr(_triton, "_MOE_LORA_EARLY", ["2" if order in ("early_align", "early_down") else "1"])
    monkeypatch.setattr(_triton, "_MOE_LORA_EARLY_DOWN", [order.startswith("early_down")])
    if order == "early_align":
        from moelora.kernels.streams import align_stream

        assert align_stream(x.device).priority < side.priority  # a lower number: a higher priority
    with launch_records(mlf._moe_lora_fused_kernel) as launches:
        run()
    # gate_up and down, both in store mode
    assert len(launches) == 2 and all(r["STORE"] for r in launches)
    # the down projection's launch reads gate_up's output and delta only with set_moe_lora_early_down
    assert [r.get("ACT_IN", False) for r in launches][-1] == order.startswith("early_down")
    eager = run()
    replayed = _replayed_on_new_inputs(run, x, weights, ids, args, gen).clone()
    assert torch.equal(eager, ref)
    assert torch.equal(replayed, run())  # the default order, eagerly, on the new inputs
    assert not torch.equal(replayed, ref)


@pytest.mark.gpu
def test_gpu_shared_a_switch_reads_one_copy_and_changes_nothing(tmp_path):
    """set_lora_shared_a on a GPU: a PEFT target_parameters adapter (gate and up share A) on a tiny Qwen3-MoE; the
    fused kernel launches with a_src and the prompt log-probabilities are bit-equal to the switch off (the copy it
    names holds the same values), and differ from no adapter."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    from helpers import Runner, rows_of, save_peft_adapter, save_tiny_model, tmp
    from test_fp8_gpu import launch_records

    from moelora.kernels import _triton
    from moelora.kernels.moe_lora import fused_triton as mlf

    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 1, r=8, lora_alpha=16, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    run = Runner(tmp(tmp_path, "m"), max_loras=2, max_lora_rank=16, dtype="bfloat16", device="cuda")
    run.load("ad", ad)
    rows = [(r, "ad") for r in rows_of(5, [3, 1, 1])] + [(rows_of(6, [2])[0], None)]
    outs = {}
    before = _triton.lora_shared_a(), mlf.fused_lora_slice_first()
    modes = ((False, False), (True, False), (True, True))
    try:
        for on, first in modes:  # slice first: gate, up side by side
            _triton.set_lora_shared_a(on)
            mlf.set_fused_lora_slice_first(first)
            with launch_records(mlf._moe_lora_fused_kernel) as recs:
                outs[on, first] = run.logprobs(rows)
            gate_up = [r for r in recs if not r.get("X_PER_PAIR")]  # down (x per pair) never shares A
            assert gate_up and all(bool(r.get("HAS_A_SRC")) == on for r in gate_up)
            assert all(bool(r.get("SLICE_FIRST")) == first for r in gate_up)
            assert all(not r.get("HAS_A_SRC") for r in recs if r.get("X_PER_PAIR"))
    finally:
        _triton.set_lora_shared_a(before[0])
        mlf.set_fused_lora_slice_first(before[1])
    for mode in modes[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[mode], outs[modes[0]])), mode
    plain = run.logprobs([(ids, None) for ids, _ in rows[:1]])[0]
    assert (outs[modes[1]][0] - plain).abs().max() > 1e-2
