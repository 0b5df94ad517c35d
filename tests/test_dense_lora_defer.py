"""DenseLoRAConfig.defer: the dense LoRA delta as a tensor of its own (kernels/lora/delta_triton.py), added by the
kernel that reads the base GEMM's output next (qk_norm_rope for qkv_proj, the post-attention RMSNorm for o_proj).
CPU: the kernels under the interpreter (fp32 / fp16) against their references and against the plain forward; GPU:
compiled in bf16, and a decode step of an FP8 model at Qwen3-30B-A3B's attention dims deferred against not, eagerly
and in a CUDA graph."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, ON_GPU, token_slots, tolerance  # sets TRITON_INTERPRET=1 without a GPU

from moelora.layers.lora_batch import LoRABatch
from moelora.kernels.config import KernelConfig
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.delta_triton import DELTA_MAX_GROUPS, delta_ok, lora_delta, lora_delta_ref

pytestmark = pytest.mark.usefixtures("one_thread")
S, R = 4, 16
# CPU: small widths, slices on the 64-column tiles; GPU: the qkv shape of Qwen3-30B-A3B
H, OUTS = (2048, [4096, 512, 512]) if ON_GPU else (48, [128, 64, 64])


def _factors(dtype, gen, outs=OUTS):
    n = len(outs)
    ranks = torch.tensor([[16, 4, 0, 8], [16, 8, 4, 0], [2, 16, 8, 4]][:n], dtype=torch.int32)  # rank 0 somewhere
    b = torch.randn(S, sum(outs), R, generator=gen) * 0.1
    off = [0]
    for o in outs:
        off.append(off[-1] + o)
    for i in range(n):
        for s in range(S):
            b[s, off[i]:off[i + 1], ranks[i, s]:] = 0  # zero past each rank, as the slot pool writes them
    scaling = torch.rand(n, S, generator=gen) + 0.5
    return b.to(DEVICE, dtype), ranks.to(DEVICE), scaling.to(DEVICE), off


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
@pytest.mark.parametrize("popularity", ["distinct", "with_base_rows", "identical"])
def test_lora_delta_matches_reference_and_writes_every_row(popularity, num_tokens, dtype):
    """Against lora_delta_ref, from split-K partials with NaN wherever the kernel must not read (past each row's
    rank, rows of slot -1) into a NaN-filled buffer: every entry written, rows of slot -1 and slices of rank 0
    exactly 0."""
    gen = torch.Generator().manual_seed(num_tokens * 3 + len(popularity))
    b, ranks, scaling, off = _factors(dtype, gen)
    slots = token_slots(popularity, num_tokens, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    n = len(OUTS)
    h = torch.randn(3, n, num_tokens, R, generator=gen)
    rk = ranks.cpu()
    for t, s in enumerate(slots.tolist()):
        for i in range(n):
            h[:, i, t, (rk[i, s] if s >= 0 else 0):] = float("nan")
    h = h.to(DEVICE)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    delta = torch.full((num_tokens, sum(OUTS)), float("nan"), dtype=dtype, device=DEVICE)
    lora_delta(h, b, off_t, tuple(off), ranks, scaling, groups.token_slots, groups.active_slots, delta)
    want = lora_delta_ref(torch.nan_to_num(h, nan=0.0), b, off_t, ranks, scaling, groups, dtype)
    assert not delta.isnan().any()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(delta, want, atol=atol, rtol=rtol)
    base = (slots < 0).to(DEVICE)
    assert (delta[base] == 0).all()
    for i in range(n):
        for s in range(S):
            if rk[i, s] == 0:
                assert (delta[(slots == s).to(DEVICE), off[i]:off[i + 1]] == 0).all()
    lora_rows = ~base
    if lora_rows.any():
        assert delta[lora_rows].abs().max() > 0.01  # the adapters are there


def test_lora_delta_refuses_layers_it_cannot_serve():
    assert delta_ok((0, 128, 192, 256), 4) and not delta_ok((0, 40, 64), 4)
    assert not delta_ok((0, 128), DELTA_MAX_GROUPS + 1) and not delta_ok((0, 128), 0)
    gen = torch.Generator().manual_seed(0)
    b, ranks, scaling, off = _factors(torch.float32, gen, outs=[40, 24])
    slots = torch.tensor([0, 1, -1], dtype=torch.int32)
    groups = SlotGroups.build(slots, S, DEVICE)
    h = torch.zeros(1, 2, 3, R, device=DEVICE)
    delta = torch.empty(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slice bounds on multiples of 64"):
        lora_delta(h, b, torch.tensor(off, dtype=torch.int32, device=DEVICE), tuple(off), ranks, scaling,
                   groups.token_slots, groups.active_slots, delta)
    with pytest.raises(ValueError, match=r"expected delta \[3, 64\]"):
        lora_delta(h, b, torch.tensor(off, dtype=torch.int32, device=DEVICE), tuple(off), ranks, scaling,
                   groups.token_slots, groups.active_slots, torch.empty(3, 65, device=DEVICE))


def _qkv_case(device, dtype, seed):
    T, Hq, Hkv, D, NB, BS = 5, 4, 2, 16, 3, 4
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(device, dtype)
    delta = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * 0.5).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 500, 4095], device=device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
    w = [(torch.rand(D, generator=g) + 0.5).to(device, dtype) for _ in range(2)]
    slots = torch.tensor([5, 0, 11, -1, 6], device=device)
    caches = [torch.randn(NB, BS, Hkv, D, generator=g).to(device, dtype) for _ in range(2)]

    def run(t, caches, d=None):
        from moelora.kernels.norm.rmsnorm_triton import qk_norm_rope

        q, k, v = t.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        qk_norm_rope(q, k, w[0], w[1], 1e-6, positions, inv_freq, 0.9, kv_write=(v, caches[0], caches[1], slots),
                     delta=d)

    return qkv, delta, caches, run, Hq * D


@pytest.mark.parametrize("device,dtype", [(DEVICE, dt) for dt in DTYPES])
def test_qk_norm_rope_adds_the_qkv_delta(device, dtype):
    """With delta: bit for bit qk_norm_rope of (qkv + delta) rounded to the dtype, q / k in place and the k / v
    cache rows; the v columns of qkv stay as they were (v gets its delta on the cache write only)."""
    qkv, delta, caches, run, q_cols = _qkv_case(device, dtype, 11)
    ref, ref_caches = (qkv + delta), [c.clone() for c in caches]
    run(ref, ref_caches)
    got, got_caches = qkv.clone(), [c.clone() for c in caches]
    run(got, got_caches, delta)
    plain, plain_caches = qkv.clone(), [c.clone() for c in caches]
    run(plain, plain_caches)
    kv_cols = ref.shape[1] - q_cols
    assert torch.equal(got[:, : q_cols + kv_cols // 2], ref[:, : q_cols + kv_cols // 2])  # q, k
    assert torch.equal(got[:, q_cols + kv_cols // 2:], qkv[:, q_cols + kv_cols // 2:])  # v untouched in qkv
    assert all(torch.equal(a, b) for a, b in zip(got_caches, ref_caches))
    assert not torch.equal(got_caches[1], plain_caches[1]) and not torch.equal(got, plain)  # the delta is there
    with pytest.raises(ValueError, match="delta must be"):
        run(got, got_caches, delta[:, 1:])


@pytest.mark.parametrize("device,dtype", [(DEVICE, dt) for dt in DTYPES])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_adds_the_o_proj_delta(device, dtype, residual):
    """delta: bit for bit rms_norm of (x + delta) rounded to the dtype, the new residual that sum plus the old."""
    from moelora.kernels.norm.rmsnorm_triton import rms_norm

    g = torch.Generator().manual_seed(5 + residual)
    x, d, r = ((torch.randn(7, 96, generator=g) * s).to(device, dtype) for s in (3, 0.5, 1))
    w = (torch.rand(96, generator=g) + 0.5).to(device, dtype)
    res = r if residual else None
    y, r2 = rms_norm(x, w, 1e-6, res, delta=d)
    y_ref, r_ref = rms_norm(x + d, w, 1e-6, res)
    assert torch.equal(y, y_ref) and (not residual or torch.equal(r2, r_ref))
    assert not torch.equal(y, rms_norm(x, w, 1e-6, res)[0])
    with pytest.raises(ValueError, match="delta must be"):
        rms_norm(x, w, 1e-6, res, delta=d[:, :48])


def _config(defer: str = "on", **fp8) -> KernelConfig:
    return KernelConfig.from_dict({"dense_lora": {"defer": defer}, "fp8": fp8})


@contextlib.contextmanager
def _defer(model, defer: str, **fp8):
    """model (a LoRALinear or a whole model) configured with dense_lora.defer = defer inside the block, the
    defaults again after it."""
    _configure(model, _config(defer, **fp8))
    try:
        yield
    finally:
        _configure(model, KernelConfig())


def _configure(model, cfg: KernelConfig) -> None:
    from moelora.layers.configure import configure_kernels

    configure_kernels(model, cfg)


def _deferred_case(dtype, seed: int, outs=OUTS, bias: bool = False, slots=(0, -1, 3, 1, 2, 0, -1, 1, 3)):
    """A LoRALinear (H -> outs) with 4 adapter slots of ranks 16 / 8 / 4 / 16 on every slice, a batch of `slots`
    (-1: no adapter) and its input: (lin, its LoRAWeights, LoRABatch, x [T, H])."""
    from moelora.layers.linear import LoRALinear

    g = torch.Generator().manual_seed(seed)
    lin = LoRALinear(H, list(outs), bias=bias, dtype=dtype, device=DEVICE)
    lin.weight.copy_(torch.randn(sum(outs), H, generator=g) * 0.05)
    if bias:
        lin.bias.copy_(torch.randn(sum(outs), generator=g))
    w = lin.enable_lora(max_loras=S, max_lora_rank=R)
    for s, r in enumerate((16, 8, 4, 16)):
        for i, out in enumerate(outs):
            w.set_slot(i, s, torch.randn(r, H, generator=g) * 0.1, torch.randn(out, r, generator=g) * 0.1, 2.0)
    lora = LoRABatch.build(list(slots), S, DEVICE)
    return lin, w, lora, torch.randn(len(slots), H, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_deferred_is_forward_split_in_two(dtype):
    """LoRALinear.forward_deferred: (base output, delta) whose sum is forward's output up to one rounding; rows
    without an adapter get a zero delta; with the switch off, or max_loras above DELTA_MAX_GROUPS, or slices off
    the 64-column tiles, it is forward itself and no delta."""
    from moelora.layers.linear import LoRALinear

    slots = [0, -1, 3, 1, 2, 0, -1, 1, 3]
    lin, _, lora, x = _deferred_case(dtype, 1, bias=True, slots=slots)
    with torch.no_grad():
        want = lin(x, lora)
        with _defer(lin, "off"):
            y_off, d_off = lin.forward_deferred(x, lora)
        with _defer(lin, "on"):
            y, delta = lin.forward_deferred(x, lora)
    assert d_off is None and torch.equal(y_off, want)
    assert delta is not None and delta.dtype == dtype
    base = torch.tensor(slots) < 0
    assert torch.equal(y, lin.base(x)) and (delta[base.to(DEVICE)] == 0).all()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y + delta, want, atol=atol, rtol=rtol)
    assert (want - y).abs().max() > 0.05  # the adapters are there
    wide = LoRALinear(H, [40, 24], bias=False, dtype=dtype, device=DEVICE)
    wide.enable_lora(max_loras=S, max_lora_rank=R)
    with torch.no_grad(), _defer(wide, "on"):
        assert wide.forward_deferred(x, lora)[1] is None
    many = LoRABatch.build(slots, DELTA_MAX_GROUPS + 1, DEVICE)  # more slot groups than the delta kernel serves
    with torch.no_grad(), _defer(lin, "on"):
        assert lin.forward_deferred(x, many)[1] is None


def test_the_deferred_backend_is_picked_by_the_config():
    """DenseLoRAConfig.defer: "fp8" defers on FP8 bases only (a reference one here), "on" on every base, "off" never;
    and never for slices off the delta kernel's 64-column tiles."""
    from moelora.layers.dense_lora import pick_dense_lora
    from moelora.layers.fp8 import Fp8State

    fp8 = Fp8State((16, 16), torch.float32, "w8a8")

    def defers(defer: str, quant, bounds=(0, 128, 192, 256)) -> bool:
        return pick_dense_lora(_config(defer), quant, torch.device(DEVICE), list(bounds))[1] is not None

    assert defers("fp8", fp8) and not defers("fp8", None) and defers("on", None) and not defers("off", fp8)
    assert not defers("on", None, (0, 40, 64))


