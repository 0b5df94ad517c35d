"""Routed-expert LoRA with its expand in the FP8 expert GEMM's epilogue (set_fp8_moe_lora_epilogue, off by default):
the shrink-only kernel (moe_lora_shrink_pairs) against its reference, fp8_expert_gemm's epilogue against the GEMM
plus moe_lora_expand_ref's delta, and fused_moe_pairs with the switch against the default path.

CPU: the Triton kernels under TRITON_INTERPRET=1 in fp32/fp16 at small shapes. GPU (marked gpu): Qwen3-30B-A3B
shapes in bf16, eager and graph replay."""

import dataclasses

import pytest
import torch

from kernel_cases import DEVICE, ON_GPU, expert_lora_args, qwen3_fp8_experts_with_lora  # (sets TRITON_INTERPRET=1 without CUDA)
from moelora.kernels import fused_moe_triton as fmt
from moelora.kernels.fp8 import quantize_weight_block
from moelora.kernels.fp8_triton import (
    Fp8LoRAEpilogue, fp8_expert_gemm, fp8_moe_lora_epilogue, set_fp8_moe_lora_epilogue,
)
from moelora.kernels.moe import fused_moe_pairs, route_topk_ref
from moelora.kernels.moe_lora import moe_lora_expand_ref
from moelora.kernels.moe_lora_fused_triton import moe_lora_shrink_pairs, moe_lora_shrink_pairs_ref, shrink_pairs_buffer

pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs_with_lora(slots, ranks, ids, K):
    """[P, n] bool: pairs whose token has an adapter whose slice i has rank > 0, on a local expert."""
    ps = slots.long().repeat_interleave(K)
    live = (ps >= 0) & (ids.reshape(-1) >= 0)
    r = ranks[:, ps.clamp(min=0)].T  # [P, n]
    return live[:, None] & (r > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("site", ["gate_up", "down"])
def test_shrink_pairs_matches_reference(site, dtype):
    """h[p, i, :] = row @ A[i, s, e].T for pairs with an adapter slice of rank > 0 (zeros past the rank); rows of
    tokens without an adapter and pairs on expert -1 are left untouched (NaN here)."""
    gen = torch.Generator().manual_seed(3 if site == "gate_up" else 4)
    T, E, K = 9, 6, 2
    args = expert_lora_args(T, E, dtype, gen, hidden=40, inter=24)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEVICE)
    ids[1, 0] = -1  # another rank's expert
    if site == "gate_up":
        a, ranks, x, per_pair = args.gate_up_a, args.gate_up_ranks, torch.randn(T, 40, generator=gen), False
    else:
        a, ranks, x, per_pair = args.down_a, args.down_ranks, torch.randn(T * K, 24, generator=gen), True
    x = x.to(DEVICE, dtype)
    n = a.shape[0]
    got = torch.full((T * K, n, 16), float("nan"), device=DEVICE)
    ref = torch.empty_like(got)
    moe_lora_shrink_pairs(x, a, ranks, ids, args.token_slots, got, per_pair)
    moe_lora_shrink_pairs_ref(x, a, ranks, ids, args.token_slots, ref, per_pair)
    live = _pairs_with_lora(args.token_slots, ranks, ids, K)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[live], ref[live], atol=tol, rtol=tol)
    assert got[~live].isnan().all()  # never written: the epilogue masks them by slot and rank
    assert ref[live].abs().sum() > 0
    with pytest.raises(ValueError, match="h must be fp32"):
        moe_lora_shrink_pairs(x, a, ranks, ids, args.token_slots, got[:, :, :8], per_pair)


@pytest.mark.skipif(ON_GPU, reason="the interpreter variant; the GPU test below covers the GPU")
@pytest.mark.parametrize("gather_rows", [True, False])
def test_fp8_expert_gemm_adds_the_expand_in_its_epilogue(gather_rows):
    """fp8_expert_gemm(lora=...): the base GEMM plus each pair's scaling * h @ B[s, e].T, per slice, rows of tokens
    without an adapter equal to the base (fp32 here, so one rounding or two give the same numbers)."""
    from moelora.kernels.fused_moe_triton import moe_align

    g = torch.Generator().manual_seed(11)
    blk, T, K, E, D, S, R = (16, 16), 7, 3, 5, 40, 3, 8
    outs = [24, 24]
    O = sum(outs)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    x = torch.randn(T if gather_rows else T * K, D, generator=g)  # fp32: quantized in the kernel, fp32 output
    qe, se = quantize_weight_block(torch.randn(E, O, D, generator=g), blk)
    align = moe_align(ids, E, 16)
    P = T * K
    h = torch.randn(P, 2, 16, generator=g)
    b = torch.randn(S, E, O, R, generator=g) * 0.3
    ranks = torch.tensor([[8, 4, 0], [2, 8, 8]], dtype=torch.int32)
    scaling = torch.rand(2, S, generator=g) + 0.5
    off = torch.tensor([0, 24, 48], dtype=torch.int32)
    slots = torch.tensor([0, -1, 2, 1, 1, 0, 2], dtype=torch.int32)
    epi = Fp8LoRAEpilogue(h.permute(1, 0, 2), b, off, ranks, scaling, slots, row_div=K)
    base = fp8_expert_gemm(x, qe, se, blk, ids, align, gather_rows, 16)
    y = fp8_expert_gemm(x, qe, se, blk, ids, align, gather_rows, 16, lora=epi)
    ref = base.clone()
    moe_lora_expand_ref(h[:, :, :R].contiguous(), b, off, ranks, scaling, ids, slots, E, ref)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    base_rows = (slots < 0).repeat_interleave(K)
    assert torch.equal(y[base_rows], base[base_rows])
    assert (y - base).abs().max() > 0.1


