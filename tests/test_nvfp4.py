"""NVFP4 (ModelOpt layout) weight-only on the CPU: packing, quantization, checkpoints, online quantization,
and prompt log-probs with LoRA against PEFT on the dequantized model."""

import os

import pytest
import torch
from safetensors.torch import load_file

import kernel_cases  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without CUDA)
from fp8_helpers import write_nvfp4_checkpoint
from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, tmp
from moelora.config import ModelConfig
from moelora.kernels.quant.nvfp4 import dequantize_nvfp4, pack_e2m1, quantize_nvfp4, unpack_e2m1
from moelora.layers.nvfp4 import dequantized
from moelora.models.loader import build_model
from moelora.models.weights import WeightLoadError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_packing_low_nibble_first():
    packed = pack_e2m1(torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x8F]]
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, -6.0, -0.0]]
    from moelora.kernels.quant.nvfp4 import round_to_e2m1

    v = torch.tensor([0.25, 0.26, 2.5, 2.51, 5.0, 7.0, -0.1, -1.2])  # ties go to the smaller magnitude; clamp at 6
    assert round_to_e2m1(v).tolist() == [0, 1, 4, 5, 6, 7, 8, 10]


def test_representable_weights_roundtrip_exactly():
    g = torch.Generator().manual_seed(0)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = values[torch.randint(0, 8, (6, 64), generator=g)] * (torch.randint(0, 2, (6, 64), generator=g) * 2 - 1)
    codes.view(6, 4, 16)[..., 0] = 6.0  # every group reaches the e2m1 maximum
    w = codes * 2.0 ** torch.randint(-3, 3, (6, 4, 1), generator=g).repeat_interleave(16, 1).view(6, 64).float()
    p, s, s2 = quantize_nvfp4(w)
    assert p.shape == (6, 32) and s.shape == (6, 4) and s.dtype == torch.float8_e4m3fn and s2.dim() == 0
    assert torch.allclose(dequantize_nvfp4(p, s, s2), w, rtol=1e-6, atol=0)
    x = torch.randn(64, 96, generator=g)
    assert ((dequantize_nvfp4(*quantize_nvfp4(x)) - x).norm() / x.norm()) < 0.15  # 4-bit: ~0.1 on Gaussian data
    with pytest.raises(ValueError, match=r"multiple of 16; weight shape \[4, 40\]"):
        quantize_nvfp4(torch.randn(4, 40))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_nvfp4_checkpoint(tmp_path_factory.mktemp("nvfp4"), skip=("layers.1.self_attn.o_proj",))


def _runner(path, nvfp4: bool) -> Runner:
    kw = dict(quantization="nvfp4", quant_reference="cpu-test") if nvfp4 else {}
    return Runner(path, max_loras=2, max_lora_rank=8, build_kw=kw)


def test_nvfp4_checkpoint_loads_and_equals_the_dequantized_model(ckpt):
    _, q4, deq, _ = ckpt
    run = _runner(q4, True)
    m = run.model
    raw = load_file(os.path.join(q4, "model.safetensors"))
    att = m.model.layers[0].self_attn.qkv_proj
    assert att.weight.dtype == torch.uint8 and att.weight.shape == (64, 16)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(att.weight[32:48], raw[k]) and torch.equal(att.weight_scale_2[32:48], raw[k + "_scale_2"].expand(16))
    assert not torch.equal(att.weight_scale_2[:32], att.weight_scale_2[32:48])  # q and k: their own global scales
    assert m.model.layers[1].self_attn.o_proj.quant is None
    assert m.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.uint8
    rows = rows_of(3, [7, 4])
    for a, b, c in zip(run.logprobs([(r, None) for r in rows]), _runner(deq, False).logprobs([(r, None) for r in rows]),
                       _runner(q4, False).logprobs([(r, None) for r in rows])):  # CPU without the flag: dequantized
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(c, b, atol=1e-5)