def test_deferred_shrink_splits_by_input_width():
    """The deferred shrink's most splits: min(8, H // DEFER_SHRINK_K_PER_SPLIT), at least 1."""
    from moelora.layers.dense_lora import DEFER_SHRINK_K_PER_SPLIT, defer_shrink_max_splits

    assert DEFER_SHRINK_K_PER_SPLIT == 512
    assert [defer_shrink_max_splits(h) for h in (256, 2048, 4096, 8192)] == [1, 4, 8, 8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_deferred_is_one_shrink_and_one_delta(dtype, monkeypatch):
    """forward_deferred's chain: one shrink at the deferred K tile, then one delta kernel writing every entry (the
    buffer starts as NaN), rows without an adapter exactly 0, the delta of the plain forward up to one rounding."""
    from moelora.layers import dense_lora

    slots = [0, -1, 3, 1, 2, 0, -1, 1, 3]
    lin, _, lora, x = _deferred_case(dtype, 5, slots=slots)
    with torch.no_grad():
        want = lin(x, lora)
    calls = {"shrink": 0, "delta": 0}

    kwargs = []

    def spy(name, fn):
        return lambda *a, **k: kwargs.append(k) or calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    nan_empty = torch.empty
    monkeypatch.setattr(dense_lora, "lora_shrink", spy("shrink", dense_lora.lora_shrink))
    monkeypatch.setattr(dense_lora, "lora_delta", spy("delta", dense_lora.lora_delta))
    # every buffer forward_deferred allocates starts as NaN (torch.empty patched for the test): the delta must be written
    monkeypatch.setattr(dense_lora.torch, "empty", lambda *a, **k: nan_empty(*a, **k).fill_(float("nan")))
    with torch.no_grad(), _defer(lin, "on"):
        y, own = lin.forward_deferred(x, lora)
    assert calls == {"shrink": 1, "delta": 1}
    assert kwargs[0]["block_k"] == dense_lora.DEFER_SHRINK_BLOCK_K == 128  # the deferred shrink's K tile
    assert kwargs[1]["num_warps"] == dense_lora.DEFER_DELTA_WARPS == 8
    assert not own.isnan().any()
    base = (torch.tensor(slots) < 0).to(DEVICE)
    assert (own[base] == 0).all()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(y + own, want, atol=atol, rtol=rtol)
    assert own.abs().max() > 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("quant,batch", [("fp8", 48), ("fp8", 160), (None, 48)])
def test_deferred_dense_lora_in_a_decode_step(tmp_path, quant, batch):
    """A Qwen3-MoE at Qwen3-30B-A3B's attention dims (dummy weights, 2 layers, FP8 or bf16), a decode step of 48 /
    160 sequences over 4 adapters and base rows, deferred (the delta kernel runs twice a layer: qkv, o_proj) against
    the default dense path (on FP8 the GEMM's LoRA epilogue): rows without an adapter bit-equal, graph replay
    bit-equal to eager. Adapter rows: on bf16 within 2^-6 (one more bf16 rounding of q / k / v and of o_proj's
    output a layer: 0.0097 measured); on FP8 within 1.5x the distance between the two default paths (the epilogue,
    and the GEMM then lora_expand: 0.06-0.07 measured). Why so wide on FP8: every FP8 GEMM re-quantizes its input
    to e4m3 (3 mantissa bits), so a 1-ulp bf16 change flips ~3% of an input row's roundings and moves the output
    by ~2%; two correct paths that round the LoRA sum differently land 6-7% apart in the logits."""
    if not ON_GPU or (quant and torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("needs a GPU (FP8: compute capability >= 8.9)")
    from helpers import attention_lora_decode_case
    from test_fp8_gpu import launch_records

    from moelora_bench.common import captured_graph
    from moelora.kernels.lora import delta_triton as ldt
    from moelora.kernels.lora import shrink_expand_triton as lora_triton
    from moelora.layers.dense_lora import DEFER_DELTA_WARPS, DEFER_SHRINK_BLOCK_K, defer_shrink_max_splits

    model, step, ad = attention_lora_decode_case(str(tmp_path), quant, batch)

    with _defer(model, "off"):
        ref = step().clone()
    with _defer(model, "off", lora_epilogue=False):
        other = step().clone()  # the GEMM, then lora_expand (bf16: the default path itself)
    with _defer(model, "on"):
        with launch_records(ldt._lora_delta_kernel) as deltas, launch_records(lora_triton._shrink_kernel) as shrinks:
            eager = step().clone()
        graph, out = captured_graph(step)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
    layers = len(model.model.layers)
    deferred = [r["SPLIT_K"] for r in shrinks if r["BLOCK_K"] == DEFER_SHRINK_BLOCK_K]  # the others walk 64
    assert len(deltas) == 2 * layers
    assert all(r.get("num_warps") == DEFER_DELTA_WARPS for r in deltas), deltas
    # the deferred shrinks, qkv's and o_proj's a layer, split by their input width (Qwen3-30B-A3B: 4 and 8 ways)
    attn = model.model.layers[0].self_attn
    want = [defer_shrink_max_splits(attn.qkv_proj.in_features), defer_shrink_max_splits(attn.o_proj.in_features)]
    assert want == [4, 8] and deferred == want * layers, shrinks
    assert torch.equal(replayed, eager)
    assert torch.equal(eager[~ad], ref[~ad])  # rows without an adapter: not touched by the deferral
    got = _rel(eager[ad], ref[ad])
    if quant:
        spread = _rel(other[ad], ref[ad])
        assert 0 < got < 1.5 * spread, (got, spread)
        assert _rel(eager[ad], other[ad]) < 1.5 * spread
    else:
        assert torch.equal(other, ref)
        assert 0 < got < 2**-6, got
    assert _rel(ref[ad], step(None)[ad]) > 0.1  # the adapters are there (0.3 measured)


@pytest.mark.gpu
def test_deferred_dense_lora_matches_peft_on_a_dequantized_fp8_checkpoint(tmp_path):
    """The deferred path end to end against PEFT: an FP8 checkpoint whose qkv slices sit on the delta kernel's
    64-column tiles (2 heads of 64, 1 KV head: q 128, k 64, v 64), an adapter on q / v / o and the experts; prompt
    log-probabilities against transformers + PEFT on the dequantized weights, mean |d log p| < 0.02 (the bound of
    the FP8 parity test), with the delta kernel having run."""
    if not ON_GPU or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability >= 8.9 (FP8)")
    from fp8_helpers import write_fp8_checkpoint
    from helpers import Runner, peft_logprobs, rows_of, save_peft_adapter, tmp
    from test_fp8_gpu import launch_records
    from transformers import AutoModelForCausalLM

    from moelora.kernels.lora import delta_triton as ldt

    _, fp8, deq, _ = write_fp8_checkpoint(tmp_path, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    base = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    run = Runner(fp8, max_loras=2, max_lora_rank=8, dtype="bfloat16", device="cuda")
    with _defer(run.model, "fp8"):
        run.load("ad", ad)
        rows = rows_of(7, [8, 5, 13])
        with launch_records(ldt._lora_delta_kernel) as deltas:
            got_all = run.logprobs([(r, "ad") for r in rows])
    assert deltas, "the deferred path did not run"
    for ids, got in zip(rows, got_all):
        ref, base_ref = peft_logprobs(base, ad, ids), peft_logprobs(base, None, ids)
        assert (got - ref).abs().mean() < 0.02, (got - ref).abs().mean()
        assert (ref - base_ref).abs().mean() > 0.05