@pytest.fixture
def epilogue_switch():
    before = fp8_moe_lora_epilogue()
    yield
    set_fp8_moe_lora_epilogue(before)


@pytest.mark.skipif(ON_GPU, reason="the interpreter variant; the GPU test below covers the GPU")
@pytest.mark.parametrize("triton_shrink", [True, False])
def test_fused_moe_pairs_with_the_expand_in_the_epilogue(triton_shrink, epilogue_switch):
    """FP8 expert stacks on the Triton fast path with LoRA: the switch moves the expand into the GEMMs' epilogue
    (the GEMMs get the epilogue, no side stream) and gives the default path's numbers (fp32: to 1e-4)."""
    from moelora.kernels.moe_lora import moe_lora_expand_ref, moe_lora_shrink_ref
    from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink
    from moelora.layers.fp8 import Fp8ExpertWeight, Fp8State

    g = torch.Generator().manual_seed(17)
    blk, T, E, K, H, inter = (16, 16), 6, 4, 2, 48, 24
    st = Fp8State(blk, torch.float32, None)
    w_gu = Fp8ExpertWeight(*quantize_weight_block(torch.randn(E, 2 * inter, H, generator=g) * 0.2, blk), st)
    w_d = Fp8ExpertWeight(*quantize_weight_block(torch.randn(E, H, inter, generator=g) * 0.2, blk), st)
    x = torch.randn(T, H, generator=g)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=g), K, True)
    args = expert_lora_args(T, E, torch.float32, g, hidden=H, inter=inter)
    ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan) if triton_shrink else (
        moe_lora_shrink_ref, moe_lora_expand_ref, None)
    calls, default = [], fmt._FAST["quantized"]
    real = Fp8ExpertWeight.expert_gemm
    Fp8ExpertWeight.expert_gemm = lambda self, *a, **kw: (calls.append(kw.get("lora") is not None), real(self, *a, **kw))[1]
    try:
        fmt.set_fast_path(True, on_cpu=True, quantized=True)
        set_fp8_moe_lora_epilogue(False)
        plain = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", None, *ops)
        default_path = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        assert calls == [False] * 4
        set_fp8_moe_lora_epilogue(True)
        assert w_gu.lora_epilogue and w_d.lora_epilogue
        epilogue = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        assert calls[4:] == [True, True]
    finally:
        Fp8ExpertWeight.expert_gemm = real
        fmt.set_fast_path(True, on_cpu=False, quantized=default)
    torch.testing.assert_close(epilogue, default_path, atol=1e-4, rtol=1e-4)
    assert (epilogue - plain).abs().max() > 1e-2  # the LoRA delta is there
    # from GROUPED_MIN_PAIRS pairs (grouped kernel on) the default path stays: no epilogue
    from moelora.kernels import moe_lora_grouped_triton as mg
    from moelora.kernels._triton import grouped_lora
    from moelora.kernels.moe import _epilogue_lora_ok

    set_fp8_moe_lora_epilogue(True)
    before = mg.GROUPED_MIN_PAIRS
    try:
        mg.GROUPED_MIN_PAIRS = T * K
        assert _epilogue_lora_ok(w_gu, w_d, T * K, ops[0]) is not grouped_lora()
        mg.GROUPED_MIN_PAIRS = T * K + 1
        assert _epilogue_lora_ok(w_gu, w_d, T * K, ops[0])
    finally:
        mg.GROUPED_MIN_PAIRS = before
    base_rows = args.token_slots < 0
    torch.testing.assert_close(epilogue[base_rows], plain[base_rows], atol=1e-5, rtol=1e-5)


def test_moe_lora_epilogue_switch_env_default():
    import os
    import subprocess
    import sys

    code = "from moelora.kernels.fp8_triton import fp8_moe_lora_epilogue; print(fp8_moe_lora_epilogue())"
    env = {k: v for k, v in os.environ.items() if k != "MOELORA_FP8_MOE_LORA_EPILOGUE"}
    run = lambda **extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,  # noqa: E731
                                         text=True, check=True).stdout.strip()
    assert run() == "False"  # off until measured on a GPU
    assert run(MOELORA_FP8_MOE_LORA_EPILOGUE="1") == "True"


