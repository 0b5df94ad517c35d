"""set_lora_consumer_expand on the GPU: the FP8 qkv / o_proj LoRA expand added by qk_norm_rope and the
post-attention RMSNorm, the GEMM launched with PDL beside the shrink (GDC_TAIL), against the GEMM's own LoRA
epilogue, eagerly and over CUDA-graph replays with changing inputs (a consumer reading h before the shrink wrote
it would differ)."""

import contextlib
import dataclasses
import random

import pytest
import torch

from helpers import tmp

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _needs_fp8():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@contextlib.contextmanager
def launches(kernel, key):
    """The value of keyword argument `key` (None when absent) of each launch of a Triton kernel inside the block."""
    calls: list = []
    real = kernel.run

    def spy(*args, **kwargs):
        calls.append(kwargs.get(key))
        return real(*args, **kwargs)

    kernel.run = spy
    try:
        yield calls
    finally:
        kernel.__dict__.pop("run", None)


@torch.no_grad()
@pytest.mark.parametrize("T", [3, 64])
def test_gemm_after_shrink_equals_the_plain_gemm_and_the_shrink_is_complete(T):
    """fp8_linear(after_shrink=True) right after lora_shrink(launch_dependents=True): launched with PDL (GDC_TAIL),
    bit-equal to the plain GEMM, and h complete when the GEMM is: a kernel launched after the GEMM reads the
    shrink's values, over 6 graph replays with new inputs each."""
    from moelora.adapters.metadata import LoRABatch
    from moelora.bench.common import captured_graph
    from moelora.kernels import fp8_triton as ft
    from moelora.kernels.fp8 import quantize_weight_block
    from moelora.kernels.lora import lora_shrink_ref
    from moelora.kernels.lora_triton import lora_shrink, lora_shrink_buffer

    g = torch.Generator(device=DEV).manual_seed(T)
    N, D, S, R = 2048, 4096, 4, 16
    wq, ws = quantize_weight_block(torch.randn(N, D, device=DEV, generator=g) * D**-0.5)
    a = torch.randn(1, S, R, D, device=DEV, generator=g).bfloat16() * 0.05
    ranks = torch.tensor([[16, 8, 16, 4]], dtype=torch.int32, device=DEV)
    slots = torch.tensor([i % 5 - 1 for i in range(T)], dtype=torch.int32)
    lora = dataclasses.replace(LoRABatch.build(slots.to(DEV), S, DEV), graph=True)
    x = torch.empty(T, D, device=DEV, dtype=torch.bfloat16)
    sums = torch.empty(T, R, device=DEV)

    def step():
        xq, xs = ft.fp8_prequantize(x, 128)  # before the shrink, as LoRALinear.forward_deferred: nothing between
        h = lora_shrink_buffer(1, T, R, D, DEV)
        lora_shrink(x, a, ranks, lora.groups, h, launch_dependents=True)
        y = ft.fp8_linear(xq, wq, ws, x_scale=xs, out_dtype=x.dtype, after_shrink=True)
        sums.copy_(h.sum(0)[0])  # launched after the GEMM: must see the whole shrink
        return y

    # the entries the shrink writes: rows with a slot, ranks below the slot's
    valid = torch.tensor([[s >= 0 and r < int(ranks[0, s]) for r in range(R)] for s in slots.tolist()], device=DEV)

    x.copy_(torch.randn(T, D, device=DEV, generator=g))
    ft.fp8_linear(x, wq, ws)  # the split-K counters made eagerly (PDL needs them before the launch)
    with launches(ft._fp8_gemm_kernel, "GDC_TAIL") as tails:
        y = step()
    assert tails == [True]
    assert torch.equal(y, ft.fp8_linear(x, wq, ws))
    graph, out = captured_graph(step)
    for _ in range(6):
        x.copy_(torch.randn(T, D, device=DEV, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros(1, T, R, device=DEV)
        lora_shrink_ref(x, a, ranks, lora.groups, ref)
        assert torch.equal(out, ft.fp8_linear(x, wq, ws))
        torch.testing.assert_close(sums[valid], ref[0][valid], rtol=1e-3, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("batch", [48, 160])
def test_consumer_expand_decode_step_equals_the_gemm_epilogue(tmp_path, batch):
    """An FP8 Qwen3-MoE (dummy weights, Qwen3-30B-A3B's attention dims, 2 layers), a decode step of 48 / 160
    sequences over 4 adapters and base rows: with set_lora_consumer_expand, the qkv and o_proj GEMMs carry no LoRA
    (LORA_N) and are launched with GDC_TAIL, and each layer's qk_norm_rope and post-attention RMSNorm add an expand; the
    logits equal the GEMM-epilogue path's up to rounding (relative 2^-7), and graph replays with new tokens equal
    eager runs of the same tokens bit for bit; the adapters move the logits."""
    from helpers import save_tiny_model

    from moelora.adapters.metadata import LoRABatch
    from moelora.bench.common import captured_graph
    from moelora.config import ModelConfig
    from moelora.engine.batch import SeqChunk, build_flat_batch
    from moelora.engine.kv_cache import KVCache
    from moelora.kernels import _triton
    from moelora.kernels import fp8_triton as ft
    from moelora.kernels import norm_triton as nt
    from moelora.models.loader import build_model

    src = tmp(tmp_path, "m")
    save_tiny_model("qwen3_moe", src, hidden_size=2048, head_dim=128, num_attention_heads=32, num_key_value_heads=4,
                    moe_intermediate_size=128, intermediate_size=256, num_hidden_layers=2)
    cfg = ModelConfig.from_pretrained(src)
    model = build_model(cfg, dtype=torch.bfloat16, device=DEV, max_loras=4, max_lora_rank=16, load_format="dummy",
                        quantization="fp8")
    g = torch.Generator(device=DEV).manual_seed(23)
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            w = lin.lora
            for s in range(4):
                for i, out in enumerate(w.out_features):
                    r = (16, 8, 16, 4)[s] if (s, i) != (1, 1) else 0  # slot 1 without k's LoRA
                    if r:
                        w.set_slot(i, s, torch.randn(r, w.in_features, device=DEV, generator=g) * 0.02,
                                   torch.randn(out, r, device=DEV, generator=g) * 0.02, 2.0)
    kv = KVCache(cfg, 4096, 16, torch.bfloat16, DEV)
    for cache in kv.caches:
        for c in cache:
            c.normal_(0, 1, generator=g)
    rng = random.Random(batch)
    chunks = []
    for b in range(batch):
        cached = rng.randrange(1, 300)
        chunks.append(SeqChunk([rng.randrange(cfg.vocab_size)], cached, kv.allocate(-(-(cached + 1) // 16)),
                               b % 5 - 1))
    fb = build_flat_batch(chunks, 16, DEV)
    lora = dataclasses.replace(LoRABatch.build(fb.token_slots, 4, DEV), graph=True)
    layers = len(model.model.layers)

    def step(batch=lora):
        return model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches, batch))

    try:
        with launches(ft._fp8_gemm_kernel, "LORA_N") as lora_n_off:
            ref = step()
        _triton.set_lora_consumer_expand(True)
        with launches(ft._fp8_gemm_kernel, "LORA_N") as lora_n, launches(ft._fp8_gemm_kernel, "GDC_TAIL") as tails, \
                launches(nt._rms_norm_kernel, "EXPAND_R") as norms, \
                launches(nt._qk_norm_rope_kernel, "EXPAND_R") as ropes:
            got = step()
        # qkv and o_proj no longer carry it (layer 1's dense MLP, mlp_only_layers, still does)
        assert sum(bool(n) for n in lora_n_off) - sum(bool(n) for n in lora_n) == 2 * layers
        assert sum(bool(t) for t in tails) == 2 * layers
        assert sum(bool(r) for r in norms) == layers and sum(bool(r) for r in ropes) == layers
        assert _rel(got, ref) < 2**-7, _rel(got, ref)
        graph, replayed = captured_graph(step)
        for _ in range(3):
            fb.input_ids.copy_(torch.randint(0, cfg.vocab_size, fb.input_ids.shape, device=DEV, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, step())
    finally:
        _triton.set_lora_consumer_expand(False)
    base = step(None)
    assert (step() - base).abs().max() > 0.05  # the adapters are there