def test_nvfp4_with_lora_vs_peft_on_dequantized(tmp_path):
    from transformers import AutoModelForCausalLM

    _, q4, deq, _ = write_nvfp4_checkpoint(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 2, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    run = _runner(q4, True)
    run.load("ad", ad)
    rows = rows_of(9, [6, 9])
    for ids, got in zip(rows, run.logprobs([(r, "ad") for r in rows])):
        assert (got - peft_logprobs(base, ad, ids)).abs().max() < 1e-4  # weight-only: exact on the dequantized model


def test_nvfp4_errors(ckpt, tmp_path):
    _, q4, _, src = ckpt
    cfg = ModelConfig.from_pretrained(src)
    with pytest.raises(RuntimeError, match=r"NVFP4 needs a CUDA GPU .*; found cpu"):
        build_model(cfg, src, quantization="nvfp4")
    with pytest.raises(ValueError, match=r"is an nvfp4 checkpoint; quantization='fp8'"):
        build_model(ModelConfig.from_pretrained(q4), q4, quantization="fp8")
    from test_fp8 import _edit_checkpoint

    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    missing = _edit_checkpoint(q4, str(tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=r"up_proj.weight' is packed NVFP4 \(uint8\) but .*weight_scale' is missing"):
        build_model(ModelConfig.from_pretrained(missing), missing, quantization="nvfp4", quant_reference="cpu-test")
    bad = _edit_checkpoint(q4, str(tmp_path / "bad"), lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    with pytest.raises(WeightLoadError, match=r"up_proj.weight_scale': expected shape \[16, 2\] .* found \[16, 1\]"):
        build_model(ModelConfig.from_pretrained(bad), bad, quantization="nvfp4", quant_reference="cpu-test")


def test_online_nvfp4_quantization(ckpt):
    _, _, _, src = ckpt
    cfg = ModelConfig.from_pretrained(src)
    ref = build_model(cfg, src)
    m = build_model(cfg, src, quantization="nvfp4", quant_reference="cpu-test")
    ex, ex_ref = m.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
    assert ex.down_proj.dtype == torch.uint8
    assert torch.equal(dequantized(ex, "down_proj", torch.float32), dequantize_nvfp4(*quantize_nvfp4(ex_ref.down_proj)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; test_fp8_gpu.py covers the GPU")
@pytest.mark.parametrize("T", [1, 5])
def test_triton_weight_only_gemms_interpreted(T):
    from moelora.kernels.quant.nvfp4_triton import nvfp4_grouped_gemm, nvfp4_grouped_gemm_ref, nvfp4_linear, nvfp4_linear_ref

    g = torch.Generator().manual_seed(T)
    x, w = torch.randn(T, 96, generator=g), torch.randn(72, 96, generator=g)  # N = 72: a partial 64-wide tile
    p, s, s2 = quantize_nvfp4(w)
    s2 = s2.expand(72) * torch.linspace(0.5, 2, 72)  # per-row global scales (fused slices differ)
    b = torch.randn(72, generator=g)
    assert torch.allclose(nvfp4_linear(x, p, s, s2, b), nvfp4_linear_ref(x, p, s, s2, b), rtol=1e-5, atol=1e-5)
    W = torch.randn(3, 40, 96, generator=g)
    P, S, S2 = quantize_nvfp4(W)
    S2 = S2.expand(3, 40).contiguous()
    pe = torch.randint(0, 3, (2 * T,), generator=g)
    xx = torch.randn(2 * T, 96, generator=g)
    assert torch.allclose(nvfp4_grouped_gemm(xx, P, S, S2, pe), nvfp4_grouped_gemm_ref(xx, P, S, S2, pe), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; test_fp8_gpu.py covers the GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K", [304, 256])  # a partial last K step (masked loads), whole K steps (unmasked)
def test_triton_decode_of_every_code_and_scale(dtype, K):
    """The kernels decode e2m1 through e4m3 bit patterns (code s|ee|m -> s|0ee0|m00, the 2^6 in the scale): every
    one of the 16 codes (signed zeros and the subnormal 0.5 too), group scales across e4m3's range (subnormal
    ones included), per-row global scales; K of whole K steps or a partial last one."""
    from moelora.kernels.quant.nvfp4 import pack_e2m1
    from moelora.kernels.quant.nvfp4_triton import nvfp4_grouped_gemm, nvfp4_grouped_gemm_ref, nvfp4_linear, nvfp4_linear_ref

    g = torch.Generator().manual_seed(5)
    N = 40
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    p = pack_e2m1(codes)
    scale_values = torch.tensor([2.0**-9, 2.0**-7, 0.013671875, 0.5, 1.0, 1.75, 24.0, 448.0])
    s = scale_values[torch.randint(0, 8, (N, K // 16), generator=g)].to(torch.float8_e4m3fn)
    assert torch.equal(scale_values.to(torch.float8_e4m3fn).float(), scale_values)  # exact in e4m3
    s2 = torch.rand(N, generator=g) + 0.5
    x = (torch.randn(3, K, generator=g) * 0.1).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # relative to the output's norm: scales span 2^-9..448

    def close(a, b):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol

    close(nvfp4_linear(x, p, s, s2), nvfp4_linear_ref(x, p, s, s2))
    w = dequantize_nvfp4(p, s, s2)
    eye = torch.eye(K, dtype=dtype)  # the decoded weights themselves, column by column (x = I)
    got = nvfp4_linear(eye, p, s, s2).float().T  # [N, K]
    torch.testing.assert_close(got, w.to(dtype).float(), rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=0)
    assert got[0, 8].item() == 0.0  # code 8: -0
    assert (got[0, 1] / s2[0]).item() == pytest.approx(0.5 * s[0, 0].float().item(), rel=1e-3)  # code 1: 0.5
    P3 = torch.stack([p, p.flip(0), p.roll(1, 0)])
    S3, S23 = torch.stack([s, s.flip(0), s.roll(1, 0)]), torch.stack([s2, s2.flip(0), s2])
    pe = torch.tensor([2, 0, 1, 2, 2, 0])
    xx = (torch.randn(6, K, generator=g) * 0.1).to(dtype)
    close(nvfp4_grouped_gemm(xx, P3, S3, S23, pe), nvfp4_grouped_gemm_ref(xx, P3, S3, S23, pe))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; test_fp8_gpu.py covers the GPU")
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("decode", [0, 1, 2])  # 2 (inline PTX) runs as 1 here: no GPU
def test_triton_dense_split_k_and_decode_modes(split_k, decode, monkeypatch):
    """The dense kernel with K split (partials in a workspace, added in split order by the last arriving split):
    the reference's numbers, the same bits on a second call, and the arrival counters left at zero; both
    decode modes (scales applied in fp32 or in the activations' dtype) give the same weights."""
    import dataclasses

    from moelora.kernels.quant import nvfp4_triton as nt
    from moelora.kernels.quant.split_k_triton import _COUNTERS

    cfg = dataclasses.replace(nt.DENSE_CONFIG, split_k=split_k, decode=decode)
    g = torch.Generator().manual_seed(split_k)
    N, K = 72, 1024  # 8 K steps of 128
    p, s, s2 = quantize_nvfp4(torch.randn(N, K, generator=g))
    s2 = s2.expand(N).contiguous()
    x, b = torch.randn(5, K, generator=g), torch.randn(N, generator=g)
    y, ref = nt.nvfp4_linear(x, p, s, s2, b, config=cfg), nt.nvfp4_linear_ref(x, p, s, s2, b)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6  # fp32: the K sum's order differs only
    assert torch.equal(nt.nvfp4_linear(x, p, s, s2, b, config=cfg), y)
    assert int(_COUNTERS[torch.device("cpu")].abs().sum()) == 0
    assert nt.nvfp4_split_k(80, 16) == 4 and nt.nvfp4_split_k(32, 32) == 8 and nt.nvfp4_split_k(300, 16) == 1
    assert nt.nvfp4_split_k(80, 4) == 2  # >= 2 K steps a split


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; test_fp8_gpu.py covers the GPU")
@pytest.mark.parametrize("gather_rows", [True, False])
def test_triton_expert_gemm_on_the_fast_path_alignment(gather_rows):
    """nvfp4_expert_gemm on fused_moe_triton's alignment: token rows read in place (row p // top_k) or per pair,
    the reference's numbers (fp32); pairs on expert -1 (expert parallelism) leave the other rows as they were."""
    from moelora.kernels.moe.align_triton import moe_align
    from moelora.kernels.quant.nvfp4_triton import nvfp4_expert_gemm, nvfp4_expert_gemm_ref

    g = torch.Generator().manual_seed(7)
    T, K, E, N, D = 5, 2, 4, 40, 64
    P3, S3, S23 = quantize_nvfp4(torch.randn(E, N, D, generator=g))
    S23 = S23.expand(E, N) * torch.linspace(0.5, 2, N)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    x = torch.randn(T if gather_rows else T * K, D, generator=g)
    align = moe_align(ids, E, 16)
    y = nvfp4_expert_gemm(x, P3, S3, S23, ids, align, gather_rows, 16)
    torch.testing.assert_close(y, nvfp4_expert_gemm_ref(x, P3, S3, S23, ids, align, gather_rows, 16), rtol=1e-5,
                               atol=1e-5)
    dropped = ids.clone()
    dropped[1, 0] = dropped[3, 1] = -1  # pairs another rank's experts take (expert parallelism): no GEMM row
    y2 = nvfp4_expert_gemm(x, P3, S3, S23, dropped, moe_align(dropped, E, 16), gather_rows, 16)
    kept = dropped.reshape(-1) >= 0
    torch.testing.assert_close(y2[kept], y[kept], rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected blocks of block_m=32"):
        nvfp4_expert_gemm(x, P3, S3, S23, ids, align, gather_rows, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; test_fp8_gpu.py covers the GPU")
def test_nvfp4_experts_take_the_triton_fast_path_with_lora():
    """NVFP4 expert stacks on fused_moe_triton's fast path (TritonExperts: expert_gemm on its alignment, the
    SiLU-and-mul and combine kernels) with routed-expert LoRA: fused_moe_ref's numbers on the dequantized
    weights (fp32), and the fast path is the one taken (expert_gemm called, grouped_mm not)."""
    from kernel_cases import expert_lora_args
    from moelora.kernels.moe import experts_triton as fmt
    from moelora.kernels.moe.experts import ExpertKernels, fused_moe_pairs, fused_moe_ref, route_topk_ref
    from moelora.kernels.moe_lora.backend import MoELoRAKernels
    from moelora.layers.nvfp4 import Nvfp4ExpertWeight

    g = torch.Generator().manual_seed(9)
    T, E, K, H, inter = 6, 4, 2, 48, 32
    mod = torch.nn.Module()
    for name, shape in (("gate_up_proj", (E, 2 * inter, H)), ("down_proj", (E, H, inter))):
        p, s, s2 = quantize_nvfp4(torch.randn(*shape, generator=g) * 0.2)
        setattr(mod, name, p)
        setattr(mod, name + "_scale", s)
        setattr(mod, name + "_scale_2", s2.expand(*shape[:2]).contiguous())
    w_gu, w_d = Nvfp4ExpertWeight(mod, "gate_up_proj"), Nvfp4ExpertWeight(mod, "down_proj")
    x = torch.randn(T, H, generator=g)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=g), K, True)
    args = expert_lora_args(T, E, torch.float32, g, hidden=H, inter=inter)
    calls = []
    real_fast, real_slow = Nvfp4ExpertWeight.expert_gemm, Nvfp4ExpertWeight.grouped_mm
    Nvfp4ExpertWeight.expert_gemm = lambda self, *a: (calls.append("fast"), real_fast(self, *a))[1]
    Nvfp4ExpertWeight.grouped_mm = lambda self, *a: (calls.append("slow"), real_slow(self, *a))[1]
    try:
        assert fmt.fast_path_ok(x, w_gu, w_d)
        got = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, ExpertKernels(True, MoELoRAKernels(True)))
    finally:
        Nvfp4ExpertWeight.expert_gemm, Nvfp4ExpertWeight.grouped_mm = real_fast, real_slow
    assert calls == ["fast", "fast"]
    deq = [dequantize_nvfp4(getattr(mod, n), getattr(mod, n + "_scale"), getattr(mod, n + "_scale_2"))
           for n in ("gate_up_proj", "down_proj")]
    ref = fused_moe_ref(x, *deq, weights, ids, "silu", args)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (ref - fused_moe_ref(x, *deq, weights, ids, "silu", None)).abs().max() > 1e-2  # the LoRA delta is there
