"""Paged attention Triton kernels (split-KV decode and tiled prefill) vs the reference: prefill, chunked prefill
against a cached prefix, decode over several KV splits, GQA, head dims, sliding windows, shuffled blocks, padding
rows; on the GPU also Qwen3-30B-A3B dims in bf16 and replay inside a CUDA graph."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, tolerance
from moelora.kernels.attention.paged import paged_attention_ref
from moelora.kernels.attention.paged_triton import choose_splits, decode_kernel_chosen, paged_attention, split_workspace_numel
from moelora.kernels.quant.split_k_triton import split_counters

HQ, HKV, D = (32, 4, 128) if ON_GPU else (4, 2, 16)


def make_batch(seqs, Hq, Hkv, D, block_size, dtype, gen, pad_rows=2, extra_width=0, device=DEVICE):
    """seqs: (cached, new) per sequence -> q [T + pad_rows, Hq, D], caches, tensors, host lens/qsl, T."""
    nb = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.randn(nb, block_size, Hkv, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(nb, block_size, Hkv, D, generator=gen).to(device, dtype)
    perm = torch.randperm(nb, generator=gen).tolist()  # blocks scattered over the cache
    tables, lens, qsl, token_seq = [], [], [0], []
    for b, (c, n) in enumerate(seqs):
        need = -(-(c + n) // block_size)
        tables.append([perm.pop() for _ in range(need)])
        lens.append(c + n)
        qsl.append(qsl[-1] + n)
        token_seq += [b] * n
    T = qsl[-1]
    token_seq += [-1] * pad_rows
    mb = max(len(t) for t in tables) + extra_width
    bt = torch.tensor([t + [0] * (mb - len(t)) for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(T + pad_rows, Hq, D, generator=gen).to(device, dtype)
    i32 = dict(dtype=torch.int32, device=device)
    dev = (torch.tensor(token_seq, **i32), torch.tensor(lens, **i32), torch.tensor(qsl, **i32))
    return q, k_cache, v_cache, bt, dev, lens, qsl, T


def run_and_check(seqs, Hq, Hkv, D, block_size, dtype, window, seed, kernel="auto", num_splits=None,
                  min_tiles=None, extra_width=0):
    gen = torch.Generator().manual_seed(seed)
    q, k_cache, v_cache, bt, dev, lens, qsl, T = make_batch(seqs, Hq, Hkv, D, block_size, dtype, gen,
                                                            extra_width=extra_width)
    scale = D**-0.5
    ref = paged_attention_ref(q[:T].float(), k_cache.float(), v_cache.float(), bt, lens, qsl, scale, window)
    out = torch.full_like(q, 7.0)
    paged_attention(q, k_cache, v_cache, bt, *dev, scale, window, out, kernel=kernel, num_splits=num_splits,
                    min_tiles=min_tiles)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(out[:T].float(), ref, atol=atol, rtol=rtol)
    if decode_kernel_chosen(q.shape[0], bt.shape[0], kernel):
        assert torch.all(out[T:] == 0), "the decode kernel writes 0 to padding rows"
    else:
        assert torch.all(out[T:] == 7.0), "padding rows must stay untouched"


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_reference(block_size, window, dtype, kernel):
    # (tokens already cached, new tokens this step): prefill, chunked prefill, decode
    seqs = [(0, 9), (7, 5), (12, 1), (0, 1), (30, 1)]
    run_and_check(seqs, HQ, HKV, D, block_size, dtype, window, block_size + (window or 0), kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,min_tiles", [(1, 2), (3, 1), (64, 1), (None, None)])
def test_split_decode_contexts(num_splits, min_tiles, dtype):
    """Decode rows at contexts around block/tile/split edges; at (64, 1) 1100 keys span 18 one-tile splits."""
    seqs = [(c - 1, 1) for c in (1, 15, 16, 17, 64, 65, 300, 1100)]
    run_and_check(seqs, 4, 1, 64, 16, dtype, None, 1, kernel="decode", num_splits=num_splits, min_tiles=min_tiles,
                  extra_width=5)


@pytest.mark.parametrize("groups,Hkv,D", [(1, 2, 64), (4, 1, 128), (8, 1, 64)])
def test_split_gqa_and_head_dims(groups, Hkv, D):
    seqs = [(299, 1), (16, 1), (130, 1)]
    for kernel in ("decode", "prefill"):
        run_and_check(seqs, groups * Hkv, Hkv, D, 16, DTYPES[-1], None, groups, kernel=kernel, num_splits=5,
                      min_tiles=1)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("window", [1, 17, 100])
def test_sliding_window(window, kernel):
    """Windows shorter than, equal-ish to and spanning tiles and splits (splits start at the window's
    tile; prefill rows whose window starts past the query block's first tile)."""
    seqs = [(299, 1), (40, 1), (0, 1), (64, 20), (190, 1)]
    run_and_check(seqs, 4, 2, 32, 16, DTYPES[0], window, window, kernel=kernel, num_splits=5, min_tiles=1)


@pytest.mark.parametrize("kernel", ["auto", "decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_decode(dtype, kernel):
    """Prefill, chunked prefill across split edges and decode rows in one flat batch; 40 new rows of
    one sequence span two 32-row query blocks of the prefill kernel (G = 4 -> BLOCK_M = 32)."""
    seqs = [(0, 20), (120, 12), (200, 1), (3, 1), (60, 40)]
    run_and_check(seqs, 8, 2, 32, 4, dtype, None, 7, kernel=kernel, num_splits=5, min_tiles=1)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_sequences_without_new_rows(kernel):
    """Sequences with no rows this step (query_start_loc repeats) between others (prefill kernel: their zero
    query blocks in the cumulative count)."""
    seqs = [(3, 4), (10, 0), (0, 20), (7, 0), (30, 1)]
    run_and_check(seqs, 4, 2, 16, 4, torch.float32, None, 11, kernel=kernel, num_splits=3, min_tiles=1)


def test_prefill_rows_marked_padding_inside_a_sequence():
    """Rows whose token_seq is -1 are padding even when query_start_loc puts them in a sequence (the decode
    graphs' layout: query_start_loc = arange, padding rows -1): 0 from the decode kernel (direct or split, so
    its output needs no zero-fill), untouched by the others."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([(10, 1), (5, 1), (7, 1)], 4, 2, 16, 4, torch.float32, gen, pad_rows=0)
    q, k_cache, v_cache, bt, (ts, lens_t, qsl_t), lens, qsl, T = batch
    ts[1] = -1
    for kernel, splits in (("decode", 1), ("decode", 3), ("prefill", None)):
        out = torch.full_like(q, 7.0)
        paged_attention(q, k_cache, v_cache, bt, ts, lens_t, qsl_t, 0.25, None, out, kernel=kernel,
                        num_splits=splits, min_tiles=1)
        ref = paged_attention_ref(q, k_cache, v_cache, bt, lens, qsl, 0.25)
        assert torch.all(out[1] == (0.0 if kernel == "decode" else 7.0)), (kernel, splits)
        torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], atol=1e-4, rtol=1e-4)


def test_split_preallocated_workspace():
    """A caller's workspace (e.g. allocated before a graph capture) gives the same bits; too small is refused."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, bt, dev, lens, qsl, T = make_batch([(200, 1), (70, 1), (5, 1)], 4, 2, 16, 16,
                                                            torch.float32, gen)
    outs = []
    for ws in (None, torch.full((split_workspace_numel(T + 2, 4, 16, 4) + 5,), float("nan"), device=DEVICE)):
        out = torch.zeros_like(q)
        paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, out, kernel="decode", num_splits=4, min_tiles=1,
                        workspace=ws)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # the splits arriving last reset their (row, KV head) arrival counters for the next launch (graph replays)
    assert not split_counters(q.device, 1).any()
    with pytest.raises(ValueError):
        paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, outs[0], kernel="decode", num_splits=4,
                        workspace=torch.empty(10))
    with pytest.raises(ValueError, match="num_splits and min_tiles must be >= 1"):
        paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, outs[0], kernel="decode", num_splits=0)


