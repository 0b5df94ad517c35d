"""A long mixed prefill on the GPU against PEFT: more than 2,048 (token, expert) pairs in one flat batch, so the
routed-expert LoRA takes its prefill path (the grouped kernel, or the expand in the expert GEMM's epilogue:
moe_lora.prefill_epilogue, on FP8 expert stacks; bf16 stacks take the grouped kernel) end to end, beside rows of
another adapter and rows without one.

Bound: mean |d log p| < 0.02 against transformers + PEFT in fp32 on the (dequantized) weights, as
test_fp8_gpu.test_fp8_checkpoint_with_lora_vs_peft_on_dequantized states for W8A8; the adapters move the log-probs by
more than 0.05, so a LoRA error cannot hide in the bound. Rows without an adapter are held to the same bound
against the base model."""

import pytest
import torch

from fp8_helpers import write_fp8_checkpoint
from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, tmp

pytestmark = pytest.mark.gpu
DEV = "cuda"
LENGTHS = [700, 300, 420]  # 1,420 tokens at top-2: 2,840 pairs (> DECODE_MAX_PAIRS: the prefill path)
NAMES = ["a", None, "b"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    base, fp8, deq, _ = write_fp8_checkpoint(d)
    ref = __import__("transformers").AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    paths = {"a": tmp(d, "a"), "b": tmp(d, "b")}
    save_peft_adapter(ref, paths["a"], 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    save_peft_adapter(ref, paths["b"], 2, r=8, lora_alpha=16, target_modules=["k_proj", "o_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    return fp8, deq, ref, paths


def _spy(monkeypatch, module, name: str) -> list:
    calls = []
    fn = getattr(module, name)

    def spy(*a, **k):
        calls.append(1)
        return fn(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("base", ["fp8", "bf16"])
@pytest.mark.parametrize("epilogue", [False, True])
def test_long_mixed_prefill_matches_peft(ckpt, base, epilogue, monkeypatch):
    """Each row's log-probs against PEFT with its own adapter (or none); the prefill LoRA path the config selects
    ran (with the epilogue on: _experts_lora_epilogue, once per MoE layer; else the grouped prefill kernel, twice)."""
    if base == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    from moelora.kernels.config import KernelConfig
    from moelora.kernels.moe import experts as moe
    from moelora.kernels.moe_lora import backend
    from moelora.layers.configure import configure_kernels

    fp8, deq, ref, paths = ckpt
    run = Runner(fp8 if base == "fp8" else deq, max_loras=2, max_lora_rank=8, dtype="bfloat16", device=DEV)
    configure_kernels(run.model, KernelConfig.from_dict({"moe_lora": {"prefill_epilogue": epilogue}}))
    for n, p in paths.items():
        run.load(n, p)
    epi = _spy(monkeypatch, moe, "_experts_lora_epilogue")
    grouped = _spy(monkeypatch, backend, "moe_lora_grouped")  # gate_up's and down's deltas
    rows = list(zip(rows_of(11, LENGTHS), NAMES))
    got = run.logprobs(rows, kv_blocks=sum(LENGTHS) // 4 + 8)
    moe_layers = sum(1 for layer in run.model.model.layers if hasattr(layer.mlp, "experts"))
    expect_epi = epilogue and base == "fp8"  # FP8 stacks only: plain bf16 ones take the grouped kernel
    assert moe_layers > 0
    assert (len(epi), len(grouped)) == ((moe_layers, 0) if expect_epi else (0, 2 * moe_layers)), (len(epi), len(grouped))
    for (ids, name), lp in zip(rows, got):
        want = peft_logprobs(ref, None if name is None else paths[name], ids)
        err = (lp - want).abs().mean().item()
        print(f"{base} epilogue={epilogue} adapter={name}: mean |d log p| {err:.4g}")
        assert err < 0.02, (name, err)
        if name is not None:
            assert (want - peft_logprobs(ref, None, ids)).abs().mean() > 0.05, name
