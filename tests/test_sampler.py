"""Sampler, penalties, prompt logprobs and SamplingParams validation (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from moelora.engine.sampler import Sampler, apply_penalties, make_generator, prompt_logprobs
from moelora.engine.sampling_params import SamplingParams

V = 50


def _logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3  # [B, V]


# ---- SamplingParams ---------------------------------------------------------------------------


def test_params_defaults_and_stop_normalized() -> None:
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.max_tokens == 16
    assert SamplingParams().stop == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"n": 0}, "n must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2]"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings"),
    ],
)
def test_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


# ---- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_greedy_is_argmax(batch: int) -> None:
    logits = _logits(batch)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * batch, [None] * batch)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 40]] = 5.0
    out = Sampler().sample(logits, [SamplingParams(temperature=0)], [None])
    assert out.token_ids == [3]


def _seeded_run(logits: torch.Tensor, rows: list[SamplingParams], steps: int) -> list[list[int]]:
    gens = [make_generator(p.seed) for p in rows]
    sampler = Sampler()
    return [sampler.sample(logits, rows, gens).token_ids for _ in range(steps)]


def test_seeded_sampling_reproducible_and_batch_independent() -> None:
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = _seeded_run(_logits(1, seed=5), [target], steps=20)
    again = _seeded_run(_logits(1, seed=5), [target], steps=20)
    assert alone == again
    # the same request in a mixed batch: other rows seeded, unseeded, greedy, filtered
    others = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=99),
    ]
    batch_logits = torch.cat([_logits(2, seed=8), _logits(1, seed=5), _logits(2, seed=9)])  # target is row 2
    rows = others[:2] + [target] + others[2:]
    mixed = _seeded_run(batch_logits, rows, steps=20)
    assert [step[2] for step in mixed] == [step[0] for step in alone]
    # and sampling actually varies over steps (the test would not catch a constant sampler otherwise)
    assert len({step[0] for step in alone}) > 1


def test_unseeded_rows_draw_the_exponential_race_from_the_global_rng() -> None:
    """Every row unseeded (the no-gather path): the tokens of argmax(softmax(x / T) / q), q ~ Exp(1) drawn as one
    [B, V] block from torch's global RNG; a greedy row between them leaves their draws unchanged."""
    logits = _logits(6, seed=2)
    sampler = Sampler()
    torch.manual_seed(7)
    got = sampler.sample(logits, [SamplingParams(temperature=0.8)] * 6, [None] * 6).token_ids
    torch.manual_seed(7)
    q = torch.empty(6, V).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    want = ((logits / 0.8).softmax(-1) / q).argmax(-1).tolist()
    assert got == want
    assert len(set(got)) > 1
    mixed_logits = torch.cat([logits[:3], _logits(1, seed=4), logits[3:]])
    rows = [SamplingParams(temperature=0.8)] * 3 + [SamplingParams(temperature=0)] + [SamplingParams(temperature=0.8)] * 3
    torch.manual_seed(7)
    mixed = sampler.sample(mixed_logits, rows, [None] * 7).token_ids
    assert mixed[:3] + mixed[4:] == want and mixed[3] == int(mixed_logits[3].argmax())


def test_different_seeds_differ() -> None:
    logits = _logits(1, seed=3) / 3  # flat-ish distribution
    a = _seeded_run(logits, [SamplingParams(seed=1)], steps=30)
    b = _seeded_run(logits, [SamplingParams(seed=2)], steps=30)
    assert a != b


