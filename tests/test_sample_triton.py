"""The one-pass sampling kernel (kernels/sample_triton.py) against its reference, and the Sampler's fast path.

CPU: the kernel under TRITON_INTERPRET=1 (small vocabularies, fp32/fp16 logits). GPU (marked gpu): Qwen3's
vocabulary in bf16, the fast path against the torch path's distribution."""

import math

import pytest
import torch

from kernel_cases import DEVICE, ON_GPU
from moelora.engine.sampler import Sampler
from moelora.engine.sampling_params import SamplingParams
from moelora.kernels.sample_triton import gumbel_argmax, gumbel_argmax_ref

V = 151936 if ON_GPU else 2500  # not a multiple of a step (4 x 256 columns): partial last steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunks", [1, 2, None])
def test_matches_reference_with_given_uniforms(dtype, chunks):
    gen = torch.Generator().manual_seed(3)
    B = 6
    logits = (torch.randn(B, V, generator=gen) * 3).to(DEVICE, dtype)
    inv_temp = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 0.0], device=DEVICE)  # rows 1 and 5 greedy
    u = torch.rand(B, V, generator=gen).clamp_min(1e-12).to(DEVICE)
    got = gumbel_argmax(logits, inv_temp, 0, u=u, chunks=chunks)
    assert torch.equal(got, gumbel_argmax_ref(logits, inv_temp, u))
    assert torch.equal(got[[1, 5]], logits[[1, 5]].float().argmax(dim=1))  # greedy rows: plain argmax
    assert not torch.equal(got, logits.float().argmax(dim=1))  # the noise moves the sampled rows


def test_greedy_ties_take_the_lowest_id_across_chunks():
    """Ties: the lowest column, whether the maxima share a lane (7 and 7 + 512), sit in two lanes of one chunk,
    or in two chunks (two chunks of 2,048 columns here)."""
    logits = torch.zeros(4, V, device=DEVICE)
    logits[0, [V - 5, 1500, 519, 7]] = 4.0
    logits[1, [V - 5, 2100]] = 4.0  # both in the second chunk, two lanes
    logits[2, V - 1] = 4.0  # the very last column
    logits[3, [V - 5, 1500]] = 4.0  # one in each chunk
    got = gumbel_argmax(logits, torch.zeros(4, device=DEVICE), 0, chunks=2)
    assert got.tolist() == [7, 2100, V - 1, 1500]


def test_in_kernel_draws_depend_on_the_seed_only():
    gen = torch.Generator().manual_seed(5)
    B = 8
    logits = torch.randn(B, V, generator=gen).to(DEVICE)  # flat-ish: many tokens can win
    inv_temp = torch.ones(B, device=DEVICE)
    a = gumbel_argmax(logits, inv_temp, 11, chunks=1)
    assert torch.equal(a, gumbel_argmax(logits, inv_temp, 11, chunks=3))  # chunking does not change draws
    assert torch.equal(a, gumbel_argmax(logits, inv_temp, torch.tensor([11], device=DEVICE)))
    others = [gumbel_argmax(logits, inv_temp, s) for s in (12, 13)]
    assert any(not torch.equal(a, o) for o in others)
    # identical rows draw independently (their own counters)
    same = gumbel_argmax(logits[:1].expand(B, V).contiguous(), inv_temp, 11)
    assert len(set(same.tolist())) > 1


def _frequencies(tokens: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=n)[:n].double() / tokens.numel()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_in_kernel_draws_follow_softmax_over_temperature(temperature):
    """Rows of probabilities (0.5, 0.25, 0.15, 0.1, then nothing): the drawn frequencies match
    softmax(log p / T) within 5 standard deviations; no token outside the support is drawn."""
    B, seeds, vocab = 128, 8, 1024  # 1,024 draws (the interpreter runs one program a row)
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.full((B, vocab), float("-inf"))
    logits[:, :4] = p.log()
    logits = logits.to(DEVICE)
    inv_temp = torch.full((B,), 1.0 / temperature, device=DEVICE)
    tokens = torch.cat([gumbel_argmax(logits, inv_temp, s, chunks=1) for s in range(seeds)])
    assert int(tokens.max()) < 4
    want = torch.softmax(p.log() / temperature, dim=0).double()
    got = _frequencies(tokens, 4)
    n = tokens.numel()
    sd = (want * (1 - want) / n).sqrt()
    assert ((got - want).abs() <= 5 * sd).all(), (got, want)


