"""DeepSeek-V2/V3 (MLA with a paged latent cache, dense first layer, shared experts, grouped routing) vs
transformers + PEFT on tiny random models, fp32, every position's log-probs within 1e-4.

Variants (helpers.deepseek_tiny): V2 without q_lora_rank and group-limited routing; V2 with q_lora_rank, greedy
routing, attention biases, routed scaling 1.5 and YaRN; V3 with q_lora_rank, noaux_tc (sigmoid scores, nonzero
score-correction bias, 4 groups of which 2 are searched), norm_topk_prob, routed scaling 2.5 and YaRN.

Adapters a, b, c are written by PEFT (attention incl. kv_b_proj, routed experts through target_parameters; PEFT
0.21 turns gate/up/down targets into routed-expert ones). Adapter m is per-module 2-D LoRA on the dense layer's
MLP, the shared experts and kv_b_proj, as other trainers write it; its reference is the base model with each
LoRA product merged into the weight. A mixed batch's reference is one run per adapter, rows picked out.
"""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from helpers import Runner, greedy_ref, rows_of, save_tiny_model, tmp
from moelora.layers.lora_batch import LoRABatch
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache

TOL = 1e-4
VARIANTS = ["deepseek_v2", "deepseek_v2_q", "deepseek_v3"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MANUAL_R, MANUAL_ALPHA = 6, 12


pytestmark = pytest.mark.usefixtures("one_thread")


def q_modules(base) -> list[str]:
    return ["q_proj"] if base.config.q_lora_rank is None else ["q_a_proj", "q_b_proj"]


def save_adapter(base, path: str, seed: int, **lora_kwargs):
    """A PEFT adapter with random nonzero factors, saved by PEFT; returns the PEFT model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model.eval()


def save_manual_adapter(base, path: str, seed: int):
    """Per-module 2-D LoRA on the dense MLP (layer 0), the shared experts and kv_b_proj (every layer); returns
    the base model with every LoRA product merged in (the reference)."""
    g = torch.Generator().manual_seed(seed)
    merged = copy.deepcopy(base)
    tensors = {}
    scaling = MANUAL_ALPHA / MANUAL_R
    modules = dict(merged.named_modules())
    names = [n for n in modules if n.endswith(("self_attn.kv_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                                               "shared_experts.down_proj"))]
    names += [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    with torch.no_grad():
        for n in names:
            w = modules[n].weight  # [out, in]
            a = torch.randn(MANUAL_R, w.shape[1], generator=g) * 0.3
            b = torch.randn(w.shape[0], MANUAL_R, generator=g) * 0.3
            tensors[f"base_model.model.{n}.lora_A.weight"] = a
            tensors[f"base_model.model.{n}.lora_B.weight"] = b
            w += scaling * b @ a
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": MANUAL_R, "lora_alpha": MANUAL_ALPHA}, f)
    return merged.eval()


@pytest.fixture(scope="module", params=VARIANTS)
def ds(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant)
    base = save_tiny_model(variant, tmp(d, "m"))
    attn = q_modules(base) + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    paths = {n: tmp(d, f"adapter_{n}") for n in "abcm"}
    refs = {None: base}
    # a: all of attention + routed experts, alpha != r
    refs["a"] = save_adapter(base, paths["a"], 1, r=4, lora_alpha=8, target_modules=attn, target_parameters=EXPERTS)
    # b: rsLoRA, rank/alpha patterns; gate/up/down as modules (PEFT makes them routed-expert target_parameters)
    refs["b"] = save_adapter(base, paths["b"], 2, r=8, lora_alpha=4, use_rslora=True,
                             target_modules=["kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             rank_pattern={"kv_b_proj": 4}, alpha_pattern={"o_proj": 32})
    # c: rank 16 on kv_a/kv_b and the routed experts' down_proj
    refs["c"] = save_adapter(base, paths["c"], 3, r=16, lora_alpha=16, target_modules=["kv_a_proj_with_mqa", "kv_b_proj"],
                             target_parameters=["mlp.experts.down_proj"])
    refs["m"] = save_manual_adapter(base, paths["m"], 4)
    runner = Runner(tmp(d, "m"), max_loras=4, max_lora_rank=16)
    for n, p in paths.items():
        runner.load(n, p)
    return variant, d, base, paths, refs, runner


def ref_logprobs(refs, name, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(refs[name](torch.tensor([ids])).logits[0].float(), -1)


def check_rows(refs, rows, out):
    for i, ((ids, name), got) in enumerate(zip(rows, out)):
        err = (ref_logprobs(refs, name, ids) - got).abs().max().item()
        assert err < TOL, f"row {i} (adapter {name}): max |logprob diff| {err:.3g}"


def test_mixed_batch_matches_peft(ds):
    variant, _, base, paths, refs, runner = ds
    names = ["a", "b", None, "m", "c", "a"]
    rows = list(zip(rows_of(0, [7, 5, 9, 6, 4, 8]), names))
    out = runner.logprobs(rows)
    check_rows(refs, rows, out)
    base_lp = ref_logprobs(refs, None, rows[0][0])
    for i in (0, 1, 3, 4):  # every adapter really changes the output
        assert (out[i] - ref_logprobs(refs, None, rows[i][0])).abs().max() > 1e-2, names[i]
    assert (out[0] - base_lp).abs().max() > 1e-2


def test_single_adapter_batch_uses_its_own_slot(ds):
    """Several adapters resident; a batch that uses only the third must get the third (kv_b LoRA included)."""
    _, _, _, _, refs, runner = ds
    assert runner.pool.slot_of("c") == 2
    rows = list(zip(rows_of(1, [6, 3]), ["c", "c"]))
    out = runner.logprobs(rows)
    check_rows(refs, rows, out)
    assert (out[0] - ref_logprobs(refs, "a", rows[0][0])).abs().max() > 1e-2


def test_per_expert_2d_layout(ds, tmp_path):
    """Adapters a and b converted to per-expert 2-D keys (mlp.experts.<e>.<proj>) give PEFT's output, in one
    batch with an original."""
    from safetensors.torch import load_file

    from moelora.adapters.convert import target_parameters_to_per_expert

    _, d, _, paths, refs, _ = ds
    runner = Runner(tmp(d, "m"), max_loras=3, max_lora_rank=16)
    for n in "ab":
        target_parameters_to_per_expert(paths[n], str(tmp_path / n), tmp(d, "m"))
        keys = load_file(str(tmp_path / n / "adapter_model.safetensors"))
        assert any(".mlp.experts.5.up_proj.lora_A" in k for k in keys)
        runner.load(f"{n}2d", str(tmp_path / n))
    runner.load("a", paths["a"])
    ids = rows_of(7, [7, 5])
    got = runner.logprobs([(ids[0], "a2d"), (ids[1], "b2d"), (ids[0], "a")])
    check_rows(refs, [(ids[0], "a"), (ids[1], "b"), (ids[0], "a")], got)


def test_adapter_targets(ds):
    variant, _, base, _, _, runner = ds
    a, b, c, m = (runner.registry.get(n) for n in "abcm")
    q = q_modules(base)
    for kind in q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.experts.gate_proj", "mlp.experts.down_proj"]:
        assert any(k.endswith(kind) for k in a.modules), kind
    assert not any("layers.0.mlp" in k for k in a.modules)  # layer 0 is dense: no routed experts there
    assert all(mod.rank == 16 for k, mod in b.modules.items() if k.endswith("experts.gate_proj"))  # gate_up: 2r
    assert all(mod.rank == 4 for k, mod in b.modules.items() if k.endswith("kv_b_proj"))  # rank_pattern
    assert {k.split(".", 3)[-1] for k in m.modules} == {
        "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}
    names = set(runner.targets)
    if base.config.q_lora_rank is None:
        assert "model.layers.1.self_attn.q_proj" in names and not any("q_a_proj" in n for n in names)
    else:
        assert {"model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.q_b_proj"} <= names


def test_decode_absorbed_matches_expanded_and_peft(ds, monkeypatch):
    """Prefill, then decode through the latent cache (absorbed form, kv_b LoRA of several slots folded into
    the query and applied after attention) next to a chunked prefill (expanded form) in the same batch. Each
    step equals the whole prefix recomputed in the expanded form, and PEFT."""
    import moelora.layers.mla as mla_layer

    variant, _, base, paths, refs, runner = ds
    calls = []
    real = mla_layer.mla_decode_ref

    def counting(*args, **kw):
        lora = args[-1] if len(args) == 9 else kw.get("lora")
        calls.append(None if lora is None else sorted(set(lora.token_slots.tolist())))
        return real(*args, **kw)

    monkeypatch.setattr(mla_layer, "mla_decode_ref", counting)
    names = ["c", "m", None, "a", "b"]
    prompts = rows_of(3, [5, 3, 6, 4, 7])
    extra = rows_of(4, [4, 4, 8, 4, 4])
    slot = lambda n: -1 if n is None else runner.pool.slot_of(n)  # noqa: E731
    kv = KVCache(runner.cfg, 64, 2, torch.float32, "cpu")
    tables = [kv.allocate(kv.blocks_needed(len(p) + 8, 0)) for p in prompts]
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(p, 0, t, slot(n)) for p, t, n in zip(prompts, tables, names)]
    for step in range(4):
        fb = build_flat_batch(chunks, 2)
        lora = LoRABatch.build(fb.token_slots, 4)
        hidden = runner.model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
        lp = torch.log_softmax(runner.model.compute_logits(hidden[fb.last_token_rows]), -1)
        for layer in runner.model.model.layers:  # the same step again, every sequence in the expanded form
            layer.self_attn.absorb_decode = False
        try:
            same_step = runner.model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
        finally:
            for layer in runner.model.model.layers:
                layer.self_attn.absorb_decode = True
        assert (same_step - hidden).abs().max() < 1e-5
        expanded = runner.logprobs(list(zip(seqs, names)))  # fresh cache, whole prefix: the expanded form
        for i, n in enumerate(names):
            assert (expanded[i][-1] - lp[i]).abs().max() < 1e-5, f"step {step} row {i}: absorbed vs expanded"
            assert (ref_logprobs(refs, n, seqs[i])[-1] - lp[i]).abs().max() < TOL, f"step {step} row {i} vs PEFT"
        if step < 3:
            take = [2 if i == 2 else 1 for i in range(len(names))]  # row 2 keeps prefilling two tokens a step
            chunks = [SeqChunk(extra[i][step * take[i] : (step + 1) * take[i]], len(seqs[i]), tables[i], slot(n))
                      for i, n in enumerate(names)]
            for i, c in enumerate(chunks):
                seqs[i] = seqs[i] + c.token_ids
    # the absorbed path ran on every layer of the three decode steps, with kv_b LoRA on several slots
    layers = runner.cfg.num_hidden_layers
    assert len(calls) == 3 * layers
    assert all(c is not None and len([s for s in c if s >= 0]) >= 3 for c in calls)


def test_greedy_generate_matches_peft(ds):
    from moelora import LLM, SamplingParams

    variant, d, base, paths, refs, _ = ds
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=4, max_lora_rank=16, block_size=4)
    names = ["a", None, "m", "c", "b"]
    prompts = rows_of(5, [6, 4, 7, 3, 5])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapter=names)
    for p, o, n in zip(prompts, outs, names):
        if n == "m":
            ref = greedy_ref(refs["m"], None, p, 8)
        else:
            ref = greedy_ref(base, None if n is None else paths[n], p, 8)
        assert o.token_ids == ref, f"adapter {n}"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


# ----------------------------------------------------------------------------------------------------------------
# config, cache, weights


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_reads_like_transformers(variant, tmp_path):
    from helpers import deepseek_tiny
    from moelora.config import ModelConfig

    hf_cfg, cls = deepseek_tiny(variant)
    hf_cfg.save_pretrained(str(tmp_path))  # no `architectures`: model_type names the family
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == cls.__name__ and cfg == ModelConfig.from_hf(hf_cfg)
    torch.manual_seed(0)
    hf = cls(hf_cfg)
    attn = hf.model.layers[0].self_attn
    m = cfg.mla
    assert m.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    if hf_cfg.rope_parameters["rope_type"] == "yarn":
        assert m.softmax_scale != pytest.approx((m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5)
    assert (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == (hf_cfg.q_lora_rank, 16, 6)
    assert cfg.moe_layers == (False, True) and cfg.shared_expert_intermediate_size == 12
    assert cfg.routing.topk_method == {"deepseek_v2": "group_limited_greedy", "deepseek_v2_q": "greedy",
                                       "deepseek_v3": "noaux_tc"}[variant]
    assert cfg.routing.scoring_func == ("sigmoid" if variant == "deepseek_v3" else "softmax")
    assert cfg.norm_topk_prob == (variant == "deepseek_v3")


def test_legacy_rope_scaling_key(tmp_path):
    """Released DeepSeek configs name YaRN under `rope_scaling` with `type`; it reads the same."""
    from helpers import deepseek_tiny
    from moelora.config import ModelConfig

    hf_cfg, _ = deepseek_tiny("deepseek_v3")
    hf_cfg.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    rope = dict(raw["rope_parameters"])
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    legacy.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"), **rope})
    cfg = ModelConfig.from_dict(legacy)
    assert cfg.rope_type == "yarn" and cfg == ModelConfig.from_dict(raw)


@pytest.mark.parametrize("over, match", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 5, "topk_group": 2}, "num_experts_per_tok"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_refused_configs(over, match, tmp_path):
    from helpers import deepseek_tiny
    from moelora.config import ConfigError, ModelConfig

    hf_cfg, _ = deepseek_tiny("deepseek_v2")
    raw = {**hf_cfg.to_dict(), **over}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_latent_cache_shapes_and_bytes(ds):
    _, _, base, _, _, runner = ds
    cfg = runner.cfg
    kv = KVCache(cfg, 10, 4, torch.float32, "cpu")
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    # one latent cache per layer (+ the block that CUDA-graph padding rows write to)
    assert [tuple(t.shape) for layer in kv.caches for t in layer] == [(10 + 1, 4, width)] * cfg.num_hidden_layers
    assert KVCache.bytes_per_block(cfg, 4, torch.bfloat16) == cfg.num_hidden_layers * 4 * width * 2


def test_info_and_dummy_weights(ds, capsys):
    from moelora.cli import main
    from moelora.models.loader import build_model

    _, d, _, paths, _, runner = ds
    assert main(["info", tmp(d, "m")]) == 0
    out = capsys.readouterr().out
    assert "kv_lora_rank=16" in out and "routed_scaling_factor" in out
    assert main(["check-adapter", "--model", tmp(d, "m"), "--max-lora-rank", "8", f"m={paths['m']}"]) == 0
    out = capsys.readouterr().out
    assert "OK 'm'" in out and "self_attn.kv_b_proj" in out and "mlp.shared_experts.down_proj" in out
    model = build_model(runner.cfg, load_format="dummy", max_loras=2, max_lora_rank=8)
    kv = KVCache(runner.cfg, 8, 4, torch.float32, "cpu")
    fb = build_flat_batch([SeqChunk([1, 2, 3, 4, 5], 0, kv.allocate(2))], 4)
    assert torch.isfinite(model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches))).all()


def test_fused_checkpoint_and_mtp_layers(ds, tmp_path):
    """The fused in-memory names (save_original_format=False) load as the per-expert names do; a V3 checkpoint's
    multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is skipped, as transformers skips it."""
    from safetensors.torch import load_file

    from moelora.models.loader import build_model
    from moelora.models.weights import WeightLoadError

    variant, _, base, _, refs, runner = ds
    fused = str(tmp_path / "fused")
    base.save_pretrained(fused, save_original_format=False)
    state = load_file(os.path.join(fused, "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    L = runner.cfg.num_hidden_layers
    state.update({k.replace(f"layers.{L - 1}.", f"layers.{L}."): t.clone() for k, t in state.items() if f"layers.{L - 1}." in k})
    save_file(state, os.path.join(fused, "model.safetensors"))
    if variant != "deepseek_v3":
        with pytest.raises(WeightLoadError, match=f"layers.{L}"):
            build_model(runner.cfg, fused, dtype="float32")
        return
    model = build_model(runner.cfg, fused, dtype="float32")
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name


def test_chunked_prefill_and_preemption(ds):
    """Prefill chunks of any size (1-token chunks take the absorbed form, longer ones the expanded form), and
    requests preempted and recomputed when the latent cache runs out of blocks, still give PEFT's tokens."""
    from moelora import LLM, SamplingParams

    variant, d, base, paths, refs, runner = ds
    per_block = KVCache.bytes_per_block(runner.cfg, 2, torch.float32)
    llm = LLM(tmp(d, "m"), adapters=paths, max_loras=4, max_lora_rank=16, block_size=2, max_num_batched_tokens=5,
              kv_cache_memory_bytes=12 * per_block)
    names = ["b", "m", None, "a"]
    prompts = rows_of(6, [5, 9, 6, 5])
    e = llm.engine
    for i, (p, n) in enumerate(zip(prompts, names)):
        e.add_request(f"p{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), n)
    preempted = 0
    while e.has_unfinished_requests():
        e.step()
        preempted = max(preempted, sum(r.num_preemptions for r in e.requests.values()))
    assert preempted > 0, "the test must exercise preemption"
    for i, (p, n) in enumerate(zip(prompts, names)):
        ref = greedy_ref(refs["m"], None, p, 8) if n == "m" else greedy_ref(base, None if n is None else paths[n], p, 8)
        assert e.pop_finished(f"p{i}").output_ids == ref, f"adapter {n}"
    assert e.kv.num_free_blocks == e.kv.num_blocks


@pytest.mark.parametrize("variant, over", [
    ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=0)),
    ("deepseek_v3", dict(n_group=1, topk_group=1, tie_word_embeddings=True, rope_parameters=None)),
    ("deepseek_v2", dict(n_shared_experts=0, num_hidden_layers=3, first_k_dense_replace=2, routed_scaling_factor=16.0)),
], ids=["v3-halves-rope-2-shared", "v3-one-group-tied", "v2-no-shared-2-dense"])
def test_more_configs_match_transformers(variant, over, tmp_path):
    """Rope on the two halves (rope_interleave=False), two shared experts, no dense layer; a single expert group
    and tied embeddings; no shared experts, two dense layers: base logits equal transformers'."""
    base = save_tiny_model(variant, str(tmp_path), **over)
    runner = Runner(str(tmp_path), max_loras=1, max_lora_rank=4)
    rows = rows_of(8, [9, 4])
    for ids, got in zip(rows, runner.logprobs([(r, None) for r in rows])):
        assert (ref_logprobs({None: base}, None, ids) - got).abs().max() < TOL


