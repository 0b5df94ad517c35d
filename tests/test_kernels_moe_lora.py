"""Routed-expert multi-LoRA: the alignment of pairs by virtual expert (the reference and the GPU's sort-free one),
and the pair pipeline (fused_moe_pairs) with either LoRA family against fused_moe_ref. (The per-pair and grouped
kernels: test_kernels_lora_fused.py, test_kernels_moe_lora_grouped.py.)"""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, token_slots, tolerance
from moelora.kernels.moe_lora import grouped_triton as mg
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.chain import moe_lora_align
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref

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


@pytest.mark.parametrize("routing", ["one_expert", "few_experts"])
@pytest.mark.parametrize("kernel", ["fused", "grouped", "grouped_prefill"])
def test_moe_lora_routing_edge_cases(routing, kernel):
    """Hot experts (every token on the same K experts) and empty ones: each kernel equals the reference, and pairs of
    tokens without an adapter stay untouched."""
    gen = torch.Generator().manual_seed(33)
    T, dtype = 33, DTYPES[0]
    slots = token_slots("uniform", T, S, gen).to(DEVICE)
    slots[::5] = -1
    ids = _routing(T, gen, routing)
    for site in ("gate_up", "down"):
        n, D, outs, per_pair = (2, H, [I, I], False) if site == "gate_up" else (1, I, [H], True)
        x = torch.randn(T * K if per_pair else T, D, generator=gen).to(DEVICE, dtype)
        a, b, ranks, scaling, off = _factors(n, D, outs, dtype, gen)
        lora, r = ProjLoRA(a, b, off, ranks, scaling, outs[0]), Routing(ids, slots, E, S)
        y0 = torch.randn(T * K, sum(outs), generator=gen).to(DEVICE, dtype)
        y_ref, y = y0.clone(), y0.clone()
        moe_lora_fused_ref(x, lora, r, y_ref, x_per_pair=per_pair)
        if kernel == "fused":
            moe_lora_fused(x, lora, r, y, x_per_pair=per_pair)
        elif kernel == "grouped":
            mg.moe_lora_grouped(x, lora, r, y, x_per_pair=per_pair)
        else:
            mg.moe_lora_grouped(x, lora, r, y, x_per_pair=per_pair, align=mg.prefill_align(ids, slots, E, S),
                                block_m=mg.PREFILL_BLOCK_M)
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
        base_pairs = (slots < 0).repeat_interleave(K)
        assert torch.equal(y[base_pairs], y0[base_pairs]), "pairs of tokens without an adapter must stay untouched"
        assert not torch.equal(y, y0)


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
    from moelora.kernels.moe.experts import ExpertKernels, ExpertLoRAArgs, fused_moe_pairs, fused_moe_ref, route_topk_ref
    from moelora.kernels.moe_lora.backend import MoELoRAKernels

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
    got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args,
                          ExpertKernels(lora=MoELoRAKernels(kernels == "triton")))  # torch's base GEMMs
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
