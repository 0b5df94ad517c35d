"""The engine through the offline API: parity with transformers + PEFT, batch invariance, continuous
batching, adapter turns, preemption, chunked prefill, and bad inputs."""

import pytest
import torch

from helpers import greedy_ref, peft_logprobs, rows_of, save_byte_tokenizer, save_peft_adapter, save_tiny_model, tmp
from moelora import LLM, SamplingParams

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _adapters(base, d, count: int) -> dict[str, str]:
    paths = {}
    for i in range(count):
        name = f"ad{i}"
        paths[name] = tmp(d, name)
        save_peft_adapter(base, paths[name], 10 + i, r=[4, 8, 16][i % 3], lora_alpha=8,
                          target_modules=ATTN, target_parameters=EXPERTS)
    return paths


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def family_setup(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    base = save_tiny_model(request.param, tmp(d, "m"))
    return d, base, _adapters(base, d, 2)


def test_greedy_and_prompt_logprobs_match_peft(family_setup):
    d, base, paths = family_setup
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=2, max_lora_rank=16, block_size=4)
    names = ["ad0", None, "ad1", "ad0"]
    prompts = rows_of(0, [7, 5, 9, 3])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(prompts, params, adapter=names)
    for p, o, n in zip(prompts, outs, names):
        path = None if n is None else paths[n]
        assert o.token_ids == greedy_ref(base, path, p, 16), f"adapter {n}"
        assert o.finish_reason == "length"
        ref = peft_logprobs(base, path, p)  # [L, V]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            entry = o.prompt_logprobs[i]
            assert abs(entry[p[i]] - ref[i - 1, p[i]].item()) < 1e-4
            top = ref[i - 1].topk(2)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[tid] - lp) < 1e-4
        assert len(o.logprobs) == 16 and all(t in lp for t, lp in zip(o.token_ids, o.logprobs))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    base = save_tiny_model("qwen3_moe", tmp(d, "m"))
    return d, base, _adapters(base, d, 5)


def _free(llm):
    e = llm.engine
    assert e.kv.num_free_blocks == e.kv.num_blocks, "KV blocks leaked"
    assert all(e.pool.refcount(n) == 0 for n in e.list_adapters()), "adapter references leaked"
    assert not e.scheduler.running and not e.scheduler.waiting


def test_batch_invariance(qwen):
    d, base, paths = qwen
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=8, max_lora_rank=16)
    prompts = rows_of(1, [6, 4, 9, 5, 7, 3, 8, 6])
    names = ["ad0", "ad1", "ad2", "ad3", "ad4", None, "ad1", "ad2"]
    alone = llm.generate(prompts[0], GREEDY, adapter="ad0")[0].token_ids
    together = llm.generate(prompts, GREEDY, adapter=names)
    assert together[0].token_ids == alone
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=123)
    solo = llm.generate(prompts[0], sampled, adapter="ad0")[0].token_ids
    mixed = llm.generate(prompts, [sampled] + [SamplingParams(max_tokens=12, temperature=1.0)] * 7, adapter=names)
    assert mixed[0].token_ids == solo
    _free(llm)


def test_continuous_batching_and_counters(qwen):
    d, base, paths = qwen
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=4, max_lora_rank=16, block_size=4)
    e = llm.engine
    prompts = rows_of(2, [5, 8, 6, 4, 7])
    names = ["ad0", None, "ad1", "ad2", "ad0"]
    e.add_request("r0", prompts[0], GREEDY, names[0])
    e.add_request("r1", prompts[1], GREEDY, names[1])
    for _ in range(3):
        e.step()
    assert 0 < len(e.requests["r0"].output_ids) < 16  # r0 is mid-generation when the others arrive
    for i in range(2, 5):
        e.add_request(f"r{i}", prompts[i], GREEDY, names[i])
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    assert steps < 40
    for i, (p, n) in enumerate(zip(prompts, names)):
        req = e.pop_finished(f"r{i}")
        assert req.output_ids == greedy_ref(base, None if n is None else paths[n], p, 16)
    _free(llm)


def test_more_adapters_than_slots(qwen):
    d, base, paths = qwen
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=2, max_lora_rank=16)
    names = ["ad0", "ad1", "ad2", "ad3", "ad4", None, "ad4", "ad0"]
    prompts = rows_of(3, [5] * len(names))
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), adapter=names)
    for p, o, n in zip(prompts, outs, names):
        assert o.token_ids == greedy_ref(base, None if n is None else paths[n], p, 6), n
    _free(llm)


