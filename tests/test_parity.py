"""moelora vs transformers + PEFT on tiny random models of every family, mixed-adapter batches.

Each row's reference is PEFT run with that row's adapter alone (PEFT refuses mixed batches when the
experts carry LoRA); every position's fp32 log-probabilities must match within 1e-4.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, save_tiny_model, tmp
from moelora.adapters.convert import target_parameters_to_per_expert

TOL = 1e-4
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(family)
    base = save_tiny_model(family, tmp(d, "m"))
    paths = {n: tmp(d, n) for n in "abc"}
    # a: attention + routed experts via target_parameters, alpha != r
    save_peft_adapter(base, paths["a"], 1, r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS)
    # b: rsLoRA, rank/alpha patterns, gate/up/down given as modules (PEFT turns them into target_parameters)
    b_modules = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if family == "qwen2_moe":
        b_modules.append("shared_expert_gate")
    save_peft_adapter(base, paths["b"], 2, r=8, lora_alpha=4, use_rslora=True, target_modules=b_modules,
                      rank_pattern={"o_proj": 4}, alpha_pattern={"q_proj": 32})
    # c: rank 16, only some modules
    save_peft_adapter(base, paths["c"], 3, r=16, lora_alpha=16, target_modules=["v_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    runner = Runner(tmp(d, "m"), max_loras=4, max_lora_rank=16)
    for n, p in paths.items():
        runner.load(n, p)
    return family, d, base, paths, runner


def _check(runner, base, rows, paths):
    out = runner.logprobs(rows)
    for i, ((ids, name), got) in enumerate(zip(rows, out)):
        ref = peft_logprobs(base, None if name is None else paths[name], ids)
        err = (ref - got).abs().max().item()
        assert err < TOL, f"row {i} (adapter {name}): max |logprob diff| {err:.3g}"
    return out


def test_mixed_batch_matches_peft(fam):
    family, _, base, paths, runner = fam
    names = ["a", "b", None, "a", "c"]
    rows = list(zip(rows_of(0, [7, 5, 9, 4, 6]), names))
    out = _check(runner, base, rows, paths)
    # the adapters really change the output (a test that cannot fail proves nothing)
    base_lp = peft_logprobs(base, None, rows[0][0])
    assert (out[0] - base_lp).abs().max() > 1e-2


def test_adapters_cover_expected_modules(fam):
    family, _, _, _, runner = fam
    a, b, c = (runner.registry.get(n) for n in "abc")
    assert any(k.endswith("mlp.experts.gate_proj") for k in a.modules)
    assert any(k.endswith("mlp.experts.down_proj") for k in a.modules)
    assert {m.rank for m in a.modules.values()} == {4}
    assert all(k.endswith(("v_proj", "experts.down_proj")) for k in c.modules)
    if family == "qwen2_moe":  # gate/up/down name the shared expert's Linears: PEFT targets those
        assert any(k.endswith("shared_expert_gate") for k in b.modules)
        assert any(k.endswith("shared_expert.up_proj") for k in b.modules)
    # where PEFT turned gate/up/down into target_parameters on fused experts, gate_up got rank 2r
    gate = [m for k, m in b.modules.items() if k.endswith("experts.gate_proj")]
    assert all(m.rank == 16 for m in gate)
    if family in ("qwen3_moe", "olmoe"):
        assert gate
    # target_parameters on the fused gate_up: gate and up share A, so the up slice names the gate's copy
    # (LoRAWeights.a_src: the fused GPU kernel reads one copy); c has no gate_up, so each slice its own
    gate_up = [t.weights for k, t in runner.targets.items() if k.endswith("experts.up_proj")]
    assert gate_up
    sa, sc = runner.pool.slot_of("a"), runner.pool.slot_of("c")
    assert all(w.a_src_host[1][sa] == 0 and w.a_src_host[1][sc] == 1 for w in gate_up)


def test_single_adapter_batch_uses_its_own_slot(fam):
    """Two adapters resident; a batch that uses only the second must get the second, not slot 0."""
    _, _, base, paths, runner = fam
    assert runner.pool.slot_of("a") == 0 and runner.pool.slot_of("b") != 0
    rows = list(zip(rows_of(1, [6, 3]), ["b", "b"]))
    out = _check(runner, base, rows, paths)
    wrong = peft_logprobs(base, paths["a"], rows[0][0])
    assert (out[0] - wrong).abs().max() > 1e-2


def test_lora_enabled_but_unused_equals_base(fam):
    _, _, base, _, runner = fam
    ids = rows_of(2, [8])[0]
    (got,) = runner.logprobs([(ids, None)])
    assert torch.equal(got, runner.logprobs([(ids, None)])[0])
    assert (got - peft_logprobs(base, None, ids)).abs().max() < TOL


def test_decode_steps_match_peft(fam):
    """Prefill, then decode one token at a time through the paged cache, adapters mixed."""
    from moelora.layers.lora_batch import LoRABatch
    from moelora.engine.batch import SeqChunk, build_flat_batch
    from moelora.engine.kv_cache import KVCache

    _, _, base, paths, runner = fam
    names = ["c", None, "a"]
    prompts = rows_of(3, [5, 3, 6])
    extra = rows_of(4, [3, 3, 3])
    kv = KVCache(runner.cfg, 64, 2, torch.float32, "cpu")
    tables = [kv.allocate(kv.blocks_needed(len(p) + 3, 0)) for p in prompts]
    slot = lambda n: -1 if n is None else runner.pool.slot_of(n)  # noqa: E731
    lengths = [len(p) for p in prompts]
    chunks = [SeqChunk(p, 0, t, slot(n)) for p, t, n in zip(prompts, tables, names)]
    for step in range(4):
        fb = build_flat_batch(chunks, 2)
        hidden = runner.model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 4))
        lp = torch.log_softmax(runner.model.compute_logits(hidden[fb.last_token_rows]), -1)
        for i, n in enumerate(names):
            seq = prompts[i] + extra[i][:step]
            ref = peft_logprobs(base, None if n is None else paths[n], seq)[-1]
            assert (ref - lp[i]).abs().max() < TOL, f"step {step} row {i}"
        if step < 3:
            chunks = [SeqChunk([extra[i][step]], lengths[i] + step, tables[i], slot(n)) for i, n in enumerate(names)]


def test_per_expert_2d_layout(fam, tmp_path):
    """The same adapter converted to per-expert 2-D keys (Mixtral: w1/w3/w2 names) gives PEFT's output."""
    family, d, base, paths, runner = fam
    conv = str(tmp_path / "a2d")
    target_parameters_to_per_expert(paths["a"], conv, tmp(d, "m"))
    tensors = load_file(os.path.join(conv, "adapter_model.safetensors"))
    assert any(".mlp.experts.3.up_proj.lora_A" in k for k in tensors)
    if family == "mixtral":
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        renamed = {}
        for k, t in tensors.items():
            for old, new in names.items():
                k = k.replace(f".{old}.", f".{new}.") if ".experts." in k else k
            renamed[k.replace(".mlp.experts.", ".block_sparse_moe.experts.")] = t
        save_file(renamed, os.path.join(conv, "adapter_model.safetensors"))
    runner.registry.load("a2d", conv)
    try:
        runner.pool.pin(runner.registry.get("a2d"))
        ids = rows_of(5, [7])[0]
        (got,) = runner.logprobs([(ids, "a2d")])
        assert (got - peft_logprobs(base, paths["a"], ids)).abs().max() < TOL
    finally:
        runner.pool.unpin("a2d")
        runner.pool.evict("a2d")
        runner.registry.unload("a2d")