# ------------------------------------------------------------------------------------------------ GPU


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("T", [8, 64, 128])  # below GROUPED_MIN_PAIRS: where the epilogue path runs
def test_gpu_each_expert_gemm_adds_the_expand_in_its_epilogue(T):
    """Qwen3-30B-A3B shapes, bf16, one projection at a time (no FP8 re-quantization in between): the gate_up and
    the down expert GEMM with the epilogue equal the GEMM alone plus moe_lora_expand_ref's fp32 delta on the
    same h, within bf16 rounding (the epilogue rounds once, the reference's base was rounded before the add: two
    roundings of 2^-9 at most, so 2^-7 leaves a margin and a missing or misplaced delta fails it); rows of tokens
    without an adapter equal the GEMM alone, bit for bit."""
    from moelora.kernels.fused_moe_triton import TritonExperts

    w_gu, w_d, x, _, ids, args = qwen3_fp8_experts_with_lora(T)
    E, K = w_gu.shape[0], ids.shape[1]
    act = torch.randn(T * K, w_d.shape[2], device="cuda", generator=torch.Generator("cuda").manual_seed(T)).bfloat16()
    base_rows = (args.token_slots < 0).repeat_interleave(K)
    sites = [(x, w_gu, args.gate_up_a, args.gate_up_b, args.gate_up_offsets, args.gate_up_ranks,
              args.gate_up_scaling, False),
             (act, w_d, args.down_a, args.down_b, args.down_offsets, args.down_ranks, args.down_scaling, True)]
    for inp, w, a, b, offs, ranks, scaling, per_pair in sites:
        fast = TritonExperts(ids, E)
        h = shrink_pairs_buffer(T * K, a.shape[0], a.shape[3], "cuda")
        moe_lora_shrink_pairs(inp, a, ranks, ids, args.token_slots, h, per_pair)
        base = fast(inp, w)
        got = fast(inp, w, lora=Fp8LoRAEpilogue(h.permute(1, 0, 2), b, offs, ranks, scaling, args.token_slots,
                                                 row_div=K))
        ref = base.to(torch.float32, copy=True)
        moe_lora_expand_ref(h[:, :, :a.shape[3]].contiguous(), b, offs, ranks, scaling, ids, args.token_slots, E, ref)
        assert _rel(got, ref) < 2.0**-7, (per_pair, _rel(got, ref))
        assert torch.equal(got[base_rows], base[base_rows])
        assert _rel(ref, base) > 2.0**-5  # the delta is large enough for a wrong one to show


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("T", [8, 64, 128])
def test_gpu_expand_in_the_epilogue_equals_the_default_path(T, epilogue_switch):
    """The whole layer at Qwen3-30B-A3B shapes: the epilogue path and the default fused LoRA kernels against fp32
    on the dequantized weights (fused_moe_ref, exact LoRA). Both paths re-quantize the intermediate to FP8 for the
    down GEMM, so their one-rounding difference in it flips FP8 roundings and they sit ~1.5% apart (measured on
    the H200, session 11); the test is that the epilogue path's error is no larger than the default path's (10%
    slack for those flips), base rows are identical to no LoRA, and a CUDA-graph replay is bit-equal to eager."""
    from moelora.kernels.fp8 import dequantize_weight_block
    from moelora.kernels.moe import fused_moe_ref
    from moelora.kernels.moe_lora_triton import moe_lora_expand, moe_lora_plan, moe_lora_shrink

    w_gu, w_d, x, weights, ids, args = qwen3_fp8_experts_with_lora(T)
    ops = (moe_lora_shrink, moe_lora_expand, moe_lora_plan)
    default = fmt._FAST["quantized"]
    try:
        fmt.set_fast_path(True, quantized=True)
        set_fp8_moe_lora_epilogue(False)
        default_path = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        plain = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", None, *ops)
        set_fp8_moe_lora_epilogue(True)
        eager = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture
            fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, *ops)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        fmt.set_fast_path(True, quantized=default)
    deq = [dequantize_weight_block(w.weight, w.scale_inv, (128, 128), torch.float32) for w in (w_gu, w_d)]
    f32 = dataclasses.replace(args, **{f.name: getattr(args, f.name).float() for f in dataclasses.fields(args)
                                       if getattr(args, f.name) is not None and getattr(args, f.name).is_floating_point()})
    exact = fused_moe_ref(x.float(), *deq, weights, ids, "silu", f32)
    err_default, err_epilogue = _rel(default_path, exact), _rel(eager, exact)
    assert err_epilogue < 1.1 * err_default, (err_epilogue, err_default)
    assert _rel(eager, plain) > 2.0**-5  # the LoRA delta is there, and larger than the errors compared
    assert torch.equal(replayed, eager)
    base_rows = args.token_slots < 0
    assert torch.equal(eager[base_rows], plain[base_rows])