def test_sampling_matches_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    gen = make_generator(0)
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[sampler.sample(logits, params, [gen]).token_ids[0]] += 1
    expected = logits[0].softmax(-1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_top_k_1_is_greedy() -> None:
    logits = _logits(5)
    params = [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(5)]
    for _ in range(5):
        out = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = _logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)]
    gen = make_generator(0)
    seen = {Sampler().sample(logits, params, [gen]).token_ids[0] for _ in range(200)}
    assert seen == allowed


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 4
    for _ in range(5):
        assert Sampler().sample(logits, params, [None] * 4).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1} (0.5 < 0.75 <= 0.8)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = make_generator(0)
    seen = {Sampler().sample(logits, [SamplingParams(top_p=0.75)], [gen]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_filters_below_threshold() -> None:
    # probs 0.5, 0.3, 0.15, 0.05 with min_p 0.25: threshold 0.125 drops only token 3
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = make_generator(0)
    seen = {Sampler().sample(logits, [SamplingParams(min_p=0.25)], [gen]).token_ids[0] for _ in range(500)}
    assert seen == {0, 1, 2}


def test_logprobs_match_log_softmax() -> None:
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0.5, logprobs=4, seed=0),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=0),
    ]
    out = Sampler().sample(logits, params, [make_generator(0), None, None])
    ref = torch.log_softmax(logits, -1)
    for b in (0, 2):  # the rows that asked for logprobs
        assert out.logprobs[b] == pytest.approx(ref[b, out.token_ids[b]].item(), abs=1e-5)
    assert out.logprobs[1] is None, "no logprob for a row that did not ask (no [B, V] log-softmax for it)"
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == []
    top = out.top_logprobs[0]
    vals, ids = ref[0].topk(4)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(vals.tolist(), abs=1e-5)


def test_batch_size_mismatch_is_clear_error() -> None:
    with pytest.raises(ValueError, match="2 rows but got 1 params"):
        Sampler().sample(_logits(2), [SamplingParams()], [None])


# ---- penalties ---------------------------------------------------------------------------------


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [[0]], [[1, 1]], [SamplingParams(repetition_penalty=2.0)])
    # prompt token 0 and output token 1 penalized once each, whatever their count
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # input untouched


def test_frequency_presence_penalties_exact_and_output_only() -> None:
    logits = torch.zeros(1, 5)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits, [[4, 4, 4]], [[1, 1, 1, 2]], params)
    # token 1: 3*0.5 + 0.25; token 2: 0.5 + 0.25; prompt token 4: untouched
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0]]


def test_penalties_per_row() -> None:
    logits = torch.ones(3, 4)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(repetition_penalty=4.0)]
    out = apply_penalties(logits, [[0], [0], [0]], [[1], [], [2]], params)
    assert out.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [0.25, 1, 0.25, 1]]
    out = apply_penalties(logits, [[], [], []], [[1], [3, 3], []], params)
    assert out.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]


# ---- prompt logprobs ---------------------------------------------------------------------------


def test_prompt_logprobs_alignment() -> None:
    prompt = [3, 7, 1, 7]
    logits = _logits(len(prompt), vocab=10)  # row i predicts prompt[i + 1]
    res = prompt_logprobs(logits, prompt, k=2)
    assert len(res) == 4 and res[0] is None
    ref = torch.log_softmax(logits, -1)
    for i in range(1, 4):
        entry = res[i]
        assert entry["token_id"] == prompt[i]
        assert entry["logprob"] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-5)
        assert entry["rank"] == 1 + int((ref[i - 1] > ref[i - 1, prompt[i]]).sum())
        vals, ids = ref[i - 1].topk(2)
        assert [t for t, _ in entry["top"]] == ids.tolist()
        assert [lp for _, lp in entry["top"]] == pytest.approx(vals.tolist(), abs=1e-5)


def test_prompt_logprobs_rank_one_for_argmax() -> None:
    logits = torch.full((2, 6), -5.0)
    logits[0, 4] = 5.0  # position 1 is predicted to be 4
    logits[1, 2] = 5.0
    res = prompt_logprobs(logits, [0, 4, 1], k=0)
    assert res[1]["rank"] == 1 and res[1]["top"] == []
    assert res[2]["rank"] == 2  # token 1 ties with 4 others, only token 2 is higher
    assert res[1]["logprob"] == pytest.approx(5 - math.log(math.exp(5) + 5 * math.exp(-5)), abs=1e-5)


def test_prompt_logprobs_too_few_rows() -> None:
    with pytest.raises(ValueError, match="need at least 3 logits rows"):
        prompt_logprobs(torch.zeros(2, 5), [1, 2, 3, 4], k=1)
