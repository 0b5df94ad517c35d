"""Weight loading against transformers, for every family, on tiny random models (CPU, fp32 unless stated).

Checkpoint layouts: fused experts as transformers >= 5 keeps them in memory (`mlp.experts.gate_up_proj
[E, 2I, H]`, `down_proj [E, H, I]`; written with save_original_format=False), the per-expert names that
transformers writes by default and that older checkpoints use (Mixtral: `block_sparse_moe.experts.{e}.w1/w2/w3`),
sharded checkpoints with an index, bf16/fp16 checkpoints, tied embeddings, dummy weights, and broken checkpoints.
"""

import copy
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import hf_tiny, rows_of, save_tiny_model, tmp
from moelora.config import ModelConfig
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.models.loader import build_model
from moelora.models.weights import WeightLoadError

TOL = 1e-4
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
E, H, INTER = 8, 32, 12  # tiny models: experts, hidden, expert intermediate (helpers.hf_tiny)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------------------
# helpers


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def load(path: str, dtype="float32"):
    cfg = ModelConfig.from_pretrained(path)
    return cfg, build_model(cfg, path, dtype=dtype)


def prefill(model, rows: list[list[int]], block_size: int = 4) -> list[torch.Tensor]:
    """All rows in one flat batch. Blocks are handed out one at a time round-robin over the rows (in a cache
    whose free list is shuffled), so every block table is non-contiguous and out of order."""
    cfg = model.config
    kv = KVCache(cfg, 64, block_size, model.dtype, "cpu")
    kv._free = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    tables: list[list[int]] = [[] for _ in rows]
    while any(len(t) < kv.blocks_needed(len(r), 0) for t, r in zip(tables, rows)):
        for t, r in zip(tables, rows):
            if len(t) < kv.blocks_needed(len(r), 0):
                t += kv.allocate(1)
    fb = build_flat_batch([SeqChunk(r, 0, t) for r, t in zip(rows, tables)], block_size)
    logits = model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches))
    q = fb.attn.query_start_loc
    return [logits[q[i] : q[i + 1]] for i in range(len(rows))]


def decode_check(model, hf, prompts, extra, block_size: int, steps: int, chunk_row: int | None = None, compare=None):
    """Prefill the prompts together, then feed `extra` tokens step by step through the paged KV cache, blocks
    allocated on demand as a scheduler does (so the rows' blocks interleave). Row `chunk_row` takes two tokens per
    step (a chunked prefill continuing next to decodes). Every step's last-token logits must equal transformers'
    logits for the whole prefix, recomputed from scratch (within TOL, or as `compare(seq, got)` decides)."""
    kv = KVCache(model.config, 64, block_size, model.dtype, "cpu")
    tables: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)  # tokens in the cache
    new = [list(p) for p in prompts]
    seqs = [list(p) for p in prompts]
    for step in range(steps + 1):
        chunks = []
        for i in range(len(prompts)):
            tables[i] += kv.allocate(kv.blocks_needed(done[i] + len(new[i]), len(tables[i])))
            chunks.append(SeqChunk(new[i], done[i], list(tables[i])))
        fb = build_flat_batch(chunks, block_size)
        last = model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches)[fb.last_token_rows])
        for i in range(len(prompts)):
            if compare is not None:
                compare(seqs[i], last[i])
            else:
                err = (hf_logits(hf, seqs[i])[-1] - last[i]).abs().max().item()
                assert err < TOL, f"step {step} row {i} (context {len(seqs[i])}): max |logit diff| {err:.3g}"
            done[i] += len(new[i])
            take = 2 if i == chunk_row else 1
            new[i] = extra[i][:take]
            extra[i] = extra[i][take:]
            seqs[i] = seqs[i] + new[i]
    assert max(len(t) for t in tables) >= 3, "the test should span several blocks"
    return tables


