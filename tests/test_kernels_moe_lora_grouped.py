"""The grouped routed-expert LoRA kernel (kernels/moe_lora/grouped_triton.py: pairs grouped by (slot, expert), A and
B read once a group) against moe_lora_fused_ref (the same semantics as the per-pair fused kernel), and fused_moe_pairs
taking it by size (backend.MoELoRAKernels.pick: from grouped_min_pairs at decode, in prefill blocks above).

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes in fp32/fp16. GPU (marked gpu): Qwen3-30B-A3B
shapes in bf16 against the per-pair kernel, and CUDA-graph replay."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, POPULARITY, tolerance
from moelora.kernels.moe import align_triton
from moelora.kernels.moe.experts import ExpertKernels, fused_moe_pairs, fused_moe_ref
from moelora.kernels.moe_lora import backend
from moelora.kernels.moe_lora import grouped_triton as mg
from moelora.kernels.moe_lora.backend import MoELoRAKernels
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref
from test_kernels_lora_fused import (E, K, _lora, _moe_call, _moe_case, _moe_layer, _routing, _untouched_checks,
                                     check_reads_a_through_a_src)

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = [1, 5, 33]


def _grouped(c, y, **kw):
    _moe_call(mg.moe_lora_grouped, c, y, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_grouped_matches_reference(site, popularity, num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 17 + len(popularity))
    c = _moe_case(site, popularity, num_tokens, dtype, gen)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _grouped(c, y)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    _untouched_checks(y, c["y0"], c["slots"], c["ranks"], c["off"], K)
    live = c["slots"][c["slots"] >= 0].long()
    if (c["ranks"][:, live] > 0).any():  # some row has an adapter with a slice of rank > 0
        assert not torch.equal(y, c["y0"])


@pytest.mark.parametrize("site", ["gate_up", "down"])
@pytest.mark.parametrize("popularity", ["with_base_rows", "identical", "distinct"])
def test_grouped_store_mode_writes_every_entry(site, popularity):
    """store=True into a NaN-filled fp32 buffer: the delta where the slot has rank > 0, exactly 0 for rows of
    tokens without an adapter (the extra zero programs) and for slices of rank 0; store then add equals add."""
    gen = torch.Generator().manual_seed(19)
    c = _moe_case(site, popularity, 9, DTYPES[0], gen)
    P, O = c["y0"].shape
    ref = torch.full((P, O), float("nan"), device=DEVICE)
    got = ref.clone()
    _moe_call(moe_lora_fused_ref, c, ref, store=True)
    _grouped(c, got, store=True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-4 if DTYPES[0] == torch.float32 else 2e-2, rtol=1e-3)
    base = (c["slots"] < 0).repeat_interleave(K)
    assert torch.equal(got[base], torch.zeros_like(got[base]))
    y_add = c["y0"].clone()
    _grouped(c, y_add)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close((c["y0"].float() + got).to(y_add.dtype), y_add, atol=atol, rtol=rtol)


@pytest.mark.parametrize("R", [16, 24])
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_grouped_never_uses_factors_past_each_rank(site, R):
    """A and B past each (slice, slot)'s rank hold NaN: the result equals the zero-padded one, bit for bit, in add
    and store mode (R 16: B read in whole rank rows, the entries past the rank zeroed after the load; R 24, a rank
    tile of 32: masked in the load)."""
    gen = torch.Generator().manual_seed(80 + R)
    c = _moe_case(site, "with_base_rows", 5, DTYPES[0], gen, R=R)
    a_nan, b_nan = c["a"].clone(), c["b"].clone()
    off = c["off"].tolist()
    for i in range(a_nan.shape[0]):
        for s in range(c["ranks"].shape[1]):
            r = int(c["ranks"][i, s])
            a_nan[i, s, :, r:] = float("nan")
            b_nan[s, :, off[i]:off[i + 1], r:] = float("nan")
    for store in (False, True):
        outs = []
        for a, b in [(c["a"], c["b"]), (a_nan, b_nan)]:
            y = c["y0"].clone() if not store else torch.full(c["y0"].shape, float("nan"), device=DEVICE)
            _grouped({**c, "a": a, "b": b}, y, store=store)
            assert not y.isnan().any(), (site, R, store)
            outs.append(y)
        assert torch.equal(outs[1], outs[0]), (site, R, store)


def test_grouped_leaves_expert_minus_one_pairs_untouched():
    """Expert parallelism: pairs on expert -1 are in no group and no zero program, in add and store mode."""
    gen = torch.Generator().manual_seed(37)
    c = _moe_case("down", "with_base_rows", 11, DTYPES[0], gen)
    drop = torch.rand(c["ids"].shape, generator=gen).to(DEVICE) < 0.4
    c["ids"] = c["ids"].masked_fill(drop, -1)
    rows = drop.reshape(-1)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused, c, y_ref)
    _grouped(c, y)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    assert torch.equal(y[rows], c["y0"][rows])
    d = torch.full(c["y0"].shape, float("nan"), device=DEVICE)
    _grouped(c, d, store=True)
    assert d[rows].isnan().all() and not d[~rows].isnan().any()


@pytest.mark.parametrize("store", [False, True])
def test_grouped_reads_a_from_the_slice_a_src_names(store):
    check_reads_a_through_a_src(mg.moe_lora_grouped, store)


@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_grouped_shared_outer_factors(site):
    gen = torch.Generator().manual_seed(43)
    c = _moe_case(site, "with_base_rows", 9, DTYPES[0], gen, shared=True)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _grouped(c, y)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("R", [32, 64])
def test_grouped_larger_ranks(R):
    gen = torch.Generator().manual_seed(47 + R)
    for site in ("gate_up", "down"):
        c = _moe_case(site, "skewed", 7, DTYPES[0], gen, R=R)
        y_ref, y = c["y0"].clone(), c["y0"].clone()
        _moe_call(moe_lora_fused_ref, c, y_ref)
        _grouped(c, y)
        atol, rtol = tolerance(DTYPES[0])
        torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


def test_grouped_launch_parameters_do_not_change_results():
    """Input/output tiles, warps, stages and output splits only change the schedule (fp32: equal to 1e-5);
    the alignment passed in equals the one made inside."""
    gen = torch.Generator().manual_seed(53)
    c = _moe_case("gate_up", "uniform", 13, torch.float32, gen)
    y0 = c["y0"].clone()
    _grouped(c, y0)
    align = mg.grouped_align(c["ids"], c["slots"], E, c["a"].shape[1])
    for cfg, split in [(mg.GroupedConfig(16, 16, 4, 2), 1), (mg.GroupedConfig(32, 64, 8, 3), 2),
                       (mg.GroupedConfig(64, 16, 4, 4), 64)]:
        y = c["y0"].clone()
        _grouped(c, y, align=align, config=cfg, split_n=split)
        torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)


def test_grouped_refuses_groups_past_the_alignment(monkeypatch):
    c = _moe_case("down", "uniform", 9, DTYPES[0], torch.Generator().manual_seed(3))
    monkeypatch.setattr(align_triton, "LORA_ALIGN_MAX_GROUPS", E * c["a"].shape[1])
    assert not mg.grouped_ok(9 * K, E, c["a"].shape[1])
    with pytest.raises(ValueError, match="past the decode alignment"):
        _grouped(c, c["y0"].clone())


def test_grouped_on_the_chunked_alignment_equals_the_one_program_one(monkeypatch):
    """Above ALIGN_ONE_PROGRAM_MAX_PAIRS the alignment is three launches over chunks of pairs: the same groups,
    order and padding, so the same outputs."""
    c = _moe_case("gate_up", "uniform", 13, torch.float32, torch.Generator().manual_seed(5))
    y0 = c["y0"].clone()
    _grouped(c, y0)
    one = mg.grouped_align(c["ids"], c["slots"], E, c["a"].shape[1])
    monkeypatch.setattr(align_triton, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)
    chunked = mg.grouped_align(c["ids"], c["slots"], E, c["a"].shape[1])
    assert all(torch.equal(a, b) for a, b in zip(one, chunked))
    y = c["y0"].clone()
    _grouped(c, y)
    torch.testing.assert_close(y, y0, atol=0, rtol=0)


def _triton(grouped_min_pairs: int = 2048) -> ExpertKernels:
    return ExpertKernels(True, MoELoRAKernels(True, grouped_min_pairs))


def _counting(monkeypatch, names) -> dict:
    """backend's functions `names` replaced by ones that count their calls, then run them."""
    calls = {n: 0 for n in names}
    for n in names:
        real = getattr(backend, n)
        monkeypatch.setattr(backend, n, lambda *a, _n=n, _f=real, **kw: (calls.__setitem__(_n, calls[_n] + 1),
                                                                           _f(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("popularity", ["with_base_rows", "skewed"])
def test_fused_moe_pairs_grouped_equals_per_pair(popularity, monkeypatch):
    """From grouped_min_pairs the grouped kernel (one alignment for gate_up and down) gives the per-pair result;
    below it, or above GROUPED_MAX_GROUPS (slot, expert) groups, the per-pair kernel."""
    calls = _counting(monkeypatch, ["grouped_align", "moe_lora_grouped"])
    gen = torch.Generator().manual_seed(59)
    dtype = DTYPES[0]
    x, w_gu, w_d, weights, ids, args = _moe_layer(11, dtype, gen, popularity)
    per_pair = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton())
    fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton(ids.numel() + 1))  # below the threshold
    assert calls == {"grouped_align": 0, "moe_lora_grouped": 0}
    monkeypatch.setattr(backend, "GROUPED_MAX_GROUPS", E * args.gate_up_a.shape[1] - 1)  # more groups than measured
    fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton(ids.numel()))
    assert calls == {"grouped_align": 0, "moe_lora_grouped": 0}
    monkeypatch.setattr(backend, "GROUPED_MAX_GROUPS", E * args.gate_up_a.shape[1])
    grouped = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton(ids.numel()))
    assert calls == {"grouped_align": 1, "moe_lora_grouped": 2}
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    rel = ((grouped.float() - per_pair.float()).norm() / per_pair.float().norm()).item()
    assert rel < bound, f"relative error {rel:.2e} >= {bound}"


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("site", ["gate_up", "down"])
@pytest.mark.parametrize("num_tokens,popularity", [(40, "with_base_rows"), (300, "identical")])
def test_grouped_in_prefill_blocks_matches_reference(site, popularity, num_tokens, store):
    """The prefill launch: moe_lora_grouped in blocks of PREFILL_BLOCK_M pairs on prefill_align's grouping (300
    tokens of one adapter: groups of more pairs than a block) against moe_lora_fused_ref, add and store mode (store
    into NaN: every entry written, rows without an adapter 0)."""
    gen = torch.Generator().manual_seed(num_tokens + 3)
    dtype = DTYPES[0]
    c = _moe_case(site, popularity, num_tokens, dtype, gen)
    align = mg.prefill_align(c["ids"], c["slots"], E, c["ranks"].shape[1])
    assert align[0].shape[0] == align[1].shape[0] * mg.PREFILL_BLOCK_M
    if popularity == "identical":  # a group holds more pairs than one block
        assert (align[1][1:] == align[1][:-1]).any()
    y0 = torch.full_like(c["y0"], float("nan")) if store else c["y0"]
    y_ref, y = y0.clone(), y0.clone()
    _moe_call(moe_lora_fused_ref, c, y_ref, store=store)
    _grouped(c, y, store=store, align=align, block_m=mg.PREFILL_BLOCK_M)
    assert not y.isnan().any()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    if store:
        base = (c["slots"] < 0).repeat_interleave(K)
        assert torch.equal(y[base], torch.zeros_like(y[base]))
    else:
        _untouched_checks(y, c["y0"], c["slots"], c["ranks"], c["off"], K)
    assert not torch.equal(y_ref, y0)


