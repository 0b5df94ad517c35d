"""Asynchronous scheduling (engine/async_step.py): the next decode step launched from the device tokens of the
last one before they are read. Greedy outputs must equal the synchronous engine's whatever ends the requests
(length, EOS, stop tokens, stop strings, aborts) and whatever joins mid-run; rows that need the host's tokens
(logprobs, penalties) keep the synchronous step; no placeholder ever reaches an output."""

import pytest

from helpers import rows_of, save_byte_tokenizer, save_peft_adapter, save_tiny_model, tmp
from moelora import LLM, SamplingParams
from moelora.engine.async_step import PLACEHOLDER

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    base = save_tiny_model("qwen3_moe", tmp(d, "m"), vocab_size=260, eos_token_id=256)
    save_byte_tokenizer(tmp(d, "m"))
    paths = {}
    for i in range(2):
        paths[f"ad{i}"] = tmp(d, f"ad{i}")
        save_peft_adapter(base, paths[f"ad{i}"], 20 + i, r=8, lora_alpha=8, target_modules=ATTN,
                          target_parameters=EXPERTS)
    return tmp(d, "m"), paths


def _llm(setup, async_scheduling: bool, **kw) -> LLM:
    model, paths = setup
    return LLM(model, adapters=paths, max_loras=2, max_lora_rank=8, block_size=4,
               async_scheduling=async_scheduling, **kw)


def _run(setup, async_scheduling, prompts, params, adapters, **kw):
    llm = _llm(setup, async_scheduling, **kw)
    outs = llm.generate(prompts, params, adapter=adapters)
    return outs, llm.engine


def _params():
    """Requests that end at different, data-dependent steps: by length (3..20 tokens), on stop tokens drawn from
    the synchronous run's own outputs, with and without EOS."""
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=e) for m, e in
            [(20, True), (3, True), (11, False), (17, True), (8, False), (20, False)]]


def test_greedy_outputs_equal_the_synchronous_engine(setup):
    prompts = rows_of(1, [5, 9, 3, 12, 7, 4], vocab=250)
    adapters = ["ad0", None, "ad1", "ad0", "ad1", None]
    sync, _ = _run(setup, False, prompts, _params(), adapters)
    # stop tokens that some requests produce mid-way (from the synchronous run), so they stop on EOS-like ids
    params = _params()
    for p, o in zip(params[3:], sync[3:]):
        p.stop_token_ids = [o.token_ids[len(o.token_ids) // 2]]
    sync, _ = _run(setup, False, prompts, params, adapters)
    got, engine = _run(setup, True, prompts, params, adapters)
    assert engine.ahead_steps > 5, "the asynchronous path never ran"
    for s, g in zip(sync, got):
        assert g.token_ids == s.token_ids and g.finish_reason == s.finish_reason and g.text == s.text
        assert PLACEHOLDER not in g.token_ids
    assert any(o.finish_reason == "stop" for o in got) and any(o.finish_reason == "length" for o in got)


def test_stop_strings_and_requests_joining_mid_run(setup):
    """Stop strings (found after detokenizing: the request was already scheduled ahead) and a small max_num_seqs
    (requests wait and join as others finish: those steps fall back to the synchronous order)."""
    prompts = rows_of(2, [6, 4, 8, 5, 3], vocab=250)
    base = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    sync, _ = _run(setup, False, prompts, base, None, max_num_seqs=2)
    stop = [s.text[3:5] for s in sync if len(s.text) >= 5][:2]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop=stop)
    sync, _ = _run(setup, False, prompts, params, None, max_num_seqs=2)
    got, engine = _run(setup, True, prompts, params, None, max_num_seqs=2)
    assert engine.ahead_steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    assert [o.text for o in got] == [o.text for o in sync]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in sync]


