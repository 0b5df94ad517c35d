"""The Triton routed-expert base path (kernels/moe: align_triton, gemm_triton, act_triton, router_triton's
route_topk, experts_triton) vs the references: alignment, grouped GEMM, SiLU-and-mul, combine, routing, the whole
layer without LoRA and, through fused_moe_pairs, with LoRA.

CPU: under TRITON_INTERPRET=1 at tiny shapes in fp32/fp16. GPU (marked gpu): bf16 at Qwen3-30B-A3B shapes,
plus CUDA-graph capture/replay."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, expert_lora_args, in_group_order
from moelora.kernels.moe import act_triton as act
from moelora.kernels.moe import align_triton as al
from moelora.kernels.moe import experts_triton as fmt
from moelora.kernels.moe import gemm_triton as gm
from moelora.kernels.moe.experts import ExpertKernels, fused_moe_pairs, fused_moe_ref, route_topk_ref
from moelora.kernels.moe.router_triton import route_topk
from moelora.kernels.moe_lora.config import MoELoRAConfig

TRITON = ExpertKernels.from_config(MoELoRAConfig(), True)  # the GPU's choice: Triton base path and LoRA kernels

pytestmark = pytest.mark.usefixtures("one_thread")

H, I = 48, 24  # CPU shapes: not multiples of the K tiles (masked tails)
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative error norm


def _rel(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _routing(T, E, K, gen, mode="random", device=DEVICE):
    """(topk_weights [T, K] fp32, topk_ids [T, K] int64)."""
    if mode == "one_expert":  # every token's first choice is expert 3; for K > 1 the others spread
        ids = torch.stack([torch.cat([torch.tensor([3]), (torch.randperm(E - 1, generator=gen)[: K - 1] + 4) % E])
                           for _ in range(T)])
    elif mode == "all_same":  # all tokens on the same K experts (K == 1: everything on one expert)
        ids = (torch.arange(K) + 5).remainder(E)[None, :].expand(T, K).contiguous()
    elif mode == "few_experts":  # most experts get no token
        ids = torch.stack([torch.randperm(K + 1, generator=gen)[:K] for _ in range(T)])
    else:  # realistic: random router logits
        return route_topk_ref(torch.randn(T, E, generator=gen).to(device), K, True)
    w = torch.rand(T, K, generator=gen)
    return (w / w.sum(1, keepdim=True)).to(device), ids.to(device)


def _weights(E, dtype, gen, hidden=H, inter=I, device=DEVICE):
    w_gu = (torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    w_d = (torch.randn(E, hidden, inter, generator=gen) * inter**-0.5).to(device, dtype)
    return w_gu, w_d


# --------------------------------------------------------------------------------------- CPU / any


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("mode", ["random", "all_same", "few_experts"])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (3, 16, 8), (7, 8, 1), (133, 16, 8), (40, 300, 4)])
def test_align_matches_reference(T, E, K, mode, block_m, chunked, monkeypatch):
    if chunked:  # the three-launch variant (large P) at small shapes
        monkeypatch.setattr(al, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)
    gen = torch.Generator().manual_seed(T * 31 + E)
    _, ids = _routing(T, E, K, gen, mode)
    got = al.moe_align(ids, E, block_m)
    ref = al.moe_align_ref(ids, E, block_m)
    assert torch.equal(in_group_order(got[0], got[1], block_m), ref[0]) and torch.equal(got[1], ref[1])
    p_max = al.max_padded_pairs(T * K, E, block_m)
    assert got[0].shape == (p_max,) and got[1].shape == (p_max // block_m,)


@pytest.mark.parametrize("E,K", [(8, 1), (8, 2), (60, 8), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_matches_reference(E, K, renormalize):
    gen = torch.Generator().manual_seed(E + K)
    for T in (1, 7, 133):
        logits = (torch.randn(T, E, generator=gen) * 3).to(DEVICE)
        w, ids = route_topk(logits, K, renormalize)
        w_ref, ids_ref = route_topk_ref(logits, K, renormalize)
        assert torch.equal(ids, ids_ref) and ids.dtype == torch.int64
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
        # weights in the activations' dtype straight from the kernel (no cast launch): rounded once from fp32
        w16, ids16 = route_topk(logits, K, renormalize, torch.float16)
        w16_ref, _ = route_topk_ref(logits, K, renormalize, torch.float16)
        assert w16.dtype == torch.float16 and torch.equal(ids16, ids_ref)
        assert torch.equal(w16, w.to(torch.float16))  # the kernel's fp32 weights, rounded once
        assert torch.equal(w16_ref, w_ref.to(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather,fuse_act,weighted", [(True, False, False), (False, False, True), (True, True, False)])
def test_expert_gemm_matches_reference(gather, fuse_act, weighted, dtype):
    gen = torch.Generator().manual_seed(3)
    T, E, K = 9, 8, 2
    _, ids = _routing(T, E, K, gen)
    D, O = (64, 96) if gather else (32, 64)  # even K tiles with the small config below
    inp = torch.randn(T if gather else T * K, D, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(E, O, D, generator=gen) * D**-0.5).to(DEVICE, dtype)
    pw = torch.rand(T * K, generator=gen).to(DEVICE) if weighted else None
    for cfg in (gm.GemmConfig(16, 32, 32, 4, 2), gm.GemmConfig(32, 64, 128, 4, 2)):  # EVEN_K and masked K
        align = al.moe_align(ids, E, cfg.block_m)
        out = torch.full((T * K, O // 2 if fuse_act else O), float("nan"), device=DEVICE, dtype=dtype)
        gm.expert_gemm(inp, w, align, T * K, K, out, gather, pw, fuse_act, cfg)
        ref = gm.expert_gemm_ref(inp, w, ids, gather, pw, fuse_act)
        assert _rel(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_and_combine(dtype):
    gen = torch.Generator().manual_seed(4)
    gu = torch.randn(13, 2 * 40, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(act.silu_and_mul(gu), act.silu_and_mul_ref(gu), atol=1e-3, rtol=1e-3)
    o = torch.randn(5 * 3, 70, generator=gen).to(DEVICE, dtype)
    w = torch.rand(5, 3, generator=gen).to(DEVICE)
    torch.testing.assert_close(act.moe_combine(o, w), act.moe_combine_ref(o, w), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_and_combine_add_a_lora_delta_as_add_would(dtype):
    """The overlapped LoRA path hands its fp32 delta to the activation and combine kernels instead of a
    y.add_(delta) pass: the sum must round once to y's dtype exactly as add_ does (the bits of the old path)."""
    gen = torch.Generator().manual_seed(5)
    gu = torch.randn(13, 2 * 40, generator=gen).to(DEVICE, dtype)
    d_gu = torch.randn(13, 2 * 40, generator=gen).to(DEVICE) * 0.3
    want = act.silu_and_mul(gu.clone().add_(d_gu))
    assert torch.equal(act.silu_and_mul(gu, delta=d_gu), want)
    assert not torch.equal(act.silu_and_mul(gu), want)  # the delta matters at these numbers
    o = torch.randn(5 * 3, 70, generator=gen).to(DEVICE, dtype)
    d_o = torch.randn(5 * 3, 70, generator=gen).to(DEVICE) * 0.3
    w = torch.rand(5, 3, generator=gen).to(DEVICE)
    w[1, 2] = 0.0  # a pair left out (weight 0): NaN in its delta row changes nothing
    d_o[1 * 3 + 2] = float("nan")
    got = act.moe_combine(o, w, delta=d_o)
    want = act.moe_combine(o.clone().add_(torch.nan_to_num(d_o)), w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="LoRA delta: expected fp32 or"):
        act.moe_combine(o, w, delta=d_o.double())
    # a delta in the activations' dtype (the experts' delta buffers): the same as add_ of it
    d16 = (torch.randn(13, 2 * 40, generator=gen) * 0.3).to(DEVICE, dtype)
    assert torch.equal(act.silu_and_mul(gu, delta=d16), act.silu_and_mul(gu.clone().add_(d16)))
    d_o16 = torch.nan_to_num(d_o).to(dtype)
    assert torch.equal(act.moe_combine(o, w, delta=d_o16), act.moe_combine(o.clone().add_(d_o16), w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["random", "one_expert", "all_same", "few_experts"])
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 3, 7, 133])
def test_fused_moe_triton_matches_reference(T, K, mode, dtype):
    if T == 133 and (dtype != DTYPES[0] or mode not in ("random", "all_same")):
        pytest.skip("interpreter time: the large case in one dtype and two routings")
    gen = torch.Generator().manual_seed(T * 10 + K)
    E = 16
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w_gu, w_d = _weights(E, dtype, gen)
    weights, ids = _routing(T, E, K, gen, mode)
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids)
    got = fmt.fused_moe_triton(x, w_gu, w_d, weights, ids)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert _rel(got, ref) < BOUND[dtype]


