"""Prefix caching keyed by adapter, on tiny random models of every family (CPU, fp32): a request whose prefix is
served from the cache gives the tokens and log-probabilities of the same request with caching off; the same
prompt under different adapters or the base model never shares a block; an adapter reloaded under its name with
other weights never hits the old blocks; evictions and preemptions under memory pressure change no output."""

import pytest
import torch

from helpers import greedy_ref, rows_of, save_peft_adapter, save_tiny_model, tmp
from moelora import LLM, SamplingParams
from moelora.adapters.convert import target_parameters_to_per_expert
from moelora.engine.kv_cache import KVCache
from moelora.engine.prefix_cache import chain_hash

TOL = 1e-5
BS = 4  # KV block size: short prompts span several blocks
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(family)
    base = save_tiny_model(family, tmp(d, "m"))
    attn = MLA if family.startswith("deepseek") else ATTN
    paths = {n: tmp(d, n) for n in "ab"}
    # a: attention + routed experts as PEFT target_parameters (fused 3-D experts)
    save_peft_adapter(base, paths["a"], 1, r=4, lora_alpha=8, target_modules=attn,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    # b: per-expert gate/up/down modules, rsLoRA
    save_peft_adapter(base, paths["b"], 2, r=8, lora_alpha=4, use_rslora=True,
                      target_modules=[attn[0], "o_proj", "gate_proj", "up_proj", "down_proj"])
    # a2d: a converted to per-expert 2-D keys (the third layout)
    paths["a2d"] = tmp(d, "a2d")
    target_parameters_to_per_expert(paths["a"], paths["a2d"], tmp(d, "m"))
    return family, d, base, paths


def llm(model_dir, paths, caching, **kw):
    kw = {"device": "cpu", "max_loras": 4, "max_lora_rank": 16, "block_size": BS, "max_model_len": 128, **kw}
    return LLM(model_dir, adapters=paths, enable_prefix_caching=caching, **kw)


def run(engine, prompts, adapters, max_tokens=4, logprobs=3, **params):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, **params),
                           adapter=adapters)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs or []) for o in outs]


def assert_same(got, want, what):
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(got, want)):
        assert t1 == t2, f"{what}: row {i} tokens {t1} != {t2}"
        for d1, d2 in zip(lp1, lp2):
            assert d1.keys() == d2.keys(), f"{what}: row {i} top tokens differ"
            assert max(abs(d1[k] - d2[k]) for k in d1) < TOL, f"{what}: row {i} logprobs differ"


def hits(engine) -> int:
    return engine.engine.scheduler.prefix_hits


@pytest.mark.parametrize("prefix_len", [13, 12])  # ends mid-block (3 full blocks + 1 token), at a block end
def test_cached_prefix_gives_the_uncached_output(fam, prefix_len):
    family, d, base, paths = fam
    prefix = rows_of(10 + prefix_len, [prefix_len])[0]
    names = [None, "a", "b", "a2d"]
    warm = [prefix + s for s in rows_of(1, [3, 5, 2, 6])]
    test = [prefix + s for s in rows_of(2, [4, 1, 7, 3])]
    on, off = llm(tmp(d, "m"), paths, True), llm(tmp(d, "m"), paths, False)
    run(on, warm, names)
    before = hits(on)
    got = run(on, test, names)
    want = run(off, test, names)
    assert_same(got, want, f"{family} prefix {prefix_len}")
    assert hits(on) - before == len(names) * (prefix_len // BS) * BS  # every row hit its own adapter's blocks
    assert hits(off) == 0
    # prompt log-probabilities: such a request computes every position (the cache holds no logits), same values
    lp_on = on.generate(test, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), adapter=names)
    lp_off = off.generate(test, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), adapter=names)
    for x, y in zip(lp_on, lp_off):
        for dx, dy in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert max(abs(dx[k] - dy[k]) for k in dy) < TOL
    # a later decode step reads a block that a hit shared: one more round with longer outputs still agrees
    assert_same(run(on, test, names, max_tokens=9), run(off, test, names, max_tokens=9), f"{family} long")


