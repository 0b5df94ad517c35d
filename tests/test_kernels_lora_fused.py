"""The per-pair fused routed-expert LoRA kernel (kernels/moe_lora/fused_triton.py) vs its reference, and
fused_moe_pairs with the LoRA backends an ExpertKernels names (moe_lora/backend.py).

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes in fp32/fp16. GPU (marked gpu): Qwen3-30B-A3B
shapes in bf16, CUDA-graph replay, the side-stream (store mode) path."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, POPULARITY, token_slots, tolerance
from moelora.kernels.moe.experts import ExpertKernels
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.backend import MoELoRAKernels
from moelora.kernels.moe_lora.config import MoELoRAConfig
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


def _lora(c, a_src=None) -> ProjLoRA:
    """The case's factors as a ProjLoRA (slices of equal width)."""
    return ProjLoRA(c["a"], c["b"], c["off"], c["ranks"], c["scaling"], c["b"].shape[2] // c["a"].shape[0], a_src)


def _routing(c) -> Routing:
    return Routing(c["ids"], c["slots"], E, c["a"].shape[1])


def _moe_call(fn, c, y, a_src=None, **kw):
    """fn (moe_lora_fused, its reference, moe_lora_grouped) on case c into y; the case's router weights on down."""
    fn(c["x"], _lora(c, a_src), _routing(c), y, x_per_pair=c["per_pair"], pair_weights=c["w"], **kw)


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
    numbers; moe_lora.early_down relies on it), and its reference what the reference gives on
    silu_and_mul_ref's; the two agree within the dtype's tolerance. Wrong shapes are refused by name."""
    from moelora.kernels.moe.act_triton import silu_and_mul, silu_and_mul_ref

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
        fn(x, _lora(c), _routing(c), y, x_per_pair=True, pair_weights=c["w"], store=store, **kw)
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
    # store into a buffer of the activations' dtype (the experts' delta buffers): the fp32 delta rounded once
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
def test_moe_fused_never_uses_factors_past_each_rank(site, R, pipelined):
    """A and B past each (slice, slot)'s rank hold NaN: the result equals the zero-padded one, bit for bit, in add
    and store mode. Pipelined (both loops 3 deep, as 4-warp launches run) with R 16: the buffer's rank equals the
    rank tile, so B is read in whole rank rows and the entries past the rank zeroed after the load; otherwise, and
    with R 24 (a rank tile of 32), masked in the load."""
    kw = {"stages": (3, 3)} if pipelined else {}
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
        _moe_call(moe_lora_fused, c, y, store=store, **kw)
        _moe_call(moe_lora_fused, {**c, "a": a_nan, "b": b_nan}, y_nan, store=store, **kw)
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


@pytest.mark.parametrize("stages,warps", [((3, 1), None), ((1, 3), 1)])
def test_moe_fused_pipelined_loops_keep_the_results(stages, warps):
    """The shrink / expand loops pipelined through shared memory (on the GPU the Qwen3 input dim takes 8 tiles): they
    change how the kernel runs, not what it computes. The launch pipelines both for 4-warp programs only."""
    from moelora.kernels.moe_lora import fused_triton as mf

    assert mf.fused_stages(4) == (mf.PIPELINED_STAGES,) * 2 and mf.fused_stages(16) == (1, 1)
    gen = torch.Generator().manual_seed(32)
    # rank 64 for the expand's stages: at 1 warp its tiles are then 16 wide, several per slice and per input row
    c = _moe_case("gate_up", "uniform", 3, torch.float32, gen, R=64 if warps == 1 else 16)
    y0 = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y0)
    y = c["y0"].clone()
    _moe_call(moe_lora_fused, c, y, stages=stages, num_warps=warps)
    torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    assert not torch.equal(y, c["y0"])


# ---------------------------------------------------------------- the backends in fused_moe_pairs


TRITON = ExpertKernels(True, MoELoRAKernels(True))  # the Triton kernels, base and LoRA (the GPU's choice)
REFERENCE = ExpertKernels()  # the references (the CPU's choice)


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


def _rel(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_fused_moe_pairs_lora_backends_compute_fused_moe_ref(kernels):
    """The per-pair LoRA backend (Triton, base path and LoRA) and the reference backend compute fused_moe_ref."""
    from moelora.kernels.moe.experts import fused_moe_pairs, fused_moe_ref

    gen = torch.Generator().manual_seed(61)
    dtype = DTYPES[0]
    x, w_gu, w_d, weights, ids, args = _moe_layer(11, dtype, gen)
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, TRITON if kernels == "triton" else REFERENCE)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert _rel(got, ref) < bound, f"relative error {_rel(got, ref):.2e} >= {bound}"
    assert _rel(fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", None), ref) > 10 * bound


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_each_family_launches_its_own_kernel(kernels, monkeypatch):
    """The family chosen once decides the kernel: the Triton family's decode batches run moe_lora_fused (gate_up, then
    down), the reference family moe_lora_fused_ref; neither runs the other's."""
    from moelora.kernels.moe.experts import fused_moe_pairs
    from moelora.kernels.moe_lora import backend

    calls = []
    for name in ("moe_lora_fused", "moe_lora_fused_ref"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _n=name, _f=real, **kw: (calls.append(_n), _f(*a, **kw))[1])
    gen = torch.Generator().manual_seed(67)
    x, w_gu, w_d, weights, ids, args = _moe_layer(3, DTYPES[0], gen)
    fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, TRITON if kernels == "triton" else REFERENCE)
    assert calls == ["moe_lora_fused" if kernels == "triton" else "moe_lora_fused_ref"] * 2