def test_shared_outer_layout(fam, tmp_path):
    """3-D expert LoRA whose gate_up A and down B are shared by all experts (expert dim 1). The reference
    is the base model with every expert's LoRA product merged into its weights."""
    family, d, base, paths, runner = fam
    import copy

    cfg = runner.cfg
    E, H, inter, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, 6
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    layer_prefix = "base_model.model.model.layers.0"
    t = {
        f"{layer_prefix}.mlp.experts.gate_up_proj.lora_A.weight": rnd(1, r, H),
        f"{layer_prefix}.mlp.experts.gate_up_proj.lora_B.weight": rnd(E, 2 * inter, r),
        f"{layer_prefix}.mlp.experts.down_proj.lora_A.weight": rnd(E, r, inter),
        f"{layer_prefix}.mlp.experts.down_proj.lora_B.weight": rnd(1, H, r),
    }
    path = str(tmp_path / "so")
    os.makedirs(path)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    alpha = 12
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    merged = copy.deepcopy(base)
    experts = merged.model.layers[0].mlp.experts
    s = alpha / r
    with torch.no_grad():
        a_gu, b_gu = t[f"{layer_prefix}.mlp.experts.gate_up_proj.lora_A.weight"], t[f"{layer_prefix}.mlp.experts.gate_up_proj.lora_B.weight"]
        a_d, b_d = t[f"{layer_prefix}.mlp.experts.down_proj.lora_A.weight"], t[f"{layer_prefix}.mlp.experts.down_proj.lora_B.weight"]
        experts.gate_up_proj += s * torch.einsum("eor,eri->eoi", b_gu, a_gu.expand(E, -1, -1))
        experts.down_proj += s * torch.einsum("eor,eri->eoi", b_d.expand(E, -1, -1), a_d)
    runner.registry.load("so", path)
    try:
        runner.pool.pin(runner.registry.get("so"))
        ids = rows_of(6, [9])[0]
        got, other = runner.logprobs([(ids, "so"), (ids, "a")])
        assert (got - peft_logprobs(merged, None, ids)).abs().max() < TOL
        assert (other - peft_logprobs(base, paths["a"], ids)).abs().max() < TOL
        assert (got - peft_logprobs(base, None, ids)).abs().max() > 1e-2
    finally:
        runner.pool.unpin("so")
        runner.pool.evict("so")
        runner.registry.unload("so")


@pytest.mark.gpu
def test_mixed_batch_on_gpu_with_kernels(fam):
    """The same mixed batch on the GPU (Triton LoRA kernels, fp32 with IEEE products) equals PEFT on the CPU."""
    family, d, base, paths, _ = fam
    gpu = Runner(tmp(d, "m"), max_loras=4, max_lora_rank=16, device="cuda")
    for n, p in paths.items():
        gpu.load(n, p)
    names = ["a", "b", None, "a", "c"]
    rows = list(zip(rows_of(0, [7, 5, 9, 4, 6]), names))
    _check(gpu, base, rows, paths)
    rows = list(zip(rows_of(1, [6, 3]), ["b", "b"]))  # the single-slot fast path on cuBLAS
    _check(gpu, base, rows, paths)
