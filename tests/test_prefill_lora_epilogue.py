"""The routed-expert LoRA at prefill in the FP8 expert GEMM's epilogue (moe_lora.prefill_epilogue, EpilogueLoRA):
the grouped shrink's h per pair, fp8_expert_gemm(lora=) adding the expand before its one rounding, and
fused_moe_pairs taking that path on FP8 expert stacks.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes in fp32. GPU (marked gpu): Qwen3-30B-A3B shapes
at a prefill chunk, against an fp32 reference beside the delta path's error."""

import pytest
import torch

from kernel_cases import DEVICE, ON_GPU
from moelora.kernels.quant.fp8 import quantize_act_group_ref, quantize_weight_block
from moelora.kernels.quant.fp8_experts_triton import fp8_expert_gemm, fp8_expert_gemm_lora_ref
from moelora.kernels.quant.fp8_triton import Fp8LoRAEpilogue

pytestmark = pytest.mark.usefixtures("one_thread")


RANKS = [[16, 4, 0, 8], [8, 16, 4, 2]]  # per (slice, slot): slice 0 of slot 2 has rank 0


def _factors(n, S, E, D, outs, R, gen, nan_past_rank=False):
    """a: [n, S, E, R, D] (zero past each rank) · b: [S, E, O, R] (zero, or NaN, past each rank)."""
    ranks = torch.tensor(RANKS[:n], dtype=torch.int32)
    a = torch.randn(n, S, E, R, D, generator=gen) * 0.2
    b = torch.randn(S, E, sum(outs), R, generator=gen) * 0.2
    off = [0]
    for o in outs:
        off.append(off[-1] + o)
    for i in range(n):
        for s in range(S):
            a[i, s, :, ranks[i, s]:] = 0
            b[s, :, off[i]:off[i + 1], ranks[i, s]:] = float("nan") if nan_past_rank else 0.0
    return a, b, ranks, torch.rand(n, S, generator=gen) + 0.5, torch.tensor(off, dtype=torch.int32)


def _nan_h_lora(form: str, n: int, outs: list[int], S: int, E: int, D: int, R: int, slots: torch.Tensor,
                pair_slots: torch.Tensor, gen: torch.Generator, dtype=torch.float32) -> Fp8LoRAEpilogue:
    """The routed LoRA epilogue of one form over pairs of `pair_slots`: B (in dtype) and each pair's h [n, P, R]
    hold NaN past each rank, h also in pairs without an adapter (a read of either shows); slot groups of `slots`
    unless form is "all_slots"; slice bounds given (mode 3 needs them)."""
    from moelora.kernels.lora.groups import SlotGroups

    _, b, ranks, scaling, off = _factors(n, S, E, D, outs, R, gen, nan_past_rank=True)
    h = torch.randn(n, pair_slots.numel(), R, generator=gen)
    for i in range(n):
        for p in range(pair_slots.numel()):
            s = int(pair_slots[p])
            h[i, p, (ranks[i, s] if s >= 0 else 0):] = float("nan")
    groups = None if form == "all_slots" else SlotGroups.build(slots, S).active_slots
    return Fp8LoRAEpilogue(h, b.to(dtype), off, ranks, scaling, pair_slots, groups, slice_bounds=tuple(off.tolist()),
                           prefetch=form == "prefetch")


def _record_launches(monkeypatch, module, name: str) -> list[tuple[int, int]]:
    """Kernel `name` of `module` replaced by one that records each launch's (LORA_SPLIT, LORA_GROUPS) (-1 where not
    given), then launches it."""
    launched: list[tuple[int, int]] = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs.get("LORA_SPLIT", -1), kwargs.get("LORA_GROUPS", -1)))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return launched