def test_fused_moe_pairs_grouped_prefill(monkeypatch):
    """Above DECODE_MAX_PAIRS pairs (a prefill chunk; lowered here to the test's batch) the routed-expert LoRA is the
    grouped kernel in prefill blocks, one alignment for gate_up and down, with the per-pair kernel's result (plain
    weights: no FP8 epilogue; test_prefill_lora_epilogue.py has that one)."""
    gen = torch.Generator().manual_seed(61)
    dtype = DTYPES[0]
    x, w_gu, w_d, weights, ids, args = _moe_layer(40, dtype, gen, "with_base_rows")
    per_pair = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton())
    calls = _counting(monkeypatch, ["prefill_align", "grouped_align", "moe_lora_grouped", "moe_lora_fused"])
    monkeypatch.setattr(backend, "DECODE_MAX_PAIRS", ids.numel() - 1)  # this batch counts as a prefill chunk
    grouped = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, _triton())
    assert calls == {"prefill_align": 1, "grouped_align": 0, "moe_lora_grouped": 2, "moe_lora_fused": 0}
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    rel = ((grouped.float() - per_pair.float()).norm() / per_pair.float().norm()).item()
    assert rel < bound, f"relative error {rel:.2e} >= {bound}"
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    assert ((grouped.float() - ref.float()).norm() / ref.float().norm()).item() < bound


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [32, 64, 256])
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_gpu_grouped_equals_per_pair_at_qwen3_shapes(site, num_tokens):
    """bf16, E=128, top-8, H=2048, I=768: the grouped kernel against the per-pair kernel (both fp32 h) and the
    reference; store mode; graph replay bit-equal to eager."""
    gen = torch.Generator().manual_seed(num_tokens + 7)
    c = _moe_case(site, "with_base_rows", num_tokens, torch.bfloat16, gen)
    y_pp, y_ref, y = c["y0"].clone(), c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused, c, y_pp)
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _grouped(c, y)
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    d_pp, d_g = (y_pp.float() - c["y0"].float()), (y.float() - c["y0"].float())
    assert ((d_g - d_pp).norm() / d_pp.norm()).item() < 2 ** -8
    store = torch.full(c["y0"].shape, float("nan"), device=DEVICE)
    _grouped(c, store, store=True)
    assert not store.isnan().any()
    align = mg.grouped_align(c["ids"], c["slots"], E, c["a"].shape[1])
    eager = c["y0"].clone()
    _grouped(c, eager, align=align)
    replay = c["y0"].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _grouped(c, replay, align=mg.grouped_align(c["ids"], c["slots"], E, c["a"].shape[1]))  # alignment captured too
    replay.copy_(c["y0"])
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay, eager)


