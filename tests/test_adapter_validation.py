"""Adapter validation: every malformed or unsupported adapter is refused with an AdapterError that
names the adapter, the tensor at fault (where one is) and what was expected vs found, and a refused
load leaves the registry (and the adapter already being served) exactly as it was.

Every bad adapter starts as a copy of one valid adapter saved by PEFT itself and is corrupted in one
specific way. The reference for "still serves correctly" is PEFT's own forward pass."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, save_tiny_model, tmp
from safetensors.torch import load_file, save_file

from moelora.adapters import registry as registry_mod
from moelora.adapters.errors import AdapterError

ST, BIN, CFG = "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json"
P = "base_model.model.model.layers."
R, ALPHA = 6, 12  # r * E = 48 differs from H = 32, so a transposed fused-expert factor is never square
GOOD_LORA = dict(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "o_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

# keys of the good adapter (qwen3_moe tiny: layer 0 has routed experts, layer 1 is a dense MLP)
Q0A, Q0B = P + "0.self_attn.q_proj.lora_A.weight", P + "0.self_attn.q_proj.lora_B.weight"
V0A, V0B = P + "0.self_attn.v_proj.lora_A.weight", P + "0.self_attn.v_proj.lora_B.weight"
Q1A, Q1B = P + "1.self_attn.q_proj.lora_A.weight", P + "1.self_attn.q_proj.lora_B.weight"
O1A, O1B = P + "1.self_attn.o_proj.lora_A.weight", P + "1.self_attn.o_proj.lora_B.weight"
GUA, GUB = P + "0.mlp.experts.base_layer.lora_A.weight", P + "0.mlp.experts.base_layer.lora_B.weight"  # gate_up
DNA, DNB = P + "0.mlp.experts.lora_A.weight", P + "0.mlp.experts.lora_B.weight"  # down


def shape(t) -> str:
    return str(list(t.shape))  # the loader prints shapes as lists: "[48, 32]"


# ---------------------------------------------------------------------------------------------- fixtures


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapter_validation")
    base = save_tiny_model("qwen3_moe", tmp(d, "model"))
    good = tmp(d, "good")
    save_peft_adapter(base, good, 1, **GOOD_LORA)
    good_tensors = load_file(os.path.join(good, ST))
    E, H, inter = base.config.num_experts, base.config.hidden_size, base.config.moe_intermediate_size
    # the fused-expert keys are where ARCHITECTURE.md says; gate_up vs down told apart by shapes
    assert list(good_tensors[GUA].shape) == [R * E, H] and list(good_tensors[GUB].shape) == [2 * inter, R * E]
    assert list(good_tensors[DNA].shape) == [R * E, inter] and list(good_tensors[DNB].shape) == [H, R * E]
    assert {Q0A, Q0B, V0A, V0B, Q1A, Q1B, O1A, O1B} <= set(good_tensors)
    ids, ids_base = rows_of(11, [9, 6])
    runner = Runner(os.path.join(d, "model"))
    runner.load("good", good)
    return dict(
        dir=d, base=base, model=os.path.join(d, "model"), good=good, good_tensors=good_tensors, runner=runner,
        ids=ids, ids_base=ids_base, ref_good=peft_logprobs(base, good, ids), ref_base=peft_logprobs(base, None, ids_base),
    )


@pytest.fixture
def runner(env):
    """The module's runner (the good adapter loaded and pinned); whatever a test loads besides is dropped after it."""
    r = env["runner"]
    yield r
    for name in list(r.registry.names):
        if name != "good":
            r.pool.evict(name)
            r.registry.unload(name)
    for name in list(r.pool.resident):
        if name != "good":
            r.pool.evict(name)


@pytest.fixture
def bad(env, tmp_path):
    """A fresh copy of the good adapter folder, to be corrupted."""
    path = str(tmp_path / "bad")
    shutil.copytree(env["good"], path)
    return path


# ---------------------------------------------------------------------------------------------- helpers


def edit_config(path, fn) -> None:
    with open(os.path.join(path, CFG)) as f:
        cfg = json.load(f)
    cfg = fn(cfg)
    with open(os.path.join(path, CFG), "w") as f:
        json.dump(cfg, f)