def test_shared_outer_expert_layout(ds, tmp_path):
    """3-D routed-expert LoRA whose gate_up A and down B are shared by all experts (expert dim 1); the reference
    is the base model with every expert's LoRA product merged into its weights."""
    _, d, base, _, _, _ = ds
    runner = Runner(tmp(d, "m"), max_loras=1, max_lora_rank=8)
    E, Hd, inter, r, alpha = 8, 32, 12, 6, 12
    g = torch.Generator().manual_seed(9)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    p = "base_model.model.model.layers.1.mlp.experts"
    t = {f"{p}.gate_up_proj.lora_A.weight": rnd(1, r, Hd), f"{p}.gate_up_proj.lora_B.weight": rnd(E, 2 * inter, r),
         f"{p}.down_proj.lora_A.weight": rnd(E, r, inter), f"{p}.down_proj.lora_B.weight": rnd(1, Hd, r)}
    path = str(tmp_path / "so")
    os.makedirs(path)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    merged = copy.deepcopy(base)
    experts = merged.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj += alpha / r * torch.einsum(
            "eor,eri->eoi", t[f"{p}.gate_up_proj.lora_B.weight"], t[f"{p}.gate_up_proj.lora_A.weight"].expand(E, -1, -1))
        experts.down_proj += alpha / r * torch.einsum(
            "eor,eri->eoi", t[f"{p}.down_proj.lora_B.weight"].expand(E, -1, -1), t[f"{p}.down_proj.lora_A.weight"])
    runner.load("so", path)
    ids = rows_of(9, [8])[0]
    (got,) = runner.logprobs([(ids, "so")])
    assert (got - ref_logprobs({None: merged}, None, ids)).abs().max() < TOL
    assert (got - ref_logprobs({None: base}, None, ids)).abs().max() > 1e-2
