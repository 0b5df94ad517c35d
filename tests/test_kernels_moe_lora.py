"""Routed-expert multi-LoRA Triton kernels (decode GEMV and prefill tiled variants) vs the references."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, NUM_TOKENS, ON_GPU, POPULARITY, token_slots, tolerance
from moelora.kernels.moe_lora.chain import moe_lora_align, moe_lora_expand_ref, moe_lora_shrink_ref
from moelora.kernels.moe_lora.chain_triton import moe_lora_expand, moe_lora_shrink

S, R = 4, 16
E, K, H, I = (128, 8, 2048, 768) if ON_GPU else (8, 2, 48, 24)


def _routing(T, gen, mode="random"):
    if mode == "one_expert":  # all tokens to expert 3 (and its neighbour for k > 0)
        ids = (torch.arange(K)[None, :] + 3).expand(T, K) % E
    elif mode == "few_experts":  # most experts empty: every token routes among the first K + 2
        ids = torch.stack([torch.randperm(K + 2, generator=gen)[:K] for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids.to(DEVICE)


def _factors(n, D, O_slices, dtype, gen, shared_a=False, shared_b=False):
    ranks = torch.tensor([[16, 4, 0, 8], [8, 16, 4, 2]][:n], dtype=torch.int32)
    a = torch.randn(n, S, 1 if shared_a else E, R, D, generator=gen) * 0.1
    b = torch.randn(S, 1 if shared_b else E, sum(O_slices), R, generator=gen) * 0.1
    off = [0]
    for o in O_slices:
        off.append(off[-1] + o)
    for i in range(n):
        for s in range(S):
            a[i, s, :, ranks[i, s]:] = 0
            b[s, :, off[i]:off[i + 1], ranks[i, s]:] = 0
    scaling = torch.rand(n, S, generator=gen) + 0.5
    return (a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks.to(DEVICE), scaling.to(DEVICE),
            torch.tensor(off, dtype=torch.int32, device=DEVICE))


def _run(site, popularity, T, dtype, variant, routing="random", shared=False, seed=0):
    gen = torch.Generator().manual_seed(seed + T)
    slots = token_slots(popularity, T, S, gen).to(DEVICE)
    ids = _routing(T, gen, routing)
    if site == "gate_up":  # input per token, two slices (gate, up) with their own A
        n, D, outs, x = 2, H, [I, I], torch.randn(T, H, generator=gen)
        per_pair, w = False, None
    else:  # down: input per pair, one slice, router weight applied
        n, D, outs, x = 1, I, [H], torch.randn(T * K, I, generator=gen)
        per_pair, w = True, torch.rand(T * K, generator=gen).to(DEVICE)
    a, b, ranks, scaling, off = _factors(n, D, outs, dtype, gen, shared_a=shared and site == "gate_up",
                                         shared_b=shared and site == "down")
    x = x.to(DEVICE, dtype)
    h_ref = torch.zeros(T * K, n, R, device=DEVICE)
    h = torch.zeros(T * K, n, R, device=DEVICE)
    moe_lora_shrink_ref(x, a, ranks, ids, slots, E, h_ref, per_pair)
    moe_lora_shrink(x, a, ranks, ids, slots, E, h, per_pair, variant=variant)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
    y0 = torch.randn(T * K, sum(outs), generator=gen).to(DEVICE, dtype)
    y_ref, y = y0.clone(), y0.clone()
    moe_lora_expand_ref(h_ref, b, off, ranks, scaling, ids, slots, E, y_ref, w)
    moe_lora_expand(h_ref, b, off, ranks, scaling, ids, slots, E, y, w, variant=variant)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    base_pairs = (slots < 0).repeat_interleave(K)
    assert torch.equal(y[base_pairs], y0[base_pairs]), "pairs of tokens without an adapter must stay untouched"
    return y, y0


@pytest.mark.parametrize("variant", ["gemv", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_moe_lora_matches_reference(site, popularity, num_tokens, dtype, variant):
    if variant == "gemv" and not ON_GPU:
        # the decode variant is for small batches; under the (slow) interpreter, cap its size
        num_tokens = min(num_tokens, 64)
    _run(site, popularity, num_tokens, dtype, variant)


@pytest.mark.parametrize("routing", ["one_expert", "few_experts"])
@pytest.mark.parametrize("variant", ["gemv", "tiled", "auto"])
def test_moe_lora_routing_edge_cases(routing, variant):
    for site in ("gate_up", "down"):
        _run(site, "uniform", 33, DTYPES[0], variant, routing=routing)


@pytest.mark.parametrize("variant", ["gemv", "tiled"])
def test_shared_outer_matches_expanded_factors(variant):
    """gate_up A and down B with an expert dim of 1: the same result as those factors copied to every expert."""
    gen = torch.Generator().manual_seed(11)
    T = 9
    dtype = DTYPES[0]
    slots = token_slots("with_base_rows", T, S, gen).to(DEVICE)
    ids = _routing(T, gen)
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    a, _, ranks, _, _ = _factors(2, H, [I, I], dtype, gen, shared_a=True)
    h_shared = torch.zeros(T * K, 2, R, device=DEVICE)
    h_full = torch.zeros(T * K, 2, R, device=DEVICE)
    moe_lora_shrink(x, a, ranks, ids, slots, E, h_shared, False, variant=variant)
    moe_lora_shrink(x, a.expand(-1, -1, E, -1, -1).contiguous(), ranks, ids, slots, E, h_full, False, variant=variant)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(h_shared, h_full, atol=atol, rtol=rtol)
    _, b, ranks_d, scaling, off = _factors(1, I, [H], dtype, gen, shared_b=True)
    hd = torch.randn(T * K, 1, R, generator=gen).to(DEVICE)
    y1 = torch.zeros(T * K, H, device=DEVICE, dtype=dtype)
    y2 = y1.clone()
    moe_lora_expand(hd, b, off, ranks_d, scaling, ids, slots, E, y1, variant=variant)
    moe_lora_expand(hd, b.expand(-1, E, -1, -1).contiguous(), off, ranks_d, scaling, ids, slots, E, y2, variant=variant)
    torch.testing.assert_close(y1, y2, atol=atol, rtol=rtol)
    assert y1.abs().max() > 0


def test_align_groups_pairs_by_virtual_expert():
    gen = torch.Generator().manual_seed(5)
    T, bm = 37, 16
    slots = token_slots("with_base_rows", T, S, gen).to(DEVICE)
    ids = _routing(T, gen)
    sorted_ids, bvex = moe_lora_align(ids, slots, E, S, bm)
    P = T * K
    got = sorted_ids[sorted_ids < P].tolist()
    expected = [p for p in range(P) if slots[p // K] >= 0]
    assert sorted(got) == expected  # every LoRA pair exactly once, base pairs never
    pair_v = (slots.long().repeat_interleave(K) * E + ids.reshape(-1)).tolist()
    for blk, v in enumerate(bvex.tolist()):
        entries = [p for p in sorted_ids[blk * bm:(blk + 1) * bm].tolist() if p < P]
        if v < 0:
            assert not entries
        else:
            assert entries and all(pair_v[p] == v for p in entries)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_pair_pipeline_equals_fused_moe_reference(kernels):
    """The GPU path's pipeline (per-pair base + LoRA kernels + weighted top-k sum) computes fused_moe_ref."""
    from moelora.kernels.moe.experts import ExpertLoRAArgs, fused_moe_pairs, fused_moe_ref, route_topk_ref
    from moelora.kernels.moe_lora.chain import moe_lora_expand_ref, moe_lora_shrink_ref

    gen = torch.Generator().manual_seed(21)
    T, dtype = 11, DTYPES[0]
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEVICE, dtype)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    a_gu, b_gu, r_gu, s_gu, _ = _factors(2, H, [I, I], dtype, gen)
    a_d, b_d, r_d, s_d, _ = _factors(1, I, [H], dtype, gen)
    slots = token_slots("with_base_rows", T, S, gen).to(DEVICE)
    args = ExpertLoRAArgs(slots, a_gu, b_gu, s_gu, r_gu, a_d, b_d, s_d, r_d)
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    ops = (moe_lora_shrink_ref, moe_lora_expand_ref) if kernels == "reference" else (moe_lora_shrink, moe_lora_expand)
    got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
    # the two orders round their 16-bit intermediates differently (per-expert vs per-pair GEMMs), so compare
    # by relative error norm, with bounds per dtype (fp32 ~1e-7 per op; bf16 8 mantissa bits)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < bound, f"relative error {rel:.2e} >= {bound}"
    no_lora = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", None)
    assert ((no_lora.float() - ref.float()).norm() / ref.float().norm()).item() > 10 * bound


def test_fast_align_matches_reference_groups():
    """The sort-free alignment (atomic placement) gives the reference's groups, padding and block map."""
    from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast

    gen = torch.Generator().manual_seed(9)
    for T in (1, 7, 133):
        slots = token_slots("with_base_rows", T, S, gen).to(DEVICE)
        ids = _routing(T, gen)
        ref_ids, ref_bv = moe_lora_align(ids, slots, E, S, 16)
        got_ids, got_bv = moe_lora_align_fast(ids, slots, E, S, 16)
        assert torch.equal(ref_bv, got_bv)

        def groups(sorted_ids, bv):  # virtual expert -> its pairs (order inside a group may differ)
            out = {}
            for blk, v in enumerate(bv.tolist()):
                out.setdefault(v, []).extend(sorted_ids[blk * 16:(blk + 1) * 16].tolist())
            return {v: sorted(p for p in ps if p < T * K) for v, ps in out.items()}

        assert groups(ref_ids, ref_bv) == groups(got_ids, got_bv)