@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("T,K", [(1, 8), (7, 2), (133, 8)])
def test_fused_moe_pairs_uses_triton_base(T, K, with_lora, monkeypatch):
    """fused_moe_pairs with the Triton base GEMMs (and the reference LoRA) computes fused_moe_ref; the _ExpertGemm
    path is not touched."""
    from moelora.kernels.moe import experts as moe

    def no_old_path(*a, **k):
        raise AssertionError("the _ExpertGemm path ran")

    monkeypatch.setattr(moe, "_ExpertGemm", no_old_path)
    gen = torch.Generator().manual_seed(T + K)
    E, dtype = 16, DTYPES[0]
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w_gu, w_d = _weights(E, dtype, gen)
    weights, ids = _routing(T, E, K, gen)
    args = expert_lora_args(T, E, dtype, gen) if with_lora else None
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, ExpertKernels(triton=True))
    assert _rel(got, ref) < BOUND[dtype]
    if with_lora:  # the LoRA deltas matter at this scale
        assert _rel(fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", None), ref) > 10 * BOUND[dtype]


def test_the_cpu_takes_the_references_by_default():
    """Experts on the CPU run the references unless a test forces the Triton kernels (under the interpreter)."""
    from moelora.layers.moe import RoutedExperts

    assert RoutedExperts(4, 8, 4, "silu", torch.float32, "cpu").kernels == ExpertKernels()
    assert not ExpertKernels().triton and not ExpertKernels().lora.triton


def test_fast_path_leaves_quantized_stacks_alone():
    """A weight that is not a plain tensor of x's dtype (an FP8 / NVFP4 expert stack) keeps _ExpertGemm."""

    class Stack:  # what layers/fp8.py passes: a shape and its own grouped_mm
        shape = torch.Size([4, 8, 4])

    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the path takes CUDA 16-bit, or the CPU interpreter
    x, w, wd = (torch.zeros(*s, dtype=dt, device=DEVICE) for s in ((2, 4), (4, 8, 4), (4, 4, 4)))
    assert fmt.fast_path_ok(x, w, wd)
    assert not fmt.fast_path_ok(x, Stack(), wd)
    assert not fmt.fast_path_ok(x, w, Stack())
    assert not fmt.fast_path_ok(x, w.half(), wd)


# --------------------------------------------------------------------------------------------- GPU

QE, QK, QH, QI = 128, 8, 2048, 768  # Qwen3-30B-A3B


@pytest.fixture(scope="module")
def qwen_weights():
    gen = torch.Generator().manual_seed(0)
    return _weights(QE, torch.bfloat16, gen, QH, QI, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 256, 2048])