def per_expert_state_dict(family: str, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors into per-expert 2-D names (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2 and
    block_sparse_moe.gate.weight, as Mixtral checkpoints name them)."""
    mixtral = family == "mixtral"
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {k: f"{k}_proj" for k in ("gate", "up", "down")}
    out = {}
    for k, t in fused.items():
        moe = ".block_sparse_moe." if mixtral else ".mlp."
        if k.endswith(".mlp.experts.gate_up_proj"):
            p = k[: -len(".mlp.experts.gate_up_proj")] + moe + "experts"
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}.{e}.{names['gate']}.weight"] = t[e, :inter].clone()
                out[f"{p}.{e}.{names['up']}.weight"] = t[e, inter:].clone()
        elif k.endswith(".mlp.experts.down_proj"):
            p = k[: -len(".mlp.experts.down_proj")] + moe + "experts"
            for e in range(t.shape[0]):
                out[f"{p}.{e}.{names['down']}.weight"] = t[e].clone()
        elif mixtral and k.endswith(".mlp.gate.weight"):
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.clone()
        else:
            out[k] = t.clone()
    return out


def save_sharded(state: dict[str, torch.Tensor], path: str, n_shards: int = 3) -> list[str]:
    """`n_shards` safetensors files plus model.safetensors.index.json (weight_map), as save_pretrained shards."""
    os.makedirs(path, exist_ok=True)
    keys = sorted(state)
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for i, f in enumerate(files):
        part = {k: state[k].contiguous() for k in keys[i::n_shards]}
        save_file(part, os.path.join(path, f), metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return files


def copy_config(src: str, dst: str) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def checkpoint_keys(path: str) -> dict[str, list[int]]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                out.update({k: st.get_slice(k).get_shape() for k in st.keys()})
    return out


# ----------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    """(family, dir, HF model, fused checkpoint path, moelora model loaded from it)."""
    family = request.param
    d = tmp_path_factory.mktemp(family)
    hf = save_tiny_model(family, tmp(d, "orig"))  # transformers' default save: per-expert ("original") names
    fused = tmp(d, "fused")
    hf.save_pretrained(fused, save_original_format=False)  # the in-memory fused names
    _, model = load(fused)
    return family, d, hf, fused, model


# ----------------------------------------------------------------------------------------------------------------
# fp32 parity, fused layout


def test_fused_checkpoint_layout(fam):
    """The checkpoint under test really holds fused 3-D experts (else the parity tests below prove less)."""
    _, _, _, fused, model = fam
    keys = checkpoint_keys(fused)
    assert keys["model.layers.0.mlp.experts.gate_up_proj"] == [E, 2 * INTER, H]
    assert keys["model.layers.0.mlp.experts.down_proj"] == [E, H, INTER]
    assert not any(".experts.0." in k or "block_sparse_moe" in k for k in keys)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (E, 2 * INTER, H)


@pytest.mark.parametrize("block_size", [2, 4])
def test_fused_prefill_matches_hf(fam, block_size):
    _, _, hf, _, model = fam
    rows = rows_of(10, [1, 5, 9, 13])
    for i, (ids, got) in enumerate(zip(rows, prefill(model, rows, block_size))):
        ref = hf_logits(hf, ids)
        assert got.shape == ref.shape
        err = (ref - got).abs().max().item()
        assert err < TOL, f"row {i} (len {len(ids)}): max |logit diff| {err:.3g}"
    assert (ref - ref.mean()).abs().max() > 1e-2  # logits are not flat: a wrong model could not pass by accident


@pytest.mark.parametrize("block_size", [2, 4])
def test_fused_decode_matches_hf(fam, block_size):
    _, _, hf, _, model = fam
    prompts = rows_of(11, [5, 3, 7])
    extra = rows_of(12, [8, 8, 8])
    tables = decode_check(model, hf, prompts, extra, block_size, steps=4, chunk_row=1)
    flat = sorted(b for t in tables for b in t)
    assert len(flat) == len(set(flat))  # no block shared between sequences


def test_batch_composition_does_not_change_logits(fam):
    """A row's logits do not depend on what else is in the flat batch or where its blocks are."""
    _, _, _, _, model = fam
    rows = rows_of(13, [6, 9, 4])
    together = prefill(model, rows, 2)
    for ids, got in zip(rows, together):
        (alone,) = prefill(model, [ids], 4)
        assert (alone - got).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# per-expert names, sharded


def test_transformers_default_save_loads(fam):
    """save_pretrained's default (original per-expert names; Mixtral: block_sparse_moe w1/w2/w3) loads into the
    same parameters as the fused checkpoint."""
    family, d, _, _, fused_model = fam
    orig = os.path.join(d, "orig")
    keys = checkpoint_keys(orig)
    w1 = "block_sparse_moe.experts.3.w1.weight" if family == "mixtral" else "mlp.experts.3.gate_proj.weight"
    assert f"model.layers.0.{w1}" in keys and "model.layers.0.mlp.experts.gate_up_proj" not in keys
    _, model = load(orig)
    fused_params = dict(fused_model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, fused_params[n]), n


def test_per_expert_sharded_matches_fused(fam, tmp_path):
    family, _, hf, fused, fused_model = fam
    state = per_expert_state_dict(family, load_file(os.path.join(fused, "model.safetensors")))
    if family == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in state
        assert "model.layers.1.block_sparse_moe.gate.weight" in state
        assert not any(".mlp." in k for k in state)
    else:
        assert state["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (H, INTER)
        assert state["model.layers.0.mlp.experts.7.up_proj.weight"].shape == (INTER, H)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in state)
    path = copy_config(fused, str(tmp_path / "sharded"))
    files = save_sharded(state, path, n_shards=3)
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == files
    _, model = load(path)
    fused_params = dict(fused_model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, fused_params[n]), n
    rows = rows_of(14, [7, 4])
    for ids, got, want in zip(rows, prefill(model, rows), prefill(fused_model, rows)):
        assert torch.equal(got, want)
        assert (got - hf_logits(hf, ids)).abs().max() < TOL


def test_index_selects_shards(fam, tmp_path):
    """With an index, only the shards it names are read: a stray file beside them is not."""
    family, _, _, fused, fused_model = fam
    path = copy_config(fused, str(tmp_path / "sharded"))
    save_sharded(per_expert_state_dict(family, load_file(os.path.join(fused, "model.safetensors"))), path, 2)
    save_file({"junk.weight": torch.zeros(3)}, os.path.join(path, "zzz-stray.safetensors"))
    _, model = load(path)
    emb = model.model.embed_tokens.weight
    assert torch.equal(emb, fused_model.model.embed_tokens.weight)


# ----------------------------------------------------------------------------------------------------------------
# dtypes

# bf16/fp16 tolerance. Both implementations round every intermediate to the checkpoint dtype, in different op
# orders (fused qkv/gate_up, per-expert loops, fp32 softmax/router here vs transformers' own casts), so they
# legitimately differ by a few units in the last place of the logits: measured here, one ulp of the largest logit
# (bf16 ~2e-3, fp16 ~2.4e-4 at |logit| ~0.4) -- as large as transformers' own low-precision error against fp32.
# We allow TOL_LOW = 4 * eps(dtype) * max|logit| (bf16 ~1.3e-2, fp16 ~1.7e-3 here, i.e. 2-4 ulps), still ~30x below
# what a wrongly loaded or wrongly cast tensor produces (differences of the order of the logits, ~0.3).
# One more term: when two experts' router probabilities nearly tie (one decode row here has a 2nd/3rd margin of
# 8e-6), a low-precision rounding flips the top-k choice in one implementation and not the other. So, with
# ref_err = |HF(dtype) - HF(fp32 on the upcast weights)| (transformers' own error, usually ~TOL_LOW/4):
#   |moelora(dtype) - HF(fp32)|  <= TOL_LOW + ref_err   (moelora is no further from the truth than transformers)
#   |moelora(dtype) - HF(dtype)| <= TOL_LOW + ref_err   (and no further from transformers than that)
# and the two errors are asserted small in absolute terms too (< 0.05, the logits themselves are ~0.3).


def low_precision_compare(hf, hf32, dt):
    eps = torch.finfo(dt).eps

    def compare(ids, got):
        ref, truth = hf_logits(hf, ids), hf_logits(hf32, ids)
        if got.dim() == 1:
            ref, truth = ref[-1], truth[-1]
        tol = 4 * eps * truth.abs().max().item()
        ref_err = (ref - truth).abs().max().item()
        err, err32 = (ref - got).abs().max().item(), (truth - got).abs().max().item()
        msg = f"{dt}, len {len(ids)}: vs HF {err:.3g}, vs fp32 {err32:.3g}, HF's own error {ref_err:.3g}, tol {tol:.3g}"
        assert err32 <= tol + ref_err and err <= tol + ref_err and max(err, err32) < 0.05, msg

    return compare


LOW = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def low_precision(tmp_path_factory):
    """family -> dtype -> (checkpoint path, HF model in that dtype, HF model upcast to fp32 from it)."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"{family}_lowp")
        base = save_tiny_model(family, tmp(d, "fp32"))
        out[family] = {}
        for dt in LOW:
            hf = copy.deepcopy(base).to(dt)
            hf.set_experts_implementation("eager")  # transformers' grouped_mm refuses these tiny bf16 shapes on CPU
            path = tmp(d, str(dt).replace("torch.", ""))
            hf.save_pretrained(path, save_original_format=False)
            out[family][dt] = (path, hf, copy.deepcopy(hf).float())
    return out


@pytest.mark.parametrize("dt", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_checkpoint_auto_dtype(low_precision, family, dt):
    path, hf, hf32 = low_precision[family][dt]
    assert {t.dtype for t in load_file(os.path.join(path, "model.safetensors")).values()} == {dt}
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.torch_dtype == str(dt).replace("torch.", "")
    model = build_model(cfg, path, dtype="auto")
    assert model.dtype == dt and {p.dtype for p in model.parameters()} == {dt}
    compare = low_precision_compare(hf, hf32, dt)
    rows = rows_of(20, [9, 5, 12])
    for ids, got in zip(rows, prefill(model, rows, 2)):
        compare(ids, got)
    # decode through a KV cache of that dtype
    decode_check(model, hf, rows_of(21, [4, 6]), rows_of(22, [4, 4]), 2, steps=3, compare=compare)


@pytest.mark.parametrize("dt", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_checkpoint_as_float32(low_precision, family, dt):
    path, _, hf32 = low_precision[family][dt]
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, path, dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # exactly the upcast checkpoint values
    assert torch.equal(model.model.embed_tokens.weight, hf32.model.embed_tokens.weight)
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, hf32.model.layers[0].mlp.experts.down_proj)
    rows = rows_of(23, [9, 5, 12])
    for ids, got in zip(rows, prefill(model, rows, 4)):
        assert (hf_logits(hf32, ids) - got).abs().max() < TOL


def test_dtype_names(low_precision):
    path, _, _ = low_precision["qwen3_moe"][torch.bfloat16]
    cfg = ModelConfig.from_pretrained(path)
    assert build_model(cfg, path, dtype="fp16").dtype == torch.float16
    assert build_model(cfg, path, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="float8"):
        build_model(cfg, path, dtype="float8")


# ----------------------------------------------------------------------------------------------------------------
# tied embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_embeddings(family, tmp_path):
    hf = save_tiny_model(family, str(tmp_path / "m"), tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    cfg, model = load(str(tmp_path / "m"))
    assert cfg.tie_word_embeddings
    assert model.lm_head is None and not any("lm_head" in n for n, _ in model.named_parameters())
    rows = rows_of(30, [6, 10])
    for ids, got in zip(rows, prefill(model, rows)):
        assert (hf_logits(hf, ids) - got).abs().max() < TOL
    # a tied checkpoint that also writes lm_head.weight (some exporters do) loads the same model: the copy is
    # ignored, even when it differs and is read after the embeddings (a file sorted after model.safetensors)
    path = copy_config(str(tmp_path / "m"), str(tmp_path / "with_head"))
    save_file(load_file(os.path.join(str(tmp_path / "m"), "model.safetensors")), os.path.join(path, "model.safetensors"))
    save_file({"lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size)}, os.path.join(path, "zz-head.safetensors"))
    _, model2 = load(path)
    assert torch.equal(model2.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(prefill(model2, rows)[1], prefill(model, rows)[1])


def test_untied_checkpoint_without_lm_head_is_refused(tmp_path):
    save_tiny_model("mixtral", str(tmp_path / "m"))
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="lm_head"):
        load(str(tmp_path / "m"))


# ----------------------------------------------------------------------------------------------------------------
# dummy weights


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_from_config_only(family, tmp_path):
    hf_cfg, cls = hf_tiny(family)
    hf_cfg.architectures = [cls.__name__]  # as in a model's config.json
    path = str(tmp_path / "cfg")
    hf_cfg.save_pretrained(path)
    assert not any(f.endswith(".safetensors") for f in os.listdir(path))
    cfg = ModelConfig.from_pretrained(path)
    ids = [rows_of(40, [9])[0]]

    def logits(seed, dtype="float32"):
        model = build_model(cfg, None, dtype=dtype, load_format="dummy", seed=seed)
        return model, prefill(model, ids)[0]

    m0, a = logits(0)
    _, b = logits(0)
    _, c = logits(1)
    assert torch.isfinite(a).all() and a.shape == (9, cfg.vocab_size)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-4
    assert (a - a.mean()).abs().max() > 0  # not a constant output
    assert all(torch.isfinite(p).all() for p in m0.parameters())
    assert torch.equal(m0.model.norm.weight, torch.ones(cfg.hidden_size))
    _, lowp = logits(0, "bfloat16")
    assert torch.isfinite(lowp).all()
    # the same folder has no weights to load
    with pytest.raises(WeightLoadError, match="safetensors"):
        build_model(cfg, path)
    with pytest.raises(ValueError, match="dummy"):
        build_model(cfg, None)
    with pytest.raises(ValueError, match="load_format"):
        build_model(cfg, path, load_format="pt")


# ----------------------------------------------------------------------------------------------------------------
# broken checkpoints


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Qwen2-MoE checkpoint (attention biases, shared expert, sigmoid gate) in per-expert names."""
    d = tmp_path_factory.mktemp("broken")
    save_tiny_model("qwen2_moe", tmp(d, "m"))
    return str(d / "m"), load_file(str(d / "m" / "model.safetensors"))


def write(tmp_path, ckpt, state) -> str:
    path = copy_config(ckpt[0], str(tmp_path / "c"))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    return path


def test_broken_fixture_loads(ckpt):
    _, model = load(ckpt[0])
    assert model.model.layers[0].mlp.shared_expert is not None


def test_missing_tensor(ckpt, tmp_path):
    state = dict(ckpt[1])
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"lacks.*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load(write(tmp_path, ckpt, state))


def test_missing_one_expert(ckpt, tmp_path):
    state = dict(ckpt[1])
    del state["model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        load(write(tmp_path, ckpt, state))


def test_missing_bias(ckpt, tmp_path):
    state = dict(ckpt[1])
    del state["model.layers.0.self_attn.v_proj.bias"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.bias"):
        load(write(tmp_path, ckpt, state))


def test_duplicate_tensor_does_not_hide_a_missing_one(ckpt, tmp_path):
    """q_proj written twice (two files, no index) must not count as covering the missing k_proj."""
    state = dict(ckpt[1])
    del state["model.layers.0.self_attn.k_proj.weight"]
    path = write(tmp_path, ckpt, state)
    q = state["model.layers.0.self_attn.q_proj.weight"].clone()
    save_file({"model.layers.0.self_attn.q_proj.weight": q}, os.path.join(path, "model-extra.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load(path)


def test_wrong_shape(ckpt, tmp_path):
    state = dict(ckpt[1])
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    state[name] = state[name].T.contiguous()  # [I, H] instead of [H, I]
    with pytest.raises(WeightLoadError) as e:
        load(write(tmp_path, ckpt, state))
    msg = str(e.value)
    assert name in msg and f"expected shape {[H, INTER]}" in msg and f"found {[INTER, H]}" in msg


def test_wrong_shape_fused(tmp_path):
    """Fused experts stored the other way round ([E, I, H] down, as some exporters write)."""
    hf = save_tiny_model("olmoe", str(tmp_path / "m"))
    hf.save_pretrained(str(tmp_path / "f"), save_original_format=False)
    state = load_file(str(tmp_path / "f" / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, str(tmp_path / "f" / "model.safetensors"))
    with pytest.raises(WeightLoadError) as e:
        load(str(tmp_path / "f"))
    msg = str(e.value)
    assert name in msg and str([E, H, INTER]) in msg and str([E, INTER, H]) in msg


def test_too_many_experts(ckpt, tmp_path):
    state = dict(ckpt[1])
    state["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(INTER, H)
    with pytest.raises(WeightLoadError, match=r"experts\.8\.gate_proj"):
        load(write(tmp_path, ckpt, state))


def test_unknown_tensor(ckpt, tmp_path):
    state = dict(ckpt[1])
    state["model.layers.0.mlp.mystery.weight"] = torch.zeros(4, 4)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.mystery\.weight"):
        load(write(tmp_path, ckpt, state))


def test_ignored_tensors(ckpt, tmp_path):
    """rotary inv_freq buffers some old checkpoints carry are skipped, not refused."""
    state = dict(ckpt[1])
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    _, model = load(write(tmp_path, ckpt, state))
    _, ref = load(ckpt[0])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, ref.model.layers[0].self_attn.qkv_proj.weight)


def test_index_naming_missing_shard(ckpt, tmp_path):
    path = copy_config(ckpt[0], str(tmp_path / "s"))
    files = save_sharded(dict(ckpt[1]), path, 3)
    os.remove(os.path.join(path, files[1]))
    with pytest.raises(WeightLoadError, match=files[1]):
        load(path)


def test_index_without_weight_map(ckpt, tmp_path):
    path = copy_config(ckpt[0], str(tmp_path / "s"))
    save_sharded(dict(ckpt[1]), path, 2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(WeightLoadError, match="weight_map"):
        load(path)


def test_no_safetensors(ckpt, tmp_path):
    path = copy_config(ckpt[0], str(tmp_path / "empty"))
    torch.save({}, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        load(path)


def test_checkpoint_folder_missing(ckpt, tmp_path):
    cfg = ModelConfig.from_pretrained(ckpt[0])
    with pytest.raises(WeightLoadError, match="does not exist"):
        build_model(cfg, str(tmp_path / "nowhere"))
