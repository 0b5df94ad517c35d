"""Pairs on expert id -1 on the Triton base path: such a (token, k) pair is left out of every kernel (alignment,
expert GEMMs, the per-pair and grouped LoRA kernels) and of the combine (the kernels' documented semantics;
expert parallelism itself gives another rank's pairs local expert 0 and weight 0: sharding._local_experts_hook).
Under TRITON_INTERPRET=1 on the CPU (fp32), compiled on a GPU: the kernels match their references with such pairs,
the combine never reads their rows, and two expert shards computed either way sum to the whole layer with mixed
adapters."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, expert_lora_args, in_group_order, token_slots, tolerance
from moelora.distributed import sharding
from moelora.kernels.moe import act_triton
from moelora.kernels.moe import align_triton as fmt
from moelora.kernels.moe.experts import ExpertKernels, ExpertLoRAArgs, fused_moe_pairs, fused_moe_ref, route_topk_ref
from moelora.kernels.moe_lora import backend
from moelora.kernels.moe_lora import grouped_triton as mg
from moelora.kernels.moe_lora.args import ProjLoRA, Routing
from moelora.kernels.moe_lora.backend import MoELoRAKernels
from moelora.kernels.moe_lora.chain import moe_lora_align
from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast
from moelora.kernels.moe_lora.fused_triton import moe_lora_fused, moe_lora_fused_ref

pytestmark = pytest.mark.usefixtures("one_thread")

DT = DTYPES[0]


def _dropped(ids: torch.Tensor, gen: torch.Generator, share: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """ids with about `share` of the pairs set to -1, and that mask [T, K]."""
    drop = (torch.rand(ids.shape, generator=gen) < share).to(ids.device)
    return ids.masked_fill(drop, -1), drop


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("T,E,K", [(1, 8, 4), (37, 16, 4), (133, 16, 8)])
def test_align_leaves_out_pairs_on_expert_minus_one(T, E, K, chunked, monkeypatch):
    if chunked:  # the three-launch variant of large P, at small shapes
        monkeypatch.setattr(fmt, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)
    gen = torch.Generator().manual_seed(T + E)
    _, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    ids, drop = _dropped(ids, gen)
    sorted_ids, block_expert = fmt.moe_align(ids, E, 16)
    ref_ids, ref_be = fmt.moe_align_ref(ids, E, 16)
    assert torch.equal(in_group_order(sorted_ids, block_expert, 16), ref_ids) and torch.equal(block_expert, ref_be)
    placed = sorted(p for p in sorted_ids.tolist() if p < T * K)
    assert placed == (~drop).reshape(-1).nonzero().squeeze(1).tolist()  # every kept pair once, no dropped one


def test_combine_never_reads_a_weight_zero_row():
    gen = torch.Generator().manual_seed(5)
    T, K, Hd = 6, 4, 40
    o = torch.randn(T * K, Hd, generator=gen).to(DEVICE, DT)
    w = torch.rand(T, K, generator=gen).to(DEVICE)
    w[torch.rand(T, K, generator=gen).to(DEVICE) < 0.4] = 0
    zeroed = o.clone()
    zeroed[(w == 0).reshape(-1)] = 0
    o[(w == 0).reshape(-1)] = float("nan")  # a row no GEMM wrote
    want = (zeroed.view(T, K, Hd).float() * w[:, :, None]).sum(1).to(DT)
    for got in (act_triton.moe_combine(o, w), act_triton.moe_combine_ref(o, w)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["fused", "grouped", "grouped_prefill"])
def test_lora_kernels_skip_pairs_on_expert_minus_one(variant):
    gen = torch.Generator().manual_seed(11)
    T, E, K, S, R, D, O = 13, 8, 4, 3, 8, 40, 24
    _, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    ids, drop = _dropped(ids, gen)
    lora = expert_lora_args(T, E, DT, gen, S, R, D, O // 2)  # its gate_up part: two slices of O // 2
    off = torch.tensor([0, O // 2, O], dtype=torch.int32, device=DEVICE)
    gate_up = ProjLoRA(lora.gate_up_a, lora.gate_up_b, off, lora.gate_up_ranks, lora.gate_up_scaling, O // 2)
    routing = Routing(ids, lora.token_slots, E, S)
    x = torch.randn(T, D, generator=gen).to(DEVICE, DT)
    y0 = torch.randn(T * K, O, generator=gen).to(DEVICE, DT)
    y_ref = y0.clone()
    moe_lora_fused_ref(x, gate_up, routing, y_ref, x_per_pair=False)
    y = y0.clone()
    if variant == "fused":
        moe_lora_fused(x, gate_up, routing, y, x_per_pair=False)
    elif variant == "grouped":
        mg.moe_lora_grouped(x, gate_up, routing, y, x_per_pair=False)
    else:
        mg.moe_lora_grouped(x, gate_up, routing, y, x_per_pair=False, block_m=mg.PREFILL_BLOCK_M,
                            align=mg.prefill_align(ids, lora.token_slots, E, S))
    atol, rtol = tolerance(DT)  # bf16 on a GPU: the reference rounds the delta, then the sum (the kernels once)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    gone = drop.reshape(-1)
    assert torch.equal(y[gone], y0[gone]), "a pair on expert -1 must stay untouched"
    assert not torch.equal(y[~gone], y0[~gone])  # the kept pairs did get their deltas


def test_lora_alignments_leave_out_pairs_on_expert_minus_one():
    gen = torch.Generator().manual_seed(12)
    T, E, K, S = 29, 8, 4, 3
    _, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    ids, drop = _dropped(ids, gen)
    slots = token_slots("with_base_rows", T, S, gen).to(DEVICE)
    keep = (~drop & (slots >= 0)[:, None]).reshape(-1).nonzero().squeeze(1).tolist()
    for align in (moe_lora_align, moe_lora_align_fast):
        sorted_ids, _ = align(ids, slots, E, S, 16)
        assert sorted(p for p in sorted_ids.tolist() if p < T * K) == keep, align.__name__


def _shard(args: ExpertLoRAArgs, es: slice) -> ExpertLoRAArgs:
    """The LoRA of experts `es` (what a rank holds under expert parallelism)."""
    return dataclasses.replace(args, gate_up_a=args.gate_up_a[:, :, es].contiguous(),
                               gate_up_b=args.gate_up_b[:, es].contiguous(),
                               down_a=args.down_a[:, :, es].contiguous(), down_b=args.down_b[:, es].contiguous())


@pytest.mark.parametrize("dropped", [False, True])
@pytest.mark.parametrize("lora_kernels", ["triton", "reference"])
@pytest.mark.parametrize("T,K,prefill", [(9, 4, False), (21, 4, True)])
def test_two_expert_shards_sum_to_the_whole_layer(T, K, prefill, lora_kernels, dropped, monkeypatch):
    """Each half of the experts, through the EP hook (pairs of the other half on local expert 0 with weight 0) or
    with those pairs on expert -1 (dropped), and fused_moe_pairs with the Triton base path (and the Triton or the
    reference LoRA), sums with the other half to fused_moe_ref of the whole layer (mixed adapters)."""
    if prefill:  # the prefill LoRA kernel (grouped, alignment by virtual expert) at a small P
        monkeypatch.setattr(backend, "DECODE_MAX_PAIRS", 0)
    kernels = ExpertKernels(True, MoELoRAKernels(lora_kernels == "triton"))
    gen = torch.Generator().manual_seed(T)
    E, S, R, H, inter = 16, 3, 8, 48, 24
    x = torch.randn(T, H, generator=gen).to(DEVICE, DT)
    w_gu = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(DEVICE, DT)
    w_d = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(DEVICE, DT)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=gen).to(DEVICE), K, True)
    args = expert_lora_args(T, E, DT, gen, S, R, H, inter)
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    total = torch.zeros_like(ref, dtype=torch.float32)
    for first in (0, E // 2):
        es = slice(first, first + E // 2)
        rank = SimpleNamespace(quant=None, gate_up_proj=w_gu[es].contiguous(), down_proj=w_d[es].contiguous())
        _, w_loc, ids_loc, _ = sharding._local_experts_hook(first, E // 2)(rank, (x, weights, ids, args))
        other = (ids < first) | (ids >= first + E // 2)
        assert other.any() and bool((w_loc[other] == 0).all()) and bool((ids_loc[other] == 0).all())
        if dropped:
            ids_loc = ids_loc.masked_fill(other, -1)
        total += fused_moe_pairs(x, rank.gate_up_proj, rank.down_proj, w_loc, ids_loc, "silu", _shard(args, es),
                                 kernels).float()
    rel = ((total - ref.float()).norm() / ref.float().norm()).item()
    assert rel < tolerance(DT)[0], f"relative error {rel:.2e}"


def test_hook_keeps_the_weight_zero_masking():
    """Non-local pairs go to local expert 0 with weight 0, never -1 (whatever kernels the experts run)."""
    gen = torch.Generator().manual_seed(3)
    w, ids = route_topk_ref(torch.randn(5, 8, generator=gen), 2, True)
    rank = SimpleNamespace(quant=None, gate_up_proj=torch.zeros(4, 6, 3), down_proj=torch.zeros(4, 3, 3))
    x = torch.zeros(5, 3)
    _, w_loc, ids_loc, _ = sharding._local_experts_hook(4, 4)(rank, (x, w, ids, None))
    mine = (ids >= 4)
    assert bool((ids_loc >= 0).all()) and torch.equal(ids_loc[~mine], torch.zeros_like(ids_loc[~mine]))
    assert torch.equal(w_loc[~mine], torch.zeros_like(w_loc[~mine])) and torch.equal(ids_loc[mine], ids[mine] - 4)
