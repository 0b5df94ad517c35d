"""The one-launch router (router_triton.router_topk: gate GEMM + softmax + top-k) against its reference, its
counters, its launch variants, and MoEBlock with it on (moe.fused_router).

CPU: under TRITON_INTERPRET=1 at small shapes in fp32/fp16. GPU (marked gpu): bf16 at Qwen3-30B-A3B's router
shape, eager and in a CUDA graph."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU
from moelora.kernels.moe import router_triton as rt
from moelora.kernels.moe.experts import route_topk_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(T, E, H, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5 * 4).to(device, dtype)
    return x, gate


def _check(x, gate, K, renorm, out_dtype=None, launch=None):
    w, ids, logits = rt.router_topk(x, gate, K, renorm, out_dtype, launch)
    _, _, logits_ref = rt.router_topk_ref(x, gate, K, renorm, out_dtype)
    # the GEMM: the fp32 sum rounded to x's dtype, up to summation order (a last-bit difference at most)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[x.dtype]
    torch.testing.assert_close(logits, logits_ref, atol=tol, rtol=tol)
    assert logits.dtype == x.dtype and ids.dtype == torch.int64 and w.dtype == (out_dtype or x.dtype)
    # softmax and top-k: route_topk's semantics on the kernel's own logits; ties (16-bit logits have them) to the
    # lowest expert id, as a stable sort orders them
    w_ref, _ = route_topk_ref(logits, K, renorm, torch.float32)
    ids_ref = torch.sort(-torch.softmax(logits.float(), -1), dim=-1, stable=True).indices[:, :K]
    assert torch.equal(ids, ids_ref)
    # w rounded once from fp32 to its dtype: within that dtype's rounding of the reference's fp32 weights
    torch.testing.assert_close(w.float(), w_ref, atol=1e-6, rtol=torch.finfo(w.dtype).eps)
    return w, ids, logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,K,renorm", [(8, 2, True), (60, 4, False), (128, 8, True)])
def test_router_topk_matches_reference(dtype, E, K, renorm):
    H = 200  # not a multiple of the K tile or the split: masked tails
    for T in (1, 7, 40) if not ON_GPU else (1, 7, 64, 133, 256):
        x, gate = _inputs(T, E, H, dtype, T * 7 + E)
        _check(x, gate, K, renorm)


def test_router_topk_weights_rounded_once_to_out_dtype():
    x, gate = _inputs(9, 16, 64, torch.float32, 3)
    w32, ids32, _ = rt.router_topk(x, gate, 4, True, torch.float32)
    w16, ids16, _ = rt.router_topk(x, gate, 4, True, torch.float16)
    assert torch.equal(ids16, ids32) and torch.equal(w16, w32.to(torch.float16))


def test_router_counters_left_at_zero_and_launches_repeat():
    x, gate = _inputs(40, 32, 96, torch.float32, 5)
    first = rt.router_topk(x, gate, 4, True)
    cnt = rt._COUNTERS[torch.device(DEVICE) if DEVICE == "cpu" else x.device]
    assert int(cnt.abs().sum()) == 0  # every token block's counter reset by its last program
    second = rt.router_topk(x, gate, 4, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)  # partials added in split order: the same bits every launch


@pytest.mark.parametrize("cfg", [(16, 1, 16, 32, 4), (32, 3, 16, 16, 2), (16, 5, 32, 64, 1)])
def test_router_launch_variants_same_routing(cfg):
    x, gate = _inputs(40, 48, 160, torch.float32, 11)
    _check(x, gate, 6, True, launch=cfg)


def test_router_topk_ok_bounds():
    x, gate = _inputs(4, 8, 32, torch.float32, 1)
    assert rt.router_topk_ok(x, gate)
    big = torch.zeros(rt.FUSED_ROUTER_MAX_T + 1, 32)
    assert not rt.router_topk_ok(big.to(DEVICE), gate)  # prefill: F.linear + route_topk
    assert not rt.router_topk_ok(x, gate.half())  # dtypes differ
    assert not rt.router_topk_ok(x, torch.zeros(rt.FUSED_ROUTER_MAX_E + 1, 32, device=DEVICE))


def test_moe_block_takes_the_fused_router_as_configured():
    """MoEBlock.configure: the fused router on the Triton path (the GPU; forced on the CPU for tests) unless
    moe.fused_router is off; the references on the CPU by default."""
    from helpers import hf_tiny
    from moelora.config import ModelConfig
    from moelora.kernels.config import KernelConfig
    from moelora.kernels.moe.experts import route_topk_ref
    from moelora.layers.moe import MoEBlock

    block = MoEBlock(ModelConfig.from_hf(hf_tiny("qwen3_moe")[0]), torch.float32, DEVICE)
    assert block.fused_router == ON_GPU and (block.route is rt.route_topk) == ON_GPU
    assert block.route is rt.route_topk or block.route is route_topk_ref
    block.configure(KernelConfig(), triton=True)
    assert block.fused_router and block.route is rt.route_topk
    block.configure(KernelConfig.from_dict({"moe": {"fused_router": False}}), triton=True)
    assert not block.fused_router


def test_router_topk_names_the_shapes():
    x, gate = _inputs(4, 8, 32, torch.float32, 1)
    with pytest.raises(ValueError, match=r"gate \[E, 32\].*found gate \(8, 48\)"):
        rt.router_topk(x, torch.zeros(8, 48, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="router_topk launch: block_t"):
        rt.router_topk(x, gate, 2, True, launch=(24, 0, 0, 0, 0))


def test_moe_block_same_output_with_the_fused_router():
    """A tiny Qwen3-MoE block: the fused router gives the same routing and output as F.linear + the reference
    routing (fp32, well-separated logits)."""
    from helpers import hf_tiny
    from moelora.config import ModelConfig
    from moelora.kernels.config import KernelConfig
    from moelora.layers.moe import MoEBlock

    cfg = ModelConfig.from_hf(hf_tiny("qwen3_moe")[0])
    torch.manual_seed(0)
    block = MoEBlock(cfg, torch.float32, DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(6, cfg.hidden_size, device=DEVICE)
    block.configure(KernelConfig(), triton=True)
    assert block.fused_router
    on = block(x, None)
    ids_on, logits_on = block.last_topk_ids.clone(), block.last_router_logits.clone()
    block.configure(KernelConfig.from_dict({"moe": {"fused_router": False}}))
    off = block(x, None)
    assert torch.equal(ids_on, block.last_topk_ids)
    torch.testing.assert_close(logits_on, block.last_router_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_router_decode_shape_and_graph_replay():
    """Qwen3-30B-A3B's router (E 128, H 2048, top-8) at decode batches: the kernel's logits within a bf16 rounding
    of cuBLAS's, its routing route_topk's on them, and a CUDA graph replaying the eager bits."""
    import torch.nn.functional as F

    from moelora.kernels.moe.router_triton import route_topk

    for T in (1, 16, 64, 256):
        x, gate = _inputs(T, 128, 2048, torch.bfloat16, T)
        w, ids, logits = _check(x, gate, 8, True)
        torch.testing.assert_close(logits, F.linear(x, gate), atol=8e-3, rtol=8e-3)
        w2, ids2 = route_topk(logits, 8, True, torch.bfloat16)
        assert torch.equal(ids, ids2) and torch.equal(w, w2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rt.router_topk(x, gate, 8, True)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(out, (w, ids, logits)):
                assert torch.equal(a, b)
