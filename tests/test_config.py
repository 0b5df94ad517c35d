"""ModelConfig from each family's config.json, and the config features that change the forward pass (rope
scaling, sliding windows, dense layers, GQA, head_dim) checked against transformers' logits (fp32, 1e-4)."""

import copy
import json
import os

import pytest
import torch

from helpers import hf_tiny, rows_of, save_tiny_model
from moelora.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.models.loader import build_model

TOL = 1e-4
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def save_config(family: str, path, **over):
    """config.json as model.save_pretrained writes it (with `architectures`)."""
    hf_cfg, cls = hf_tiny(family, **over)
    hf_cfg.architectures = [cls.__name__]
    hf_cfg.save_pretrained(str(path))
    return hf_cfg


def saved_config(family: str, path, **over) -> ModelConfig:
    hf_cfg = save_config(family, path, **over)
    cfg = ModelConfig.from_pretrained(str(path))
    assert cfg == ModelConfig.from_hf(hf_cfg)  # config.json and the live config object agree
    return cfg


def raw_config(family: str, path, **over) -> dict:
    save_config(family, path, **over)
    with open(os.path.join(str(path), "config.json")) as f:
        return json.load(f)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prefill(model, rows, block_size=4):
    kv = KVCache(model.config, 128, block_size, model.dtype, "cpu")
    chunks = [SeqChunk(r, 0, kv.allocate(kv.blocks_needed(len(r), 0))) for r in rows]
    fb = build_flat_batch(chunks, block_size)
    logits = model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches))
    q = fb.attn.query_start_loc
    return [logits[q[i] : q[i + 1]] for i in range(len(rows))]


def check_parity(path, hf, rows, block_size=4):
    cfg = ModelConfig.from_pretrained(str(path))
    model = build_model(cfg, str(path), dtype="float32")
    for i, (ids, got) in enumerate(zip(rows, prefill(model, rows, block_size))):
        err = (hf_logits(hf, ids) - got).abs().max().item()
        assert err < TOL, f"row {i} (len {len(ids)}): max |logit diff| {err:.3g}"
    return cfg, model


def with_config(hf, **changes):
    """The same weights under a config that differs in `changes` (to show a feature changes the output)."""
    cfg = copy.deepcopy(hf.config)
    for k, v in changes.items():
        setattr(cfg, k, v)
    other = type(hf)(cfg).eval()
    other.load_state_dict(hf.state_dict())
    return other


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------------------
# family fields


EXPECTED = {
    "qwen3_moe": dict(qk_norm="head", shared_expert_intermediate_size=0, shared_expert_gate=False, norm_topk_prob=True,
                      moe_layers=(True, False), qkv_bias=False, o_bias=False, head_dim=8, num_experts=8,
                      moe_intermediate_size=12, intermediate_size=40, rope_theta=10000.0),
    "qwen2_moe": dict(qk_norm="none", shared_expert_intermediate_size=20, shared_expert_gate=True, norm_topk_prob=False,
                      moe_layers=(True, True), qkv_bias=True, o_bias=False, head_dim=8, num_experts=8,
                      moe_intermediate_size=12, intermediate_size=40),
    "mixtral": dict(qk_norm="none", shared_expert_intermediate_size=0, shared_expert_gate=False, norm_topk_prob=True,
                    moe_layers=(True, True), qkv_bias=False, o_bias=False, head_dim=8, num_experts=8,
                    moe_intermediate_size=12, rope_theta=1e6, eos_token_ids=(2,)),
    "olmoe": dict(qk_norm="full", shared_expert_intermediate_size=0, shared_expert_gate=False, norm_topk_prob=False,
                  moe_layers=(True, True), qkv_bias=False, o_bias=False, head_dim=8, num_experts=8,
                  moe_intermediate_size=12, clip_qkv=None, eos_token_ids=(1,)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fields(family, tmp_path):
    cfg = saved_config(family, tmp_path)
    assert cfg.architecture == SUPPORTED_ARCHITECTURES[FAMILIES.index(family)]
    for k, v in EXPECTED[family].items():
        assert getattr(cfg, k) == v, k
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (97, 32, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert (cfg.q_size, cfg.kv_size) == (32, 16)
    assert cfg.num_experts_per_tok == 2
    assert cfg.sliding_windows == (None, None)
    assert cfg.rope_type == "default"
    assert cfg.torch_dtype == "float32"
    assert cfg.tie_word_embeddings is False


def test_config_file_path_and_live_config(tmp_path):
    """from_pretrained takes the folder or the json file; from_hf names the architecture from model_type."""
    hf_cfg = save_config("olmoe", tmp_path)
    a = ModelConfig.from_pretrained(str(tmp_path))
    b = ModelConfig.from_pretrained(str(tmp_path / "config.json"))
    hf_cfg.architectures = None
    c = ModelConfig.from_hf(hf_cfg)
    assert a == b == c and c.architecture == "OlmoeForCausalLM"


def test_norm_topk_and_clip_qkv(tmp_path):
    assert saved_config("qwen3_moe", tmp_path / "a", norm_topk_prob=False).norm_topk_prob is False
    assert saved_config("olmoe", tmp_path / "b", norm_topk_prob=True).norm_topk_prob is True
    assert saved_config("olmoe", tmp_path / "c", clip_qkv=0.5).clip_qkv == 0.5
    # Mixtral always renormalises its top-k weights, whatever the config says
    assert saved_config("mixtral", tmp_path / "d", norm_topk_prob=False).norm_topk_prob is True


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_layers(family, tmp_path):
    def layers(name, **over):
        return saved_config(family, tmp_path / name, **{"num_hidden_layers": 4, "mlp_only_layers": [], **over}).moe_layers

    assert layers("a") == (True,) * 4
    assert layers("b", decoder_sparse_step=2) == (False, True, False, True)
    assert layers("c", mlp_only_layers=[0, 3]) == (False, True, True, False)
    assert layers("d", mlp_only_layers=[1], decoder_sparse_step=2) == (False, False, False, True)
    assert layers("e", num_experts=0) == (False,) * 4


@pytest.mark.parametrize("family,over", [
    ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),
    ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0, 2])),
])
def test_dense_layers_match_hf(family, over, tmp_path):
    hf = save_tiny_model(family, str(tmp_path), **over)
    cfg, model = check_parity(tmp_path, hf, rows_of(50, [7, 10]))
    assert not all(cfg.moe_layers) and any(cfg.moe_layers)
    assert [layer.is_moe for layer in model.model.layers] == list(cfg.moe_layers)