def test_sampler_fast_path_is_taken_and_keeps_greedy_rows_exact():
    """Sampler(fused=True): greedy rows equal argmax, sampled rows follow the distribution; rows asking for
    top-k, a seed or logprobs still work (the torch path, or logprobs computed beside the fast path)."""
    gen = torch.Generator().manual_seed(9)
    B = 6
    logits = (torch.randn(B, V, generator=gen) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)] * 2
    s = Sampler(fused=True)
    out = s.sample(logits, params, [None] * B)
    assert s.last_path == "fused"
    greedy = logits.argmax(dim=1).tolist()
    assert out.token_ids[0] == greedy[0] and out.token_ids[3] == greedy[3]
    params_lp = [SamplingParams(temperature=1.0, logprobs=2)] + params[1:]
    out = s.sample(logits, params_lp, [None] * B)
    assert s.last_path == "fused"
    lp = torch.log_softmax(logits[0].float(), dim=0)
    assert out.logprobs[0] == pytest.approx(float(lp[out.token_ids[0]]), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == lp.topk(2).indices.tolist()
    s.sample(logits, [SamplingParams(temperature=1.0, top_k=5)] + params[1:], [None] * B)
    assert s.last_path == "torch"
    g = torch.Generator(device=DEVICE).manual_seed(1)
    s.sample(logits, params, [None, g] + [None] * (B - 2))  # a seeded sampled row
    assert s.last_path == "torch"
    assert Sampler(fused=False).sample(logits, params, [None] * B).token_ids[0] == greedy[0]
    out = s.sample(logits, [SamplingParams(temperature=0.0)] * B, [None] * B)  # all greedy: one argmax in torch
    assert s.last_path == "torch" and out.token_ids == greedy


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fast_path_matches_torch_path_distribution_on_gpu():
    """Qwen3's vocabulary, bf16 logits, batch 64: the fast path's token frequencies over a peaked distribution
    match the torch path's (and the softmax) within 5 standard deviations; greedy rows are bit-exact."""
    torch.manual_seed(0)
    B = 64
    logits = torch.randn(B, V, device="cuda") - 20
    logits[:, 100:108] = torch.linspace(0, 2, 8, device="cuda")
    logits = logits.to(torch.bfloat16)
    params = [SamplingParams(temperature=1.0)] * B
    want = torch.softmax(logits[0].float(), dim=0)[100:108].double()
    counts = {}
    for fused in (True, False):
        s = Sampler(fused=fused)
        toks = torch.tensor([t for _ in range(40) for t in s.sample(logits, params, [None] * B).token_ids])
        assert s.last_path == ("fused" if fused else "torch")
        counts[fused] = _frequencies(toks - 100, 8)
        n = toks.numel()
        sd = (want * (1 - want) / n).sqrt().cpu()
        assert ((counts[fused] - want.cpu()).abs() <= 5 * sd + 1e-3).all(), (fused, counts[fused], want)
    mixed = [SamplingParams(temperature=0.0)] * (B - 1) + [SamplingParams(temperature=1.0)]  # greedy rows in-kernel
    s = Sampler(fused=True)
    got = s.sample(logits, mixed, [None] * B).token_ids
    assert s.last_path == "fused" and got[:-1] == logits[:-1].float().argmax(1).tolist()
    assert math.isclose(float(counts[True].sum()), 1.0, abs_tol=1e-3)  # nothing outside the peak (p < 1e-6)


def test_auto_mode_keeps_cpu_logits_on_the_torch_path():
    s = Sampler()
    s.sample(torch.randn(4, 64), [SamplingParams(temperature=1.0)] * 4, [None] * 4)
    assert s.last_path == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_auto_mode_takes_the_kernel_for_large_cuda_batches_only():
    """Sampler() (auto): the torch path for CUDA batches below FUSED_SAMPLER_MIN_ROWS (slower there end to end on
    the H200 with synchronous scheduling), the kernel from that size; with min_rows=1 (the engine's choice under
    asynchronous scheduling) from one row; Sampler(fused=False) never."""
    from moelora.engine.sampler import FUSED_SAMPLER_MIN_ROWS

    p = SamplingParams(temperature=1.0)
    s = Sampler()
    for rows, path in ((64, "torch"), (FUSED_SAMPLER_MIN_ROWS, "fused")):
        s.sample(torch.randn(rows, 1000, device="cuda"), [p] * rows, [None] * rows)
        assert s.last_path == path, rows
    one = Sampler(min_rows=1)
    one.sample(torch.randn(3, 1000, device="cuda"), [p] * 3, [None] * 3)
    assert one.last_path == "fused"
    off = Sampler(fused=False)
    rows = FUSED_SAMPLER_MIN_ROWS
    off.sample(torch.randn(rows, 1000, device="cuda"), [p] * rows, [None] * rows)
    assert off.last_path == "torch"