def set_config(**fields):
    return lambda cfg: {**cfg, **fields}


def edit_tensors(path, fn) -> dict[str, torch.Tensor]:
    tensors = load_file(os.path.join(path, ST))
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, ST))
    return tensors


def assert_good_still_serves(env, runner) -> None:
    out = runner.logprobs([(env["ids"], "good"), (env["ids_base"], None)])
    assert (out[0] - env["ref_good"]).abs().max().item() < 1e-4
    assert (out[1] - env["ref_base"]).abs().max().item() < 1e-4


def assert_rejected(env, runner, path, *substrings, tensor=None, name="bad") -> AdapterError:
    """registry.load(name, path) raises AdapterError naming `name`, the offending tensor (a key, a set of
    acceptable keys, or None for none) and every substring; the registry and the served adapter are unchanged."""
    reg = runner.registry
    names, good_adapter, resident = list(reg.names), reg.get("good"), runner.pool.resident
    with pytest.raises(AdapterError) as ei:
        reg.load(name, path)
    err, msg = ei.value, str(ei.value)
    assert err.adapter == name and repr(name) in msg, msg
    if tensor is None:
        assert err.tensor is None, msg
    else:
        allowed = {tensor} if isinstance(tensor, str) else set(tensor)
        assert err.tensor in allowed and repr(err.tensor) in msg, msg
    for s in substrings:
        assert s in msg, f"{s!r} not in: {msg}"
    assert reg.names == names and "bad" not in reg
    assert reg.get("good") is good_adapter and reg.path("good") == env["good"]
    assert runner.pool.resident == resident
    assert_good_still_serves(env, runner)
    return err


# ---------------------------------------------------------------------------------------------- 1. files


def _garbage(path, file):
    with open(os.path.join(path, file), "wb") as f:
        f.write(bytes(range(256)) * 7)