def test_gpu_fused_moe_matches_reference(T, qwen_weights):
    gen = torch.Generator().manual_seed(T)
    w_gu, w_d = qwen_weights
    x = torch.randn(T, QH, generator=gen).to("cuda", torch.bfloat16)
    weights, ids = route_topk(torch.randn(T, QE, generator=gen).cuda(), QK, True)
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids)
    got = fmt.fused_moe_triton(x, w_gu, w_d, weights, ids)
    assert _rel(got, ref) < BOUND[torch.bfloat16]
    via_pairs = fused_moe_pairs(x, w_gu, w_d, weights.to(x.dtype), ids, "silu", None, TRITON)
    assert via_pairs.shape == ref.shape and _rel(via_pairs, ref) < BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["all_same", "one_expert", "few_experts"])
@pytest.mark.parametrize("T", [3, 256, 1024])
def test_gpu_skewed_routing_other_shapes(T, mode, dtype):
    """Hot experts (hundreds of rows on one expert), empty experts, DeepSeek-V2-Lite dims (E=64, top-6,
    I=1408), fp16 too."""
    E, K, hid, inter = 64, 6, 2048, 1408
    gen = torch.Generator().manual_seed(T + 5)
    w_gu, w_d = _weights(E, dtype, gen, hid, inter, "cuda")
    x = torch.randn(T, hid, generator=gen).to("cuda", dtype)
    weights, ids = _routing(T, E, K, gen, mode, "cuda")
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids)
    got = fused_moe_pairs(x, w_gu, w_d, weights.to(dtype), ids, "silu", None, TRITON)
    assert _rel(got, ref) < BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_fused_moe_pairs_with_lora(T, overlap, qwen_weights):
    from moelora.kernels.streams import side_stream

    gen = torch.Generator().manual_seed(T + 1)
    w_gu, w_d = qwen_weights
    x = torch.randn(T, QH, generator=gen).to("cuda", torch.bfloat16)
    weights, ids = route_topk(torch.randn(T, QE, generator=gen).cuda(), QK, True)
    args = expert_lora_args(T, QE, torch.bfloat16, gen, S=3, R=8, hidden=QH, inter=QI, device="cuda")
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    side = side_stream(x.device) if overlap else None
    got = fused_moe_pairs(x, w_gu, w_d, weights.to(x.dtype), ids, "silu", args, TRITON, side)
    torch.cuda.synchronize()
    assert _rel(got, ref) < BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_graph_replay_equals_eager(T, qwen_weights):
    """Route + fused MoE captured in a CUDA graph: replays with new inputs equal eager runs bit for bit
    (no atomics on the base path)."""
    w_gu, w_d = qwen_weights
    gen = torch.Generator().manual_seed(T + 2)
    x = torch.randn(T, QH, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(T, QE, generator=gen).cuda()

    def step():
        weights, ids = route_topk(logits, QK, True)
        return fused_moe_pairs(x, w_gu, w_d, weights.to(x.dtype), ids, "silu", None, TRITON)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (compiles) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(T, QH, generator=g).to("cuda", torch.bfloat16))
        logits.copy_(torch.randn(T, QE, generator=g).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@pytest.mark.parametrize("dtype", DTYPES)
def test_serial_lora_deltas_take_the_overlapped_paths_rounding(dtype, monkeypatch):
    """Without a side stream, 16-bit activations' deltas are still computed into their own buffer (store mode, the
    activations' dtype) and added by the consumer, as the overlapped path does — so overlap on and off give the same
    bits; fp32 activations' deltas are added in place by the kernel (the same values, one rounding)."""
    from moelora.kernels.moe_lora import backend

    calls = []
    real = backend.moe_lora_fused_ref

    def spy(x, lora, routing, y, *, store=False, **kw):
        calls.append((y.dtype, store))
        return real(x, lora, routing, y, store=store, **kw)

    monkeypatch.setattr(backend, "moe_lora_fused_ref", spy)
    gen = torch.Generator().manual_seed(3)
    T, K, E = 7, 2, 16
    x = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w_gu, w_d = _weights(E, dtype, gen)
    weights, ids = _routing(T, E, K, gen)
    args = expert_lora_args(T, E, dtype, gen)
    got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, ExpertKernels())
    if dtype != torch.float32:
        assert calls == [(dtype, True), (dtype, True)]  # gate_up, down: into their delta buffers
    else:
        assert calls == [(dtype, False), (dtype, False)]  # added into y by the kernel itself
    ref = fused_moe_ref(x, w_gu, w_d, weights, ids, "silu", args)
    assert _rel(got, ref) < BOUND[dtype]