def test_split_without_counters_writes_directly(monkeypatch):
    """Inside a graph capture that finds no arrival counters (split_counters gives None), the decode kernel runs
    with one split: the same output as num_splits=1."""
    import moelora.kernels.attention.paged_triton as pt

    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache, bt, dev, lens, qsl, T = make_batch([(150, 1), (9, 1)], 4, 2, 16, 16, torch.float32, gen)
    direct, fallback = torch.zeros_like(q), torch.zeros_like(q)
    paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, direct, kernel="decode", num_splits=1)
    monkeypatch.setattr(pt, "split_counters", lambda device, tiles: None)
    paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, fallback, kernel="decode", num_splits=4, min_tiles=1,
                    workspace=torch.empty(0))  # no workspace needed (a too-small one is not even checked)
    assert torch.equal(direct, fallback)


def test_choose_splits_rule():
    assert [choose_splits(T, 4, 132) for T in (1, 16, 64, 128, 132, 256)] == [64, 9, 3, 2, 1, 1]
    assert choose_splits(1, 1, 8) == 32


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be auto, decode or prefill, got 'legacy'"):
        decode_kernel_chosen(1, 1, "legacy")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernels for real")
def test_kernels_compile_for_sm90():
    """Compile (not interpret) every attention kernel for sm_90 with Triton's bundled ptxas: the split kernel
    must use mma + cp.async pipelining, the prefill kernel wgmma."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    code = (f"import sys; sys.path.insert(0, {str(root / 'scripts')!r}); import compile_check_attention as c; "
            "c.main()")
    try:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        pytest.skip("no python")
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("no bundled ptxas")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    split = [ln for ln in lines if ln.startswith("_paged_attn_split_kernel")]
    prefill = [ln for ln in lines if ln.startswith("_paged_attn_prefill_kernel")]
    assert len(split) == 5 and all(" mma=0 " not in ln and "cp.async=0 " not in ln for ln in split), split
    quant = [ln for ln in lines if "'QUANT': True" in ln]  # the FP8 o_proj's input quantized in the kernel
    assert len(quant) == 2 and all("e4m3=0" not in ln for ln in quant), quant
    assert len(prefill) == 2 and all("wgmma=0" not in ln for ln in prefill), prefill


# ---- GPU: Qwen3-30B-A3B dims (32 q heads, 4 kv heads, head_dim 128, block 16) in bf16 ----

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx", [(1, 1024), (1, 4096), (64, 1024), (64, 4096)])
def test_gpu_qwen3_decode(batch, ctx):
    gen = torch.Generator().manual_seed(batch + ctx)
    lens = torch.randint(max(1, ctx // 2), ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = ctx
    seqs = [(c - 1, 1) for c in lens]
    run_and_check(seqs, 32, 4, 128, 16, torch.bfloat16, None, batch, extra_width=3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["auto", "decode"])
def test_gpu_prefill_and_window(kernel):
    """Prefill, chunked prefill and decode rows in one batch (auto -> the tiled prefill kernel)."""
    seqs = [(0, 700), (1500, 300), (4000, 1), (33, 1)]
    for window in (None, 1000):
        run_and_check(seqs, 32, 4, 128, 16, torch.bfloat16, window, 3, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_split_inside_cuda_graph():
    """Capture once at a fixed table width, then change lengths and block tables in place and replay."""
    Hq, Hkv, Dh, BS, B, width = 32, 4, 128, 16, 8, 256  # up to 4096 positions
    gen = torch.Generator().manual_seed(0)
    nb = B * width + 1
    k_cache = torch.randn(nb, BS, Hkv, Dh, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(nb, BS, Hkv, Dh, generator=gen).to("cuda", torch.bfloat16)
    q = torch.empty(B, Hq, Dh, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    token_seq = torch.full((B,), -1, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(B, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    out = torch.zeros(B, Hq, Dh, dtype=torch.bfloat16, device="cuda")
    scale = Dh**-0.5

    def fill(lens: list[int]) -> list[int]:
        n = len(lens)
        perm = torch.randperm(nb - 1, generator=gen)[: B * width].view(B, width) + 1
        q.copy_(torch.randn(B, Hq, Dh, generator=gen))
        bt.copy_(perm.to(torch.int32))
        token_seq.copy_(torch.tensor(list(range(n)) + [-1] * (B - n), dtype=torch.int32))
        seq_lens.copy_(torch.tensor(lens + [1] * (B - n), dtype=torch.int32))
        out.zero_()
        return lens

    def launch():
        paged_attention(q, k_cache, v_cache, bt, token_seq, seq_lens, qsl, scale, None, out)

    fill([5] * B)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for lens in ([1, 17, 300, 1024, 4096, 2000, 64, 4095], [4096] * 5, [1000, 3]):
        lens = fill(lens)
        graph.replay()
        torch.cuda.synchronize()
        n = len(lens)
        ref = paged_attention_ref(q[:n].float(), k_cache.float(), v_cache.float(), bt[:n], lens, list(range(n + 1)),
                                  scale)
        torch.testing.assert_close(out[:n].float(), ref, atol=3e-2, rtol=3e-2)
        assert torch.all(out[n:] == 0), "padding rows are written 0"
        eager = torch.zeros_like(out)
        paged_attention(q, k_cache, v_cache, bt, token_seq, seq_lens, qsl, scale, None, eager)
        assert torch.equal(eager, out), "replay must equal eager bit for bit (same shapes)"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_quantizes_its_output_per_head_for_an_fp8_o_proj(num_splits):
    """out_fp8: the decode kernel (direct or split) also writes quantize_act_group(out.reshape(T, Hq * D), D), padding
    rows included (zeros, the smallest scale), in the same launches; other kernels refuse it."""
    from moelora.kernels.quant.fp8 import FP8_DTYPE
    from moelora.kernels.quant.fp8_act_triton import quantize_act_group

    gen = torch.Generator().manual_seed(21 + num_splits)
    batch = make_batch([(10, 1), (5, 1), (33, 1)], 4, 2, 16, 4, DTYPES[-1], gen, pad_rows=2)
    q, k_cache, v_cache, bt, dev, lens, qsl, T = batch
    n = q.shape[0]
    out = torch.full_like(q, 7.0)
    oq = torch.empty(n, 4 * 16, dtype=FP8_DTYPE, device=DEVICE)
    osc = torch.full((n, 4), float("nan"), device=DEVICE)
    paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, out, kernel="decode", num_splits=num_splits,
                    min_tiles=1, out_fp8=(oq, osc))
    q_ref, s_ref = quantize_act_group(out.reshape(n, 64), 16)
    assert torch.equal(osc, s_ref) and torch.equal(oq.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.all(out[T:] == 0)
    with pytest.raises(ValueError, match="decode kernel"):
        paged_attention(q, k_cache, v_cache, bt, *dev, 0.25, None, out, kernel="prefill", out_fp8=(oq, osc))