def test_expert_kernels_from_the_config():
    """ExpertKernels.from_config: the family given, cfg's thresholds and orders; `moe_lora.*` overrides reach it."""
    from moelora.kernels.config import KernelConfig

    assert ExpertKernels.from_config(MoELoRAConfig(), True) == ExpertKernels(True, MoELoRAKernels(True, 2048))
    cfg = KernelConfig().with_overrides({"moe_lora.early": "0", "moe_lora.early_down": "off",
                                         "moe_lora.grouped_min_pairs": "512", "moe_lora.prefill_epilogue": "0"})
    k = ExpertKernels.from_config(cfg.moe_lora, False)
    assert (k.triton, k.lora, k.early, k.early_down, k.prefill_epilogue) == (
        False, MoELoRAKernels(False, 512), False, False, False)
    with pytest.raises(ValueError, match="grouped_min_pairs"):
        MoELoRAConfig(grouped_min_pairs=0)


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
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_fused_moe_pairs_graph_replay_and_overlap(overlap):
    """fused_moe_pairs (Triton base + per-pair LoRA; store mode on the side stream when overlapping, the deltas in
    the activations' dtype) equals fused_moe_ref, and a CUDA-graph replay equals eager after new routing and slots
    are written."""
    from moelora.kernels.moe.experts import fused_moe_pairs, fused_moe_ref
    from moelora.kernels.streams import side_stream

    gen = torch.Generator().manual_seed(83)
    x, w_gu, w_d, weights, ids, args = _moe_layer(64, torch.bfloat16, gen)
    side = side_stream(x.device) if overlap else None
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    eager = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, TRITON, side)
    assert _rel(eager, ref) < 1e-2
    out = _replayed_on_new_inputs(lambda: fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, TRITON, side),
                                  x, weights, ids, args, gen)
    expect = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, TRITON, side)
    torch.testing.assert_close(out, expect)  # bf16 tolerances: stale routing or slots would differ by far more
    assert _rel(out, ref) > 1e-1  # new inputs, new result


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["early", "early_down"])
def test_gpu_moe_lora_early_changes_nothing(order):
    """moe_lora.early on a GPU, overlapping on the side stream (gate_up's LoRA issued beside the alignment, which runs
    on a stream above the side stream's priority): the output of the plain order bit for bit, eagerly and from a
    CUDA-graph replay after new routing and slots are written; and with moe_lora.early_down too (down's LoRA reading
    gate_up's output and delta, act_in)."""
    from moelora.kernels.moe.experts import fused_moe_pairs
    from moelora.kernels.moe_lora import fused_triton as mlf
    from moelora.kernels.streams import align_stream, side_stream
    from test_fp8_gpu import launch_records

    gen = torch.Generator().manual_seed(84)
    x, w_gu, w_d, weights, ids, args = _moe_layer(64, torch.bfloat16, gen)
    side = side_stream(x.device)
    assert align_stream(x.device).priority < side.priority  # a lower number: a higher priority
    plain = ExpertKernels(True, MoELoRAKernels(True), early=False, early_down=False)
    kernels = ExpertKernels(True, MoELoRAKernels(True), early=True, early_down=order == "early_down")

    def run(k=kernels):
        return fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, k, side)

    ref = run(plain)
    with launch_records(mlf._moe_lora_fused_kernel) as launches:
        run()
    # gate_up and down, both in store mode
    assert len(launches) == 2 and all(r["STORE"] for r in launches)
    # the down projection's launch reads gate_up's output and delta only with early_down
    assert [r.get("ACT_IN", False) for r in launches][-1] == (order == "early_down")
    eager = run()
    replayed = _replayed_on_new_inputs(run, x, weights, ids, args, gen).clone()
    assert torch.equal(eager, ref)
    assert torch.equal(replayed, run(plain))  # the plain order, eagerly, on the new inputs
    assert not torch.equal(replayed, ref)


@pytest.mark.gpu
def test_gpu_shared_a_read_through_a_src(tmp_path):
    """A PEFT target_parameters adapter (gate and up share A) on a tiny Qwen3-MoE: the fused kernel's gate_up launches
    read A through a_src with the slices of a pair side by side (down never shares A), and the prompt
    log-probabilities differ from no adapter (that the copy a_src names holds the same values, so the same results:
    test_moe_fused_reads_a_from_the_slice_a_src_names)."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    from helpers import Runner, rows_of, save_peft_adapter, save_tiny_model, tmp
    from test_fp8_gpu import launch_records

    from moelora.kernels.moe_lora import fused_triton as mlf

    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 1, r=8, lora_alpha=16, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    run = Runner(tmp(tmp_path, "m"), max_loras=2, max_lora_rank=16, dtype="bfloat16", device="cuda")
    run.load("ad", ad)
    rows = [(r, "ad") for r in rows_of(5, [3, 1, 1])] + [(rows_of(6, [2])[0], None)]
    with launch_records(mlf._moe_lora_fused_kernel) as recs:
        out = run.logprobs(rows)
    gate_up = [r for r in recs if not r.get("X_PER_PAIR")]
    assert gate_up and all(r.get("HAS_A_SRC") and r.get("SLICE_FIRST") for r in gate_up)
    assert all(not r.get("SLICE_FIRST") for r in recs if r.get("X_PER_PAIR"))
    plain = run.logprobs([(ids, None) for ids, _ in rows[:1]])[0]
    assert (out[0] - plain).abs().max() > 1e-2
