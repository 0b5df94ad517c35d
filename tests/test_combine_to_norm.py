"""The routed experts' combine handed to the next RMSNorm (act_triton.defer_moe_combine, moe.combine_to_norm):
the norm computes the combine as it loads its input, bit for bit what moe_combine and the norm compute in two
launches.

CPU: under TRITON_INTERPRET=1 in fp32/fp16. GPU (marked gpu): a tiny Qwen3-MoE with an adapter, prompt
log-probabilities bit-equal with moe.combine_to_norm on and off, and no combine launch with it on."""

import pytest
import torch

from kernel_cases import DEVICE, DTYPES, ON_GPU, expert_lora_args
from moelora.kernels.config import KernelConfig
from moelora.kernels.moe import act_triton as fmt
from moelora.kernels.moe.experts import ExpertKernels, fused_moe_pairs, route_topk_ref
from moelora.kernels.norm.rmsnorm_triton import rms_norm

pytestmark = pytest.mark.usefixtures("one_thread")

H, I, E, K = 48, 24, 8, 2


def _case(T, dtype, seed, with_delta):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(T * K, H, generator=g).to(DEVICE, dtype)
    w, _ = route_topk_ref(torch.randn(T, E, generator=g), K, True, dtype)
    w = w.to(DEVICE)
    delta = (torch.randn(T * K, H, generator=g) * 0.1).to(DEVICE, dtype) if with_delta else None
    residual = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(DEVICE, dtype)
    return o, w, delta, residual, norm_w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_norm_computes_the_combine_bit_for_bit(dtype, with_delta):
    T = 5
    o, w, delta, residual, norm_w = _case(T, dtype, 3 + with_delta, with_delta)
    w[1, 1] = 0  # a weight-0 pair: its row never read, whatever it holds
    o[1 * K + 1] = float("nan")
    x = fmt.moe_combine(o, w, delta=delta)
    assert torch.isfinite(x).all()
    y_ref, r_ref = rms_norm(x, norm_w, 1e-6, residual)
    placeholder = torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)  # never read
    y, r = rms_norm(placeholder, norm_w, 1e-6, residual, combine=(o, w, delta))
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)


def test_norm_combine_names_the_shapes():
    o, w, _, residual, norm_w = _case(3, torch.float32, 1, False)
    with pytest.raises(ValueError, match=r"combine expects o \[3 \* K, 48\].*found o \(5, 48\)"):
        rms_norm(torch.empty(3, H, device=DEVICE), norm_w, 1e-6, residual, combine=(o[:5], w, None))


@pytest.mark.parametrize("with_lora", [False, True])
def test_deferred_combine_placeholder_carries_the_inputs(with_lora):
    """Inside defer_moe_combine the fast path's combine returns a placeholder with (o, weights, delta) on it; the
    norm given them equals the norm of the plain layer output. Outside, nothing is deferred."""
    from moelora.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(7)
    T, dtype = 6, DTYPES[0]
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEVICE, dtype)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=g), K, True, dtype)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    args = expert_lora_args(T, E, dtype, g) if with_lora else None

    def run():
        # the Triton base path (on the CPU under the interpreter) with the reference LoRA
        return fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, ExpertKernels(triton=True))

    plain = run()
    assert not hasattr(plain, "moe_combine")
    with fmt.defer_moe_combine():
        held = run()
    o, cw, cd = held.moe_combine
    assert o.shape == (T * K, H) and torch.equal(cw, weights)  # (no side stream here: the delta already in o)
    residual = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    norm = RMSNorm(H, 1e-6, dtype, DEVICE)
    combine = fmt.take_moe_combine(held)
    assert not hasattr(held, "moe_combine")  # taken once
    y, r = rms_norm(held, norm.weight, norm.eps, residual, combine=combine)
    y_ref, r_ref = rms_norm(plain, norm.weight, norm.eps, residual)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    # RMSNorm.add_norm off the Triton path (CPU tensors) computes a deferred combine with the reference
    with fmt.defer_moe_combine():
        held = run()
    y2, r2 = norm.add_norm(held, residual)
    y2_ref, r2_ref = norm.add_norm(plain, residual)
    torch.testing.assert_close(y2, y2_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(r2, r2_ref, atol=2e-3, rtol=2e-3)


def test_moe_block_defers_as_configured():
    """MoEBlock.configure: the combine deferred on the Triton path (the GPU; forced on the CPU for tests) unless
    moe.combine_to_norm is off; never on the reference path (the CPU's default)."""
    from helpers import hf_tiny
    from moelora.config import ModelConfig
    from moelora.layers.moe import MoEBlock

    block = MoEBlock(ModelConfig.from_hf(hf_tiny("qwen3_moe")[0]), torch.float32, DEVICE)
    assert block.combine_to_norm == ON_GPU
    block.configure(KernelConfig(), triton=True)
    assert block.combine_to_norm
    block.configure(KernelConfig.from_dict({"moe": {"combine_to_norm": False}}), triton=True)
    assert not block.combine_to_norm


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_combine_to_norm_changes_nothing(tmp_path):
    """A tiny Qwen3-MoE in bf16 with a PEFT adapter on attention and experts, a mixed batch: prompt log-probabilities
    bit-equal with the combine in the next norm and without, and no moe_combine launch with it."""
    from helpers import Runner, rows_of, save_peft_adapter, save_tiny_model, tmp
    from test_fp8_gpu import launch_records

    from moelora.layers.configure import configure_kernels

    base = save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 1, r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    run = Runner(tmp(tmp_path, "m"), max_loras=2, max_lora_rank=16, dtype="bfloat16", device="cuda")
    run.load("ad", ad)
    rows = [(r, "ad") for r in rows_of(5, [3, 1, 1])] + [(rows_of(6, [2])[0], None)]
    outs = {}
    for on in (False, True):
        configure_kernels(run.model, KernelConfig.from_dict({"moe": {"combine_to_norm": on}}))
        with launch_records(fmt._combine_kernel) as recs:
            outs[on] = run.logprobs(rows)
        assert (len(recs) == 0) == on
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