def test_gqa_mqa_and_head_dim(tmp_path):
    """One kv head (MQA) and head_dim != hidden / heads: fields and logits."""
    for family, over in [("qwen3_moe", dict(num_key_value_heads=1, head_dim=16)),
                         ("mixtral", dict(num_key_value_heads=1, head_dim=16)),
                         ("olmoe", dict(num_attention_heads=8, num_key_value_heads=8))]:
        hf = save_tiny_model(family, str(tmp_path / family), **over)
        cfg, _ = check_parity(tmp_path / family, hf, rows_of(51, [9, 4]))
        heads = over.get("num_attention_heads", 4)
        hd = over.get("head_dim", 32 // heads)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (heads, over["num_key_value_heads"], hd)
        assert cfg.q_size == heads * hd and cfg.kv_size == over["num_key_value_heads"] * hd


def test_dtype_and_eos_fields(tmp_path):
    raw = raw_config("qwen3_moe", tmp_path)
    assert ModelConfig.from_dict(raw).torch_dtype == "float32"
    legacy = {k: v for k, v in raw.items() if k != "dtype"}
    assert ModelConfig.from_dict({**legacy, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"  # transformers 4 name
    assert ModelConfig.from_dict({**raw, "dtype": "float16"}).torch_dtype == "float16"
    assert ModelConfig.from_dict(legacy).torch_dtype == "float32"  # none named: float32
    assert ModelConfig.from_dict({**raw, "eos_token_id": [5, 7]}).eos_token_ids == (5, 7)
    assert ModelConfig.from_dict({**raw, "eos_token_id": 3}).eos_token_ids == (3,)
    assert ModelConfig.from_dict({**raw, "eos_token_id": None}).eos_token_ids == ()


# ----------------------------------------------------------------------------------------------------------------
# sliding windows


def test_window_fields(tmp_path):
    assert saved_config("mixtral", tmp_path / "a", sliding_window=4).sliding_windows == (4, 4)
    assert saved_config("qwen3_moe", tmp_path / "b", use_sliding_window=True, sliding_window=4).sliding_windows == (4, 4)
    # Qwen3/Qwen2 ship sliding_window with use_sliding_window false: no window
    assert saved_config("qwen3_moe", tmp_path / "c", use_sliding_window=False, sliding_window=4096).sliding_windows == (None, None)
    assert saved_config("qwen2_moe", tmp_path / "d", use_sliding_window=False, sliding_window=4096).sliding_windows == (None, None)
    # Qwen2-MoE: per layer, from layer_types (even layers below max_window_layers)
    q2 = saved_config("qwen2_moe", tmp_path / "e", use_sliding_window=True, sliding_window=4, num_hidden_layers=4,
                      max_window_layers=3, mlp_only_layers=[])
    assert q2.sliding_windows == (4, None, 4, None)


def decode_vs_hf(model, hf, prompts, extra, block_size, steps):
    kv = KVCache(model.config, 64, block_size, model.dtype, "cpu")
    tables = [kv.allocate(kv.blocks_needed(len(p) + steps, 0)) for p in prompts]
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    for step in range(steps + 1):
        fb = build_flat_batch(chunks, block_size)
        last = model.compute_logits(model(fb.input_ids, fb.positions, fb.attn, kv.caches)[fb.last_token_rows])
        for i, s in enumerate(seqs):
            err = (hf_logits(hf, s)[-1] - last[i]).abs().max().item()
            assert err < TOL, f"step {step} row {i}: {err:.3g}"
        if step < steps:
            chunks = [SeqChunk([extra[i][step]], len(seqs[i]), tables[i]) for i in range(len(seqs))]
            for i in range(len(seqs)):
                seqs[i].append(extra[i][step])


@pytest.mark.parametrize("family,over", [
    ("mixtral", dict(sliding_window=4)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),  # layer 0 windowed, 1 full
])
def test_sliding_window_matches_hf(family, over, tmp_path):
    hf = save_tiny_model(family, str(tmp_path), **over)
    hf.set_attn_implementation("eager")  # the sliding mask is transformers' own, applied in eager attention
    rows = rows_of(60, [11, 7, 3, 9])
    cfg, model = check_parity(tmp_path, hf, rows, block_size=2)
    assert 4 in cfg.sliding_windows
    # decode past the window through the paged cache: the window spans several blocks of 2
    decode_vs_hf(model, hf, rows_of(61, [6, 9]), rows_of(62, [4, 4]), block_size=2, steps=4)
    # the window matters: full attention gives other logits on these lengths
    full = with_config(hf, **({"layer_types": ["full_attention"] * 2} if family == "qwen2_moe" else {"sliding_window": None}))
    assert (hf_logits(full, rows[0]) - hf_logits(hf, rows[0])).abs().max() > 1e-3
    # and sdpa (transformers' default attention) agrees with eager here
    sdpa = copy.deepcopy(hf)
    sdpa.set_attn_implementation("sdpa")
    assert (hf_logits(sdpa, rows[0]) - hf_logits(hf, rows[0])).abs().max() < TOL


def test_olmoe_ignores_sliding_window(tmp_path):
    """OLMoE has no sliding window: transformers masks causally even if the config carries one, and so must we."""
    hf = save_tiny_model("olmoe", str(tmp_path), sliding_window=4)
    assert hf.config.sliding_window == 4
    hf.set_attn_implementation("eager")
    cfg, _ = check_parity(tmp_path, hf, rows_of(63, [12, 6]), block_size=2)
    assert cfg.sliding_windows == (None, None)


# ----------------------------------------------------------------------------------------------------------------
# rope scaling


ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_scaling_matches_hf(rope, tmp_path):
    try:
        hf = save_tiny_model("qwen3_moe", str(tmp_path), rope_parameters=dict(ROPES[rope]), max_position_embeddings=128)
    except (ValueError, KeyError, TypeError) as e:  # pragma: no cover - depends on the transformers version
        pytest.skip(f"Qwen3MoeConfig refuses rope_type {rope!r}: {e}")
    rows = rows_of(70, [80, 40, 5])  # 80 > original_max_position_embeddings (32)
    cfg, model = check_parity(tmp_path, hf, rows, block_size=4)
    assert cfg.rope_type == rope
    rot = model.model.layers[0].self_attn.rotary
    default_inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    assert not torch.allclose(rot.inv_freq, default_inv)
    if rope == "yarn":
        assert rot.attention_scaling > 1.0
    # decode at positions past the original context, through the cache
    decode_vs_hf(model, hf, rows_of(71, [40]), rows_of(72, [3]), block_size=4, steps=3)
    # the scaling matters: default rope gives other logits on the long row
    plain = with_config(hf, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert (hf_logits(plain, rows[0]) - hf_logits(hf, rows[0])).abs().max() > 1e-3


def test_rope_theta(tmp_path):
    hf = save_tiny_model("qwen2_moe", str(tmp_path), rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg, _ = check_parity(tmp_path, hf, rows_of(73, [30]))
    assert cfg.rope_theta == 500.0


# ----------------------------------------------------------------------------------------------------------------
# refused configs


def test_unsupported_architecture(tmp_path):
    raw = raw_config("qwen3_moe", tmp_path)
    for over in ({"architectures": ["LlamaForCausalLM"]}, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                 {"architectures": [], "model_type": "llama"}, {"architectures": None, "model_type": "dbrx"}):
        with open(tmp_path / "config.json", "w") as f:
            json.dump({**raw, **over}, f)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_pretrained(str(tmp_path))
        for name in SUPPORTED_ARCHITECTURES:
            assert name in str(e.value)
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    # a supported one among several is picked
    assert ModelConfig.from_dict({**raw, "architectures": ["Foo", "Qwen3MoeForCausalLM"]}).architecture == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("family", FAMILIES)
def test_config_without_architectures(family, tmp_path):
    """config.save_pretrained writes no `architectures`: model_type names the family (as from_hf does)."""
    hf_cfg, cls = hf_tiny(family)
    hf_cfg.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert not json.load(f).get("architectures")
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == cls.__name__
    assert cfg == ModelConfig.from_hf(hf_cfg)


def test_unsupported_live_config():
    from transformers import LlamaConfig

    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM"):
        ModelConfig.from_hf(LlamaConfig(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError):
        ModelConfig.from_hf(LlamaConfig())


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
     "original_max_position_embeddings": 32, "rope_theta": 10000.0},
])
def test_dynamic_rope_refused(rope, tmp_path):
    raw = raw_config("qwen3_moe", tmp_path)
    with pytest.raises(ConfigError, match=rope["rope_type"]):
        ModelConfig.from_dict({**raw, "rope_parameters": rope, "max_position_embeddings": 128})


def test_missing_or_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))  # empty folder
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"]})