def test_abort_while_a_step_is_in_flight(setup):
    """An abort between steps, while a step holding the request is in flight: it finishes with the tokens read
    so far (its in-flight token is dropped, no placeholder) and the others go on exactly as in the synchronous
    engine."""
    prompts = rows_of(3, [5, 6, 7], vocab=250)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in (False, True):
        engine = _llm(setup, mode).engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        for _ in range(4):
            engine.step()
        if mode:  # a step holding r1 is in flight, its token not in r1's outputs yet
            assert engine._pending is not None and engine.requests["r1"] in engine._pending.requests
        engine.abort_request("r1")
        while engine.has_unfinished_requests():
            engine.step()
        results[mode] = {rid: (list(r.output_ids), r.finish_reason) for rid, r in engine.requests.items()}
    assert results[True]["r1"][1] == "abort" and PLACEHOLDER not in results[True]["r1"][0]
    for rid in ("r0", "r2"):
        assert results[True][rid] == results[False][rid]
    # the aborted request kept a prefix of its synchronous tokens
    assert results[False]["r1"][0][: len(results[True]["r1"][0])] == results[True]["r1"][0]


def test_rows_wanting_logprobs_or_penalties_stay_synchronous(setup):
    prompts = rows_of(4, [5, 6], vocab=250)
    for params in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)):
        sync, _ = _run(setup, False, prompts, params, None)
        got, engine = _run(setup, True, prompts, params, None)
        assert engine.ahead_steps == 0
        assert [o.token_ids for o in got] == [o.token_ids for o in sync]


def test_a_token_budget_below_the_batch_keeps_the_synchronous_order(setup):
    """max_num_batched_tokens 2 with 3 decoding requests: the scheduler serves them in turns (a step serves fewer
    requests than are running: nothing is scheduled ahead then), ahead again once two remain; the outputs are
    the synchronous engine's."""
    prompts = rows_of(5, [2, 2, 2], vocab=250)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sync, _ = _run(setup, False, prompts, params, None, max_num_batched_tokens=2)
    got, engine = _run(setup, True, prompts, params, None, max_num_batched_tokens=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]


def test_the_default_is_on_for_a_gpu_off_on_the_cpu(setup):
    import torch

    from moelora.engine.llm_engine import resolve_async_scheduling

    assert resolve_async_scheduling(None, torch.device("cuda", 0)) is True
    assert resolve_async_scheduling(None, torch.device("cpu")) is False
    assert resolve_async_scheduling(False, torch.device("cuda", 0)) is False
    assert resolve_async_scheduling(True, torch.device("cpu")) is True
    engine = _llm(setup, None).engine
    assert engine.async_scheduling is (engine.device.type == "cuda")
    assert _llm(setup, True).engine.async_scheduling is True


def test_the_engine_takes_the_one_pass_sampler_from_one_row_when_asynchronous(setup):
    """Under asynchronous scheduling the sampler's launches hide behind the GPU: the one-pass kernel from one row
    (faster at batch 64 and 128 on the H200 then); synchronous engines keep 256."""
    from moelora.engine.sampler import FUSED_SAMPLER_MIN_ROWS

    assert _llm(setup, True).engine.sampler.min_rows == 1
    assert _llm(setup, False).engine.sampler.min_rows == FUSED_SAMPLER_MIN_ROWS == 256


def test_a_step_that_computed_prompt_tokens_is_a_prefill_step(setup):
    """step() may run two executions (a step, then the next launched ahead): last_step_prefill (the server's step
    kind on /metrics) is set when any of them computed prompt tokens, and only then. Requests join mid-run, so
    prefills land in calls that also launch a step ahead."""
    llm = _llm(setup, True, max_num_seqs=2)
    engine = llm.engine
    runs: list[list[int]] = []
    execute = engine._execute

    def recording(chunks, *a, **k):
        runs[-1].extend(c.num_tokens for c in chunks)
        return execute(chunks, *a, **k)

    engine._execute = recording
    for i, (p, n) in enumerate(zip(rows_of(3, [6, 4, 8, 5], vocab=250), (9, 3, 6, 4))):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), None)
    kinds = []
    while engine.has_unfinished_requests():
        runs.append([])
        engine.step()
        kinds.append((engine.last_step_prefill, any(t > 1 for t in runs[-1])))
    assert engine.ahead_steps > 0
    assert all(flag == truth for flag, truth in kinds), kinds
    assert sum(truth for _, truth in kinds) >= 2 and not all(truth for _, truth in kinds)
