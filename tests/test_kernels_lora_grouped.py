"""Grouped decode LoRA kernel for routed experts (moe_lora_grouped_triton.py): pairs grouped by (slot, expert),
the same semantics as moe_lora_fused; its one-launch alignment equals moe_lora_align; fused_moe_pairs takes it
from GROUPED_MIN_PAIRS pairs.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes in fp32/fp16. GPU (marked gpu): Qwen3-30B-A3B
shapes in bf16."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, POPULARITY, tolerance
from moelora.kernels import moe_lora_grouped_triton as mg
from moelora.kernels._triton import grouped_lora, set_grouped_lora
from moelora.kernels.fused_moe_triton import moe_lora_align_one_program
from moelora.kernels.moe_lora import moe_lora_align
from moelora.kernels.moe_lora_fused_triton import moe_lora_fused_ref
from test_kernels_lora_fused import E, K, _moe_call, _moe_case, _untouched_checks

pytestmark = pytest.mark.usefixtures("one_thread")
# CPU: 100 tokens put 25+ pairs on a group when all tokens share a slot (several blocks of 16 per group)
TOKENS = [64, 256] if ON_GPU else [1, 7, 33, 100]


@pytest.mark.parametrize("ep_dropped", [False, True])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,Kk,Ee,Ss", [(1, 2, 8, 2), (7, 4, 16, 3), (64, 8, 16, 4), (30, 8, 128, 8), (256, 8, 128, 4)])
def test_one_program_lora_alignment_is_moe_lora_align(T, Kk, Ee, Ss, block_m, ep_dropped):
    gen = torch.Generator().manual_seed(T + Ee)
    ids = torch.stack([torch.randperm(Ee, generator=gen)[:Kk] for _ in range(T)])
    if ep_dropped:  # expert parallelism leaving out another rank's pairs: expert -1
        ids[torch.rand(T, Kk, generator=gen) < 0.4] = -1
    slots = torch.randint(-1, Ss, (T,), generator=gen).to(torch.int32)
    got = moe_lora_align_one_program(ids.to(DEVICE), slots.to(DEVICE), Ee, Ss, block_m)
    want = moe_lora_align(ids, slots, Ee, Ss, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_one_program_lora_alignment_refuses_what_it_cannot_hold():
    ids = torch.zeros(300, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="2400 pairs over 512 virtual experts"):
        moe_lora_align_one_program(ids, torch.zeros(300, dtype=torch.int32, device=DEVICE), 128, 4, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_grouped_matches_reference(site, popularity, num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 7 + len(popularity))
    c = _moe_case(site, popularity, num_tokens, dtype, gen)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _moe_call(mg.moe_lora_grouped, c, y)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    _untouched_checks(y, c["y0"], c["slots"], c["ranks"], c["off"], K)
    if not torch.equal(y_ref, c["y0"]):  # some pair has a delta (a lone token's slice may have rank 0)
        assert not torch.equal(y, c["y0"])


@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_grouped_store_mode_and_shared_factors(site):
    """store=True into a NaN buffer: the delta, exactly 0 where there is none; shared-outer factors (expert dim 1)
    give the same as those factors copied to every expert."""
    gen = torch.Generator().manual_seed(41)
    c = _moe_case(site, "with_base_rows", 33, DTYPES[0], gen, shared=True)
    P, O = c["y0"].shape
    ref = torch.full((P, O), float("nan"), device=DEVICE)
    got = ref.clone()
    _moe_call(moe_lora_fused_ref, c, ref, store=True)
    _moe_call(mg.moe_lora_grouped, c, got, store=True)
    assert not got.isnan().any()
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    base = (c["slots"] < 0).repeat_interleave(K)
    assert torch.equal(got[base], torch.zeros_like(got[base]))
    full = dict(c, a=c["a"].expand(-1, -1, E, -1, -1).contiguous(), b=c["b"].expand(-1, E, -1, -1).contiguous())
    y_full, y_shared = c["y0"].clone(), c["y0"].clone()
    _moe_call(mg.moe_lora_grouped, full, y_full)
    _moe_call(mg.moe_lora_grouped, c, y_shared)
    torch.testing.assert_close(y_shared, y_full, atol=atol, rtol=rtol)


def test_grouped_launch_overrides_do_not_change_results():
    """split_n only spreads output tiles over programs (the same bits in fp32); block_d / num_warps / num_stages
    change the tiling of the input dim (the same values to fp32 rounding)."""
    gen = torch.Generator().manual_seed(53)
    c = _moe_case("gate_up", "uniform", 33, torch.float32, gen)
    base = c["y0"].clone()
    _moe_call(mg.moe_lora_grouped, c, base, split_n=1)
    for split in (2, 3, 64):
        y = c["y0"].clone()
        _moe_call(mg.moe_lora_grouped, c, y, split_n=split)
        assert torch.equal(y, base)
    for kw in (dict(block_d=16), dict(block_d=512, num_warps=8), dict(num_stages=2)):
        y = c["y0"].clone()
        _moe_call(mg.moe_lora_grouped, c, y, **kw)
        torch.testing.assert_close(y, base, atol=1e-5, rtol=1e-5)


def test_grouped_leaves_out_pairs_on_expert_minus_one():
    """Expert parallelism leaving out pairs (expert -1): their rows stay untouched; the others as the reference."""
    gen = torch.Generator().manual_seed(43)
    c = _moe_case("down", "uniform", 33, DTYPES[0], gen)
    ids = c["ids"].clone()
    ids[::3, 0] = -1
    c = dict(c, ids=ids)
    y_ref, y = c["y0"].clone(), c["y0"].clone()
    _moe_call(moe_lora_fused_ref, c, y_ref)
    _moe_call(mg.moe_lora_grouped, c, y)
    atol, rtol = tolerance(DTYPES[0])
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    dropped = (ids.reshape(-1) < 0)
    assert torch.equal(y[dropped], c["y0"][dropped])


@pytest.fixture
def grouped_switch():
    before = grouped_lora()
    yield set_grouped_lora
    set_grouped_lora(before)


def test_fused_moe_pairs_takes_the_grouped_kernel_from_its_threshold(grouped_switch, monkeypatch):
    """fused_moe_pairs with the Triton kernels: at >= GROUPED_MIN_PAIRS pairs the grouped op runs (and gives the
    per-pair fused numbers); below, or with the switch off, it does not."""
    from test_kernels_lora_fused import _moe_layer

    from moelora.kernels._triton import fused_lora, set_fused_lora
    from moelora.kernels.moe import fused_moe_pairs
    from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink

    calls = {"n": 0}
    real = mg.moe_lora_grouped

    def counting(*a, **kw):
        calls["n"] += 1
        real(*a, **kw)

    monkeypatch.setattr(mg, "moe_lora_grouped", counting)
    fused_before = fused_lora()
    set_fused_lora(True)
    try:
        gen = torch.Generator().manual_seed(47)
        x, w_gu, w_d, weights, ids, args = _moe_layer(20, DTYPES[0], gen)  # 40 pairs on the CPU shapes
        ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan)
        grouped_switch(False)
        per_pair = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        assert calls["n"] == 0
        grouped_switch(True)
        fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        assert calls["n"] == (2 if ids.numel() >= mg.GROUPED_MIN_PAIRS else 0)
        monkeypatch.setattr(mg, "GROUPED_MIN_PAIRS", ids.numel())
        grouped = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        assert calls["n"] == 2 + (2 if ids.numel() >= 256 else 0)
        bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[DTYPES[0]]
        rel = ((grouped.float() - per_pair.float()).norm() / per_pair.float().norm()).item()
        assert rel < bound, f"relative error {rel:.2e} >= {bound}"
    finally:
        set_fused_lora(fused_before)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("num_tokens", [32, 64, 256])
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_gpu_grouped_qwen3_shapes(site, num_tokens, R):
    gen = torch.Generator().manual_seed(num_tokens + R + 1)
    for popularity in ("uniform", "with_base_rows"):
        c = _moe_case(site, popularity, num_tokens, torch.bfloat16, gen, R=R)
        y_ref, y = c["y0"].clone(), c["y0"].clone()
        _moe_call(moe_lora_fused_ref, c, y_ref)
        _moe_call(mg.moe_lora_grouped, c, y)
        torch.testing.assert_close(y, y_ref, atol=3e-2, rtol=3e-2)
        d_ref = torch.empty(y.shape, dtype=torch.float32, device=DEVICE)
        d = torch.empty_like(d_ref)
        _moe_call(moe_lora_fused_ref, c, d_ref, store=True)
        _moe_call(mg.moe_lora_grouped, c, d, store=True)
        torch.testing.assert_close(d, d_ref, atol=3e-2, rtol=3e-2)