def _truncate(path, file):
    with open(os.path.join(path, file), "rb") as f:
        data = f.read()
    with open(os.path.join(path, file), "wb") as f:
        f.write(data[: len(data) // 2])


def _to_bin(path):
    torch.save(load_file(os.path.join(path, ST)), os.path.join(path, BIN))
    os.remove(os.path.join(path, ST))


FILE_CASES = {
    "missing_folder": (lambda p: shutil.rmtree(p), ["does not exist"]),
    "no_adapter_config": (lambda p: os.remove(os.path.join(p, CFG)), [CFG, "missing"]),
    "no_weights_file": (lambda p: os.remove(os.path.join(p, ST)), [ST, BIN]),
    "garbage_safetensors": (lambda p: _garbage(p, ST), ["cannot read", ST]),
    "truncated_safetensors": (lambda p: _truncate(p, ST), ["cannot read", ST]),
    "garbage_bin": (lambda p: (os.remove(os.path.join(p, ST)), _garbage(p, BIN)), ["cannot read", BIN]),
    "bin_not_a_dict_of_tensors": (lambda p: (_to_bin(p), torch.save([torch.zeros(2)], os.path.join(p, BIN))),
                                  ["cannot read", BIN, "dict of tensors"]),
    "no_tensors": (lambda p: save_file({}, os.path.join(p, ST)), ["no LoRA weights"]),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_rejects_unreadable_adapter(env, runner, bad, case):
    corrupt, expect = FILE_CASES[case]
    corrupt(bad)
    assert_rejected(env, runner, bad, *expect)


# ---------------------------------------------------------------------------------------------- 2. config


def _raw_config(text):
    def corrupt(path):
        with open(os.path.join(path, CFG), "w") as f:
            f.write(text)
    return corrupt


def _without(key):
    return lambda p: edit_config(p, lambda c: {k: v for k, v in c.items() if k != key})


CONFIG_CASES = {
    "invalid_json": (_raw_config('{"r": 6, "lora_alpha": '), [CFG, "not valid JSON"]),
    "json_list": (_raw_config("[6, 12]"), [CFG, "JSON object", "list"]),
    "json_string": (_raw_config('"lora"'), [CFG, "JSON object", "str"]),
    "r_missing": (_without("r"), ["'r'", "missing"]),
    "r_string": (lambda p: edit_config(p, set_config(r="six")), ["'r'", "integer", "'six'"]),
    "r_numeric_string": (lambda p: edit_config(p, set_config(r="6")), ["'r'", "integer", "'6'"]),
    "r_fraction": (lambda p: edit_config(p, set_config(r=6.5)), ["'r'", "integer", "6.5"]),
    "r_bool": (lambda p: edit_config(p, set_config(r=True)), ["'r'", "integer", "True"]),
    "r_null": (lambda p: edit_config(p, set_config(r=None)), ["'r'", "integer", "None"]),
    "r_zero": (lambda p: edit_config(p, set_config(r=0)), ["'r'", "positive", "0"]),
    "r_negative": (lambda p: edit_config(p, set_config(r=-6)), ["'r'", "positive", "-6"]),
    "lora_alpha_string": (lambda p: edit_config(p, set_config(lora_alpha="big")), ["'lora_alpha'", "'big'"]),
    "lora_alpha_nan": (lambda p: edit_config(p, set_config(lora_alpha=float("nan"))), ["'lora_alpha'", "nan"]),
    "rank_pattern_list": (lambda p: edit_config(p, set_config(rank_pattern=["q_proj"])), ["'rank_pattern'", "list"]),
    "rank_pattern_value": (lambda p: edit_config(p, set_config(rank_pattern={"q_proj": "eight"})),
                           ["'rank_pattern'", "q_proj", "'eight'"]),
    "alpha_pattern_value": (lambda p: edit_config(p, set_config(alpha_pattern={"v_proj": [32]})),
                            ["'alpha_pattern'", "v_proj", "[32]"]),
    "peft_type_not_lora": (lambda p: edit_config(p, set_config(peft_type="IA3")), ["peft_type", "IA3", "LoRA"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_rejects_malformed_config(env, runner, bad, case):
    corrupt, expect = CONFIG_CASES[case]
    corrupt(bad)
    assert_rejected(env, runner, bad, *expect)


# ---------------------------------------------------------------------------------------------- 3./4. DoRA, tokens, embeddings


def _add_tensor(key, make):
    return lambda p: edit_tensors(p, lambda t: t.__setitem__(key, make(t)))


MAG = P + "0.self_attn.q_proj.lora_magnitude_vector"
EMB_W = "base_model.model.model.embed_tokens.weight"
EMB_A = "base_model.model.model.embed_tokens.lora_embedding_A"

UNSUPPORTED_CASES = {
    "use_dora_config": (lambda p: edit_config(p, set_config(use_dora=True)), ["use_dora", "DoRA"], None),
    "dora_magnitude_tensor": (_add_tensor(MAG, lambda t: torch.ones(t[Q0B].shape[0])), ["DoRA"], MAG),
    "modules_to_save_lm_head": (lambda p: edit_config(p, set_config(modules_to_save=["lm_head"])),
                                ["modules_to_save", "lm_head"], None),
    "modules_to_save_embed_tokens": (lambda p: edit_config(p, set_config(modules_to_save=["embed_tokens"])),
                                     ["modules_to_save", "embed_tokens"], None),
    "trainable_token_indices": (lambda p: edit_config(p, set_config(trainable_token_indices=[3, 5])),
                                ["trainable_token_indices"], None),
    "stray_embed_tokens_weight": (_add_tensor(EMB_W, lambda t: torch.zeros(97, 32)), ["not a LoRA factor"], EMB_W),
    "stray_resized_embed_tokens": (_add_tensor(EMB_W, lambda t: torch.zeros(99, 32)), ["not a LoRA factor"], EMB_W),
    "lora_embedding_A": (_add_tensor(EMB_A, lambda t: torch.zeros(R, 97)), ["embedding"], EMB_A),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED_CASES))
def test_rejects_dora_and_token_changes(env, runner, bad, case):
    corrupt, expect, key = UNSUPPORTED_CASES[case]
    corrupt(bad)
    assert_rejected(env, runner, bad, *expect, tensor=key)


def test_rejects_peft_saved_embedding_lora(env, runner):
    """An adapter PEFT itself wrote with LoRA on embed_tokens (PEFT then also saves the full embedding)."""
    path = tmp(env["dir"], "embed_lora")
    save_peft_adapter(env["base"], path, 5, r=R, lora_alpha=ALPHA, target_modules=["q_proj", "embed_tokens"])
    keys = {k for k in load_file(os.path.join(path, ST)) if "embed_tokens" in k}
    assert any("lora_embedding_A" in k for k in keys)
    assert_rejected(env, runner, path, "embed", tensor=keys)


# ---------------------------------------------------------------------------------------------- 5. rank above max_lora_rank


def test_rejects_rank_above_max_lora_rank(env):
    big = tmp(env["dir"], "rank16")
    save_peft_adapter(env["base"], big, 3, r=16, lora_alpha=16, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    small = Runner(env["model"], max_lora_rank=8)
    small.load("good", env["good"])
    assert_rejected(env, small, big, "rank 16", "max_lora_rank=8", "--max-lora-rank 16")


# ---------------------------------------------------------------------------------------------- 6. unknown targets


def _copy_module(src_prefix, dst_prefix):
    def fn(t):
        for k in [k for k in t if k.startswith(src_prefix + ".lora_")]:
            t[dst_prefix + k[len(src_prefix):]] = t[k].clone()
    return lambda p: edit_tensors(p, fn)


def _new_module(prefix, a_shape, b_shape):
    def fn(t):
        t[prefix + ".lora_A.weight"] = torch.randn(*a_shape)
        t[prefix + ".lora_B.weight"] = torch.randn(*b_shape)
    return lambda p: edit_tensors(p, fn)


TARGET_CASES = {  # corrupt, substrings, offending tensor
    "layer_7_q_proj": (_copy_module(P + "0.self_attn.q_proj", P + "7.self_attn.q_proj"),
                       ["model.layers.7.self_attn.q_proj", "2 layers"], P + "7.self_attn.q_proj.lora_A.weight"),
    "dense_mlp_foo_proj": (_new_module(P + "1.mlp.foo_proj", (R, 32), (40, R)), ["model.layers.1.mlp.foo_proj"],
                           P + "1.mlp.foo_proj.lora_A.weight"),
    "moe_mlp_foo_proj": (_new_module(P + "0.mlp.foo_proj", (R, 32), (12, R)), ["model.layers.0.mlp.foo_proj"],
                         P + "0.mlp.foo_proj.lora_A.weight"),
    "experts_on_dense_layer": (_copy_module(P + "0.mlp.experts", P + "1.mlp.experts"), ["model.layers.1.mlp.experts"],
                               {P + "1.mlp.experts.lora_A.weight", P + "1.mlp.experts.base_layer.lora_A.weight"}),
    "expert_index_out_of_range": (_new_module(P + "0.mlp.experts.8.down_proj", (R, 12), (32, R)),
                                  ["expert index 8", "8 experts"], P + "0.mlp.experts.8.down_proj.lora_A.weight"),
    "same_target_twice": (_new_module(P + "0.mlp.experts.3.gate_proj", (R, 32), (12, R)),
                          ["model.layers.0.mlp.experts.gate_proj", "twice"],
                          {P + "0.mlp.experts.3.gate_proj.lora_A.weight", GUA}),
}


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_rejects_unknown_target(env, runner, bad, case):
    corrupt, expect, key = TARGET_CASES[case]
    corrupt(bad)
    assert_rejected(env, runner, bad, *expect, tensor=key)


# ---------------------------------------------------------------------------------------------- 7. shapes


def _transpose(key):
    return lambda t: t.__setitem__(key, t[key].T)


def _swap(ka, kb):
    def fn(t):
        t[ka], t[kb] = t[kb], t[ka]
    return fn


def _set(key, make):
    return lambda t: t.__setitem__(key, make(t[key]))


SHAPE_CASES = {  # tensor edit, keys any one of which may be blamed
    "dense_lora_B_wrong_out": (_set(V0B, lambda x: torch.randn(x.shape[0] + 1, x.shape[1])), [V0B]),
    "dense_lora_A_wrong_in": (_set(O1A, lambda x: torch.randn(x.shape[0], x.shape[1] + 1)), [O1A]),
    "fused_gate_up_lora_A_transposed": (_transpose(GUA), [GUA]),
    "fused_down_lora_A_transposed": (_transpose(DNA), [DNA]),
    "fused_down_lora_B_transposed": (_transpose(DNB), [DNB]),
    "fused_gate_up_A_B_swapped": (_swap(GUA, GUB), [GUA, GUB]),
    "fused_down_A_B_swapped": (_swap(DNA, DNB), [DNA, DNB]),
    "dense_square_A_B_swapped": (_swap(Q0A, Q0B), [Q0A, Q0B]),
    "dense_A_B_swapped": (_swap(V0A, V0B), [V0A, V0B]),
    "dense_rank_mismatch_B": (_set(Q1B, lambda x: x[:, :-1]), [Q1B]),
    "dense_rank_mismatch_A": (_set(V0A, lambda x: x[:-1]), [V0A]),
    "fused_rank_mismatch_B": (_set(DNB, lambda x: x[:, :-8]), [DNB]),
    "fused_lora_A_3d": (_set(GUA, lambda x: x.reshape(8, R, -1)), [GUA]),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_rejects_shape_mismatch(env, runner, bad, case):
    edit, keys = SHAPE_CASES[case]
    found = edit_tensors(bad, edit)
    err = assert_rejected(env, runner, bad, tensor=keys)
    # what was expected (the valid adapter's shape of that tensor) and what was found
    expected, got = shape(env["good_tensors"][err.tensor]), shape(found[err.tensor])
    assert expected != got and expected in str(err) and got in str(err), str(err)


def test_rejects_adapter_for_another_base_model(env, runner):
    other_dir = tmp(env["dir"], "other_model")
    other = save_tiny_model("qwen3_moe", other_dir, seed=4, hidden_size=48)
    path = tmp(env["dir"], "other_adapter")
    save_peft_adapter(other, path, 4, **GOOD_LORA)
    found = load_file(os.path.join(path, ST))
    assert set(found) == set(env["good_tensors"])  # same targets, same rank; only the hidden size differs
    err = assert_rejected(env, runner, path, tensor=set(found))
    expected, got = shape(env["good_tensors"][err.tensor]), shape(found[err.tensor])
    assert expected != got and expected in str(err) and got in str(err), str(err)


# ---------------------------------------------------------------------------------------------- 8. NaN / Inf


@pytest.mark.parametrize("key", [V0B, GUA], ids=["dense_lora_B", "fused_lora_A"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_rejects_non_finite(env, runner, bad, key, value):
    def fn(t):
        x = t[key].clone()
        x.view(-1)[x.numel() // 2] = value
        t[key] = x
    edit_tensors(bad, fn)
    assert_rejected(env, runner, bad, "NaN" if value != value else "Inf", tensor=key)


# ---------------------------------------------------------------------------------------------- 9. missing factor


@pytest.mark.parametrize("drop,keep", [(Q0B, Q0A), (DNA, DNB)], ids=["dense_no_lora_B", "fused_no_lora_A"])
def test_rejects_missing_factor(env, runner, bad, drop, keep):
    edit_tensors(bad, lambda t: t.pop(drop))
    assert_rejected(env, runner, bad, "lora_A", "lora_B", tensor=keep)


# ---------------------------------------------------------------------------------------------- 10. name taken


def test_rejects_name_already_loaded(env, runner):
    assert_rejected(env, runner, env["good"], "already loaded", repr(env["good"]), name="good")


def test_concurrent_loads_of_one_name_keep_one(env, runner, monkeypatch):
    """Two loads of the same name racing: exactly one wins, the other is refused (not silently replaced)."""
    real = registry_mod.load_adapter
    barrier = threading.Barrier(2, timeout=30)

    def slow_load(*args, **kwargs):
        adapter = real(*args, **kwargs)
        barrier.wait()  # both loads have passed the name check and read their files
        return adapter

    monkeypatch.setattr(registry_mod, "load_adapter", slow_load)
    results: list = [None, None]

    def go(i):
        try:
            results[i] = runner.registry.load("twin", env["good"])
        except Exception as e:  # noqa: BLE001 - collected and checked below
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], AdapterError) and "already loaded" in str(errors[0])
    winner = next(r for r in results if not isinstance(r, Exception))
    assert runner.registry.get("twin") is winner


# ---------------------------------------------------------------------------------------------- accepted variants


def _assert_serves_like_peft(env, runner, name, path, seed=0):
    runner.load(name, path)
    ids, ids2 = rows_of(seed, [8, 5])
    out = runner.logprobs([(ids, name), (ids2, "good"), (env["ids_base"], None)])
    ref = peft_logprobs(env["base"], path, ids)
    assert (out[0] - ref).abs().max().item() < 1e-4
    assert (out[1] - peft_logprobs(env["base"], env["good"], ids2)).abs().max().item() < 1e-4
    assert (out[2] - env["ref_base"]).abs().max().item() < 1e-4
    # the adapter changes the output: a loader that dropped it would fail the comparison above
    assert (ref - peft_logprobs(env["base"], None, ids)).abs().max().item() > 1e-2


def test_bin_format_loads_like_peft(env, runner, bad):
    _to_bin(bad)
    assert not os.path.exists(os.path.join(bad, ST)) and os.path.isfile(os.path.join(bad, BIN))
    _assert_serves_like_peft(env, runner, "old_format", bad)


@pytest.mark.parametrize(
    "rank_pattern,alpha_pattern",
    [({"q_proj": 8}, {"v_proj": 32}), ({"down_proj": 2, "layers.1.self_attn.q_proj": 3}, {"gate_up_proj": 3.5})],
    ids=["attention", "experts_and_layer"],
)
def test_rank_and_alpha_pattern_honoured(env, runner, rank_pattern, alpha_pattern):
    path = tmp(env["dir"], "pattern_" + "_".join(rank_pattern).replace(".", "_"))
    save_peft_adapter(env["base"], path, 7, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, **GOOD_LORA)
    with open(os.path.join(path, CFG)) as f:
        cfg = json.load(f)
    assert cfg["rank_pattern"] == rank_pattern and cfg["alpha_pattern"] == alpha_pattern
    # the patterns really changed the adapter PEFT wrote (so the comparison below exercises them)
    tensors, E = load_file(os.path.join(path, ST)), env["base"].config.num_experts
    ranks = {Q0A: rank_pattern.get("q_proj", R), Q1A: rank_pattern.get("layers.1.self_attn.q_proj", rank_pattern.get("q_proj", R)),
             DNA: E * rank_pattern.get("down_proj", R)}
    assert {k: tensors[k].shape[0] for k in ranks} == ranks and set(ranks.values()) != {R}
    _assert_serves_like_peft(env, runner, "pattern", path, seed=1)
    for module, alpha in [("model.layers.0.self_attn.v_proj", alpha_pattern.get("v_proj", ALPHA)),
                          ("model.layers.0.mlp.experts.gate_proj", alpha_pattern.get("gate_up_proj", ALPHA))]:
        assert runner.registry.get("pattern").modules[module].scaling == pytest.approx(alpha / R)


def test_missing_lora_alpha_defaults_like_peft(env, runner, bad):
    """A hand-written config without lora_alpha: PEFT's LoraConfig default applies (8), not alpha = r."""
    edit_config(bad, lambda c: {k: v for k, v in c.items() if k != "lora_alpha"})
    _assert_serves_like_peft(env, runner, "no_alpha", bad, seed=2)


def test_unload_then_load_again(env, runner):
    other = tmp(env["dir"], "second")
    save_peft_adapter(env["base"], other, 9, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj"])
    _assert_serves_like_peft(env, runner, "x", env["good"], seed=3)
    runner.pool.evict("x")
    runner.registry.unload("x")
    assert "x" not in runner.registry and runner.pool.slot_of("x") is None
    with pytest.raises(KeyError):
        runner.registry.get("x")
    # the same name, now another adapter: nothing of the first one may remain
    _assert_serves_like_peft(env, runner, "x", other, seed=3)
    assert runner.registry.path("x") == other
    runner.pool.evict("x")
    runner.registry.unload("x")
    _assert_serves_like_peft(env, runner, "x", env["good"], seed=3)