@pytest.mark.parametrize("fuse_slices", [False, True])
@pytest.mark.parametrize("site", ["gate_up", "down"])
@pytest.mark.parametrize("num_tokens,popularity", [(40, "with_base_rows"), (300, "identical")])
def test_grouped_shrink_writes_each_pairs_h(site, popularity, num_tokens, fuse_slices):
    """moe_lora_grouped_shrink (the shrink for the FP8 expert GEMM's LoRA epilogue at prefill): h[i, p] = x row of
    pair p @ A[i, slot, expert].T unscaled, zero past the slot's rank, for pairs of tokens with an adapter; rows of
    slot -1 left as they were (NaN here); in prefill blocks, one program a slice or all slices in one."""
    gen = torch.Generator().manual_seed(num_tokens + 11)
    dtype = DTYPES[0]
    c = _moe_case(site, popularity, num_tokens, dtype, gen)
    a, ids, slots = c["a"], c["ids"], c["slots"]
    n, S, _, R, _ = a.shape
    P = ids.numel()
    align = mg.prefill_align(ids, slots, E, S)
    h = torch.full((n, P, R), float("nan"), device=DEVICE)
    mg.moe_lora_grouped_shrink(c["x"], _lora(c), _routing(c), h, x_per_pair=c["per_pair"], align=align,
                               fuse_slices=fuse_slices)
    rows = torch.arange(P, device=DEVICE) if c["per_pair"] else torch.arange(P, device=DEVICE) // K
    pslot = slots.long()[torch.arange(P, device=DEVICE) // K]
    ex = ids.reshape(-1).long()
    live = pslot >= 0
    want = torch.einsum("pd,iprd->ipr", c["x"][rows[live]].float(),
                        a[:, pslot[live], ex[live] if a.shape[2] > 1 else 0].float())
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(h[:, live], want, atol=atol, rtol=rtol)
    assert h[:, ~live].isnan().all()
    for i in range(n):  # past each slot's rank: exactly 0
        for s in range(S):
            rs = int(c["ranks"][i, s])
            assert torch.equal(h[i][pslot == s][:, rs:], torch.zeros_like(h[i][pslot == s][:, rs:]))
    with pytest.raises(ValueError, match=r"h must be a \["):
        mg.moe_lora_grouped_shrink(c["x"], _lora(c), _routing(c), h[:, :, :R - 1], x_per_pair=c["per_pair"],
                                   align=align)