def test_same_prompt_under_other_adapters_or_the_base_never_shares(fam):
    family, d, base, paths = fam
    ids = rows_of(7, [14])[0]
    on = llm(tmp(d, "m"), paths, True)
    got = {}
    for name in [None, "a", "b"]:
        before = hits(on)
        (row,) = run(on, [ids], [name], max_tokens=3, ignore_eos=True)
        assert hits(on) == before, f"{family}: adapter {name} hit blocks of another adapter"
        got[name] = row[0]
        assert row[0] == greedy_ref(base, None if name is None else paths[name], ids, 3)  # PEFT's tokens
    (again,) = run(on, [ids], ["b"], max_tokens=3, ignore_eos=True)  # its own blocks: a hit, same tokens
    assert hits(on) > 0 and again[0] == got["b"]


def test_adapter_reloaded_with_other_weights_does_not_hit(fam):
    family, d, base, paths = fam
    ids = rows_of(8, [15])[0]
    on = llm(tmp(d, "m"), {"x": paths["a"]}, True)
    run(on, [ids], ["x"])
    cached = on.engine.kv.num_cached_blocks
    assert cached >= 3
    on.unload_adapter("x")  # unloading makes its blocks unreachable
    assert on.engine.kv.num_cached_blocks == 0
    on.load_adapter("x", paths["b"])
    before = hits(on)
    (row,) = run(on, [ids], ["x"], max_tokens=3, ignore_eos=True)
    assert hits(on) == before and row[0] == greedy_ref(base, paths["b"], ids, 3)
    on.load_adapter("y", paths["b"])  # the same content under a second name shares x's blocks
    before = hits(on)
    (row_y,) = run(on, [ids], ["y"], max_tokens=3, ignore_eos=True)
    assert hits(on) - before == (len(ids) - 1) // BS * BS and row_y[0] == row[0]
    on.unload_adapter("x")  # y still holds that content: its blocks stay
    assert on.engine.kv.num_cached_blocks > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stress_adapters_and_prefixes_under_memory_pressure(tmp_path, async_scheduling):
    """Many requests alternating 3 adapters, the base and 4 prefixes, in a KV cache of 40 blocks: cached blocks are
    evicted, running requests preempted; every output equals the same requests with caching off."""
    base = save_tiny_model("qwen3_moe", str(tmp_path / "m"))
    paths = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b"), "c": str(tmp_path / "c")}
    for i, (n, p) in enumerate(paths.items()):
        save_peft_adapter(base, p, i + 1, r=4, lora_alpha=8, target_modules=ATTN,
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    per_block = KVCache.bytes_per_block(llm(str(tmp_path / "m"), {}, False).engine.kv_config, BS, torch.float32)
    prefixes = rows_of(3, [9, 16, 21, 30])
    names = [None, "a", "b", "c"]
    prompts, adapters = [], []
    for k, suffix in enumerate(rows_of(4, [1 + (k * 5) % 9 for k in range(48)])):
        prompts.append(prefixes[(k // 8) % 4] + suffix)  # pairs of requests share a prefix and an adapter
        adapters.append(names[(k // 2) % 4])
    kw = dict(kv_cache_memory_bytes=40 * per_block, max_num_seqs=16, max_num_batched_tokens=64)
    on = llm(str(tmp_path / "m"), paths, True, async_scheduling=async_scheduling, **kw)
    off = llm(str(tmp_path / "m"), paths, False, **kw)
    for lo in range(0, 48, 16):  # three rounds: later rounds find earlier rounds' prefixes (or their evictions)
        # (rows asking for logprobs keep the synchronous step: the asynchronous variant compares tokens)
        lp = None if async_scheduling else 3
        got = run(on, prompts[lo:lo + 16], adapters[lo:lo + 16], max_tokens=12, logprobs=lp, ignore_eos=True)
        want = run(off, prompts[lo:lo + 16], adapters[lo:lo + 16], max_tokens=12, logprobs=lp, ignore_eos=True)
        assert_same(got, want, f"round {lo // 16}")
    e = on.engine
    assert hits(on) > 0 and e.kv.evictions > 0 and e.scheduler.num_preemptions > 0
    assert e.kv.num_free_blocks == e.kv.num_blocks and not e.has_unfinished_requests()
    if async_scheduling:
        assert e.ahead_steps > 0


def test_block_names_chain_identity_and_tokens():
    a = chain_hash(None, "base", [1, 2, 3, 4])
    assert a == chain_hash(None, "base", [1, 2, 3, 4])
    assert a != chain_hash(None, "lora:x", [1, 2, 3, 4]) and a != chain_hash(None, "base", [1, 2, 3, 5])
    assert chain_hash(a, "base", [5, 6, 7, 8]) != chain_hash(None, "base", [5, 6, 7, 8])