@pytest.mark.skipif(ON_GPU, reason="the interpreter variant; the GPU test below covers the GPU")
@pytest.mark.parametrize("form", ["all_slots", "groups", "prefetch"])
@pytest.mark.parametrize("gather_rows", [True, False])
def test_fp8_expert_gemm_adds_the_routed_lora_expand_in_its_epilogue(gather_rows, form, monkeypatch):
    """fp8_expert_gemm(lora=): per pair, scaling * h[i, p, :r] @ B[slot, expert, o_i, :r].T added to the fp32 tile
    before the one rounding; B past each rank and h of pairs without an adapter hold NaN (a read of either shows);
    slices of rank 0 add nothing; rows of slot -1 equal the plain GEMM. Forms: a loop over all slots (no groups
    given), the batch's slot groups unrolled (2 of 3 here, the third in the loop), and the metadata prefetched
    before the K steps with the groups' B in one dot (LORA_SPLIT 3; slices on tile boundaries)."""
    from moelora.kernels.quant import fp8_triton as ft
    from moelora.kernels.moe.align_triton import moe_align

    monkeypatch.setattr(ft, "LORA_GROUPS_UNROLLED", 2)
    g = torch.Generator().manual_seed(31 + gather_rows)
    blk, T, K, E, S, D, R = (16, 16), 9, 3, 5, 4, 48, 16
    n, outs = (2, [32, 32]) if gather_rows else (1, [32])
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    slots = torch.tensor([0, -1, 2, 1, 2, 0, -1, 2, 1], dtype=torch.int32)  # three slot groups, slot 3 unused
    pair_slots = slots.repeat_interleave(K)
    x = torch.randn(T if gather_rows else T * K, D, generator=g)
    xq, xs = quantize_act_group_ref(x, blk[1])
    qe, se = quantize_weight_block(torch.randn(E, sum(outs), D, generator=g) * 0.3, blk)
    lora = _nan_h_lora(form, n, outs, S, E, D, R, slots, pair_slots, g)
    align = moe_align(ids, E, 16)
    modes = _record_launches(monkeypatch, ft, "_fp8_gemm_kernel")
    cfg = ft.Fp8GemmConfig(32, 4, 2)
    y = fp8_expert_gemm(xq, qe, se, blk, ids, align, gather_rows, 16, x_scale=xs, lora=lora, config=cfg)
    base = fp8_expert_gemm(xq, qe, se, blk, ids, align, gather_rows, 16, x_scale=xs, config=cfg)
    assert modes[0] == {"all_slots": (0, 0), "groups": (0, 2), "prefetch": (3, 4)}[form]
    ref = fp8_expert_gemm_lora_ref(xq, qe, se, blk, ids, gather_rows, lora, x_scale=xs)
    assert not y.isnan().any()
    assert ((y.float() - ref.float()).norm() / ref.float().norm()) < 2**-7  # bf16 output rounding
    none = pair_slots < 0
    assert torch.equal(y[none], base[none])
    assert (y[~none].float() - base[~none].float()).abs().max() > 0.1  # the delta is there
    with pytest.raises(ValueError, match="LoRA epilogue"):
        from moelora.kernels.moe.experts_triton import TritonExperts

        class NoEpilogue:  # a quantized stack without one (as NVFP4's)
            fast_path = True

        TritonExperts(ids, E)(x, NoEpilogue(), lora=lora)