def test_preemption_and_chunked_prefill(qwen):
    d, base, paths = qwen
    # 12 blocks of 2 tokens: four sequences of 5 + 16 tokens cannot all stay resident
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=4, max_lora_rank=16, block_size=2, max_num_batched_tokens=4,
              kv_cache_memory_bytes=12 * _block_bytes(llm_cfg_path=tmp(d, "m"), block_size=2))
    names = ["ad0", "ad1", None, "ad2"]
    prompts = rows_of(4, [5, 9, 6, 5])
    e = llm.engine
    ids = []
    for i, (p, n) in enumerate(zip(prompts, names)):
        e.add_request(f"p{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1), n)
        ids.append(f"p{i}")
    preempted = 0
    while e.has_unfinished_requests():
        e.step()
        preempted = max(preempted, sum(r.num_preemptions for r in e.requests.values()))
    assert preempted > 0, "the test must actually exercise preemption"
    for i, (p, n) in enumerate(zip(prompts, names)):
        req = e.pop_finished(ids[i])
        path = None if n is None else paths[n]
        assert req.output_ids == greedy_ref(base, path, p, 8)
        ref = peft_logprobs(base, path, p)
        assert len(req.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            assert abs(req.prompt_logprobs[j][p[j]] - ref[j - 1, p[j]].item()) < 1e-4
    _free(llm)


def _block_bytes(llm_cfg_path: str, block_size: int) -> int:
    from moelora.config import ModelConfig
    from moelora.engine.kv_cache import KVCache

    return KVCache.bytes_per_block(ModelConfig.from_pretrained(llm_cfg_path), block_size, torch.float32)


def test_bad_inputs_leave_engine_usable(qwen):
    d, base, paths = qwen
    llm = LLM(tmp(d, "m"), adapters={"ad0": paths["ad0"]}, max_loras=2, max_lora_rank=16, max_model_len=32)
    good = rows_of(5, [6])[0]
    with pytest.raises(ValueError, match="unknown adapter 'nope'.*ad0"):
        llm.generate([good, good], GREEDY, adapter=["ad0", "nope"])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="40 tokens.*32"):
        llm.generate([[1] * 40], GREEDY)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[1, 2, 5000]], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text prompt without a tokenizer", GREEDY)
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        llm.generate([good], GREEDY, adapter=["ad0", None])
    _free(llm)
    assert not llm.engine.requests
    out = llm.generate(good, GREEDY, adapter="ad0")[0]
    assert out.token_ids == greedy_ref(base, paths["ad0"], good, 16)


def test_adapter_load_unload_at_run_time(qwen):
    d, base, paths = qwen
    llm = LLM(tmp(d, "m"), max_loras=2, max_lora_rank=16)
    assert llm.list_adapters() == []
    llm.load_adapter("x", paths["ad3"])
    p = rows_of(6, [5])[0]
    assert llm.generate(p, GREEDY, adapter="x")[0].token_ids == greedy_ref(base, paths["ad3"], p, 16)
    e = llm.engine
    e.add_request("busy", p, GREEDY, "x")
    e.step()
    with pytest.raises(RuntimeError, match="used by 1 unfinished"):
        llm.unload_adapter("x")
    e.abort_request("busy")
    e.pop_finished("busy")
    llm.unload_adapter("x")
    assert llm.list_adapters() == [] and e.pool.slot_of("x") is None
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.generate(p, GREEDY, adapter="x")
    _free(llm)


def test_text_stop_strings_and_eos(tmp_path):
    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"), vocab_size=260, eos_token_id=256)
    save_byte_tokenizer(tmp(tmp_path, "m"))
    llm = LLM(tmp(tmp_path, "m"), max_loras=1, max_lora_rank=8)
    tok = llm.tokenizer
    free = llm.generate("hello", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert free.text == tok.decode(free.token_ids) and free.finish_reason == "length"
    ref = greedy_ref(base, None, tok.encode("hello"), 24)
    assert free.token_ids == ref
    # stop at the first generated token id, and at a string taken from the free-running text
    first = free.token_ids[0]
    out = llm.generate("hello", SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[first]))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first and out.text == ""
    if len(free.text) >= 6:
        stop = free.text[3:5]
        out = llm.generate("hello", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == free.text[: free.text.index(stop)]


def test_eos_stops_unless_ignored(tmp_path):
    """The config's eos id ends generation with finish_reason 'stop' (kept in token_ids), unless ignore_eos."""
    save_tiny_model("qwen3_moe", tmp(tmp_path, "probe"))
    p = rows_of(7, [5])[0]
    first = LLM(tmp(tmp_path, "probe"), max_loras=0).generate(p, GREEDY)[0].token_ids[0]
    save_tiny_model("qwen3_moe", tmp(tmp_path, "m"), eos_token_id=first)  # same seed: same weights
    llm = LLM(tmp(tmp_path, "m"), max_loras=0)
    out = llm.generate(p, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    assert len(llm.generate(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids) == 8