@pytest.mark.skipif(ON_GPU, reason="the interpreter variant; the GPU test below covers the GPU")
@pytest.mark.parametrize("stack", ["fp8", "plain"])
def test_fused_moe_pairs_prefill_lora_epilogue(stack, monkeypatch):
    """moe_lora.prefill_epilogue: above DECODE_MAX_PAIRS pairs (lowered here to the test's batch), on FP8 expert
    stacks on the Triton path, the routed LoRA is one grouped shrink a projection plus the GEMM's epilogue (no
    moe_lora_grouped delta launch; the batch's slot groups, metadata prefetched), with the delta path's result (fp32
    here: the two differ by roundings only); with the field off, the delta path. Plain weights (fp32 here, bf16 /
    fp16 on a GPU) take the delta path either way."""
    from moelora.kernels.lora.groups import SlotGroups
    from moelora.kernels.moe import experts_triton as fmt
    from moelora.kernels.moe.experts import ExpertKernels, ExpertLoRAArgs, fused_moe_pairs, route_topk_ref
    from moelora.kernels.moe_lora import backend
    from moelora.kernels.moe_lora.backend import MoELoRAKernels
    from moelora.layers.fp8 import Fp8ExpertWeight, Fp8State

    g = torch.Generator().manual_seed(17)
    blk, T, E, K, H, inter, S, R = (16, 16), 10, 6, 2, 48, 32, 4, 16
    st = Fp8State(blk, torch.float32, None)
    w_gu, w_d = torch.randn(E, 2 * inter, H, generator=g) * 0.2, torch.randn(E, H, inter, generator=g) * 0.2
    if stack == "fp8":
        w_gu = Fp8ExpertWeight(*quantize_weight_block(w_gu, blk), st)
        w_d = Fp8ExpertWeight(*quantize_weight_block(w_d, blk), st)
    x = torch.randn(T, H, generator=g)
    weights, ids = route_topk_ref(torch.randn(T, E, generator=g), K, True)
    a_gu, b_gu, r_gu, s_gu, off_gu = _factors(2, S, E, H, [inter, inter], R, g)
    a_d, b_d, r_d, s_d, off_d = _factors(1, S, E, inter, [H], R, g)
    slots = torch.tensor([0, 1, -1, 2, 3, 0, 1, -1, 2, 3], dtype=torch.int32)
    args = ExpertLoRAArgs(slots, a_gu, b_gu, s_gu, r_gu, a_d, b_d, s_d, r_d, off_gu, off_d,
                          active_slots=SlotGroups.build(slots, S).active_slots)
    monkeypatch.setattr(backend, "DECODE_MAX_PAIRS", T * K - 1)  # this batch counts as a prefill chunk
    calls = {"shrink": 0, "grouped": 0}
    real_shrink, real_grouped = backend.moe_lora_grouped_shrink, backend.moe_lora_grouped
    monkeypatch.setattr(backend, "moe_lora_grouped_shrink",
                        lambda *a, **kw: (calls.__setitem__("shrink", calls["shrink"] + 1), real_shrink(*a, **kw))[1])
    monkeypatch.setattr(backend, "moe_lora_grouped",
                        lambda *a, **kw: (calls.__setitem__("grouped", calls["grouped"] + 1), real_grouped(*a, **kw))[1])
    assert fmt.fast_path_ok(x, w_gu, w_d)
    assert fmt.lora_epilogue_ok(w_gu) == (stack == "fp8")
    on = ExpertKernels(True, MoELoRAKernels(True))
    assert on.prefill_epilogue  # the default
    off = ExpertKernels(True, MoELoRAKernels(True), prefill_epilogue=False)
    delta_path = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, off)
    assert calls == {"shrink": 0, "grouped": 2}
    epi = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", args, on)
    assert calls == ({"shrink": 2, "grouped": 2} if stack == "fp8" else {"shrink": 0, "grouped": 4})
    no_lora = fused_moe_pairs(x, w_gu, w_d, weights, ids, "silu", None, on)
    rel = ((epi - delta_path).norm() / delta_path.norm()).item()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    assert ((no_lora - delta_path).norm() / delta_path.norm()).item() > 1e-2
    base_rows = slots < 0  # tokens without an adapter: the base output
    if stack == "fp8":  # the epilogue path runs the no-LoRA path's kernels (activation fused into gate_up's GEMM)
        assert torch.equal(epi[base_rows], no_lora[base_rows])
    else:  # the delta path runs the activation as its own kernel, the no-LoRA path fuses it into gate_up's GEMM (other
        # tiles, and on a GPU gate_up rounded to bf16 first): the same function up to fp32 rounding, not the same bits
        torch.testing.assert_close(epi[base_rows], no_lora[base_rows], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("T", [640, 2048])
def test_gpu_prefill_lora_epilogue_qwen3_shapes(T, monkeypatch):
    """Qwen3-30B-A3B routed experts in FP8 with 8 rank-16 adapters (and tokens without one) at a prefill chunk:
    the epilogue path (one grouped shrink a projection, no delta launch) within the
    FP8 kernels' bound of the torch W8A8 reference and of the delta path, and as close as the delta path to bf16 on
    the dequantized weights (the LoRA on unquantized activations: FP8's error dominates both); rows of tokens
    without an adapter within the kernels' bound of the no-LoRA output."""
    from moelora.layers.lora_batch import LoRABatch
    from moelora.kernels.config import KernelConfig
    from moelora.kernels.moe.experts import ExpertKernels, fused_moe_pairs, route_topk_ref
    from moelora.kernels.moe_lora import backend
    from moelora.layers.fp8 import Fp8State
    from test_fp8_gpu import E, H, K, _experts, _lora_args, _rel, dequantized_stack

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    ex = _experts(True, seed=3)
    g = torch.Generator(device=DEVICE).manual_seed(200 + T)
    x = torch.randn(T, H, device=DEVICE, generator=g).bfloat16()
    tw, ti = route_topk_ref(torch.randn(T, E, device=DEVICE, generator=g), K, True)
    slots = torch.randint(-1, 8, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    batch = LoRABatch.build(slots, 8, DEVICE)
    calls = []
    real = backend.moe_lora_grouped_shrink
    monkeypatch.setattr(backend, "moe_lora_grouped_shrink", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    delta_cfg = KernelConfig.from_dict({"moe_lora": {"prefill_epilogue": False}})
    ex.configure(delta_cfg)
    delta_path = ex(x, tw.bfloat16(), ti, batch)
    no_lora = ex(x, tw.bfloat16(), ti, None)
    assert calls == []
    ex.configure(KernelConfig())
    epi = ex(x, tw.bfloat16(), ti, batch)
    args = _lora_args(ex, batch)
    assert len(calls) == 2, len(calls)
    # bf16 on the dequantized weights by the delta path
    bf16 = fused_moe_pairs(x, dequantized_stack(ex, "gate_up_proj"), dequantized_stack(ex, "down_proj"),
                           tw.bfloat16(), ti, "silu", args, ExpertKernels.from_config(delta_cfg.moe_lora, True))
    ex.quant = Fp8State((128, 128), torch.bfloat16, "w8a8")
    ref = ex(x, tw.bfloat16(), ti, batch)
    base = torch.tensor([s < 0 for s in slots], device=DEVICE)
    diag = dict(calls=len(calls), w8a8_epi=_rel(epi, ref), w8a8_delta=_rel(delta_path, ref),
                epi_vs_delta=_rel(epi, delta_path), bf16_epi=_rel(epi, bf16), bf16_delta=_rel(delta_path, bf16),
                base_rows_rel=_rel(epi[base], no_lora[base]), base_rows_equal=torch.equal(epi[base], no_lora[base]),
                lora_rows_vs_no_lora=_rel(epi[~base], no_lora[~base]))
    assert diag["calls"] == 2, diag
    assert diag["w8a8_epi"] < 2.0**-6 and diag["epi_vs_delta"] < 2.0**-6, diag
    assert diag["bf16_epi"] < 1.1 * diag["bf16_delta"] + 1e-3, diag
    assert diag["base_rows_rel"] < 2.0**-7, diag
    assert diag["lora_rows_vs_no_lora"] > 1e-2, diag
