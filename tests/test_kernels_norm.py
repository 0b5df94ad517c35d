"""Triton RMSNorm (+ fused residual add) and fused q/k norm + rotary vs the references (interpreter on the CPU:
fp32 and fp16; compiled on a GPU: bf16 too)."""

import pytest
import torch
from kernel_cases import DEVICE, DTYPES  # sets TRITON_INTERPRET=1 without a GPU

from moelora.kernels.norm import rms_norm_ref
from moelora.kernels.rotary import apply_rotary_ref, rotary_cos_sin

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [(DEVICE, dt) for dt in DTYPES]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,D", [(1, 32), (7, 48), (33, 256)])
def test_rms_norm_and_add_norm(device, dtype, rows, D):
    from moelora.kernels.norm_triton import rms_norm

    g = torch.Generator().manual_seed(rows * D)
    x = (torch.randn(rows, D, generator=g) * 3).to(device, dtype)
    r = torch.randn(rows, D, generator=g).to(device, dtype)
    w = (torch.rand(D, generator=g) + 0.5).to(device, dtype)
    y, none = rms_norm(x, w, 1e-6)
    assert none is None
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), **_tol(dtype))
    y2, r2 = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(r2, x + r)  # the new residual is the dtype's own sum
    torch.testing.assert_close(y2, rms_norm_ref(x + r, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_in_place_on_qkv_views(device, dtype, norm):
    from moelora.kernels.norm_triton import qk_norm_rope

    T, Hq, Hkv, D = 5, 4, 2, 16
    g = torch.Generator().manual_seed(int(norm))
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 500, 4095], device=device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
    wq = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    wk = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hkv, D)
    rq, rk = q.clone(), k.clone()
    if norm:
        rq, rk = rms_norm_ref(rq, wq, 1e-6), rms_norm_ref(rk, wk, 1e-6)
    cos, sin = rotary_cos_sin(positions, inv_freq, 0.9)
    rq, rk = apply_rotary_ref(rq, cos, sin), apply_rotary_ref(rk, cos, sin)
    v_before = v.clone()
    qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(q, rq, **tol)  # q and k were rewritten in place inside qkv
    torch.testing.assert_close(k, rk, **tol)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_writes_the_kv_cache_as_write_kv_does(device, dtype, norm):
    """kv_write: the same launch stores the rotated k and the v rows at slot_mapping, bit for bit what
    write_kv_ref stores after a separate qk_norm_rope; other cache rows and slot -1 rows stay untouched."""
    from moelora.kernels.attention import write_kv_ref
    from moelora.kernels.norm_triton import qk_norm_rope

    T, Hq, Hkv, D, NB, BS = 5, 4, 2, 16, 3, 4
    g = torch.Generator().manual_seed(7 + int(norm))
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 500, 4095], device=device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
    wq = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    wk = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    slots = torch.tensor([5, 0, 11, -1, 6], device=device)
    caches = [torch.randn(NB, BS, Hkv, D, generator=g).to(device, dtype) for _ in range(2)]
    want_kc, want_vc = (c.clone() for c in caches)

    def views(t):
        q, k, v = t.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)

    ref = qkv.clone()
    rq, rk, rv = views(ref)
    qk_norm_rope(rq, rk, wq, wk, 1e-6, positions, inv_freq, 0.9)
    write_kv_ref(rk, rv, want_kc, want_vc, slots)
    q, k, v = views(qkv)
    qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9, kv_write=(v, caches[0], caches[1], slots))
    assert torch.equal(qkv, ref)  # q, k rotated in place as before, v untouched
    assert torch.equal(caches[0], want_kc) and torch.equal(caches[1], want_vc)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9,
                     kv_write=(v, caches[0].transpose(2, 3), caches[1], slots))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_with_the_next_lora_shrink(device, dtype, residual):
    """set_lora_norm_shrink: the norm also writes the next dense LoRA layer's shrink of its rounded output (one
    program per row and slice; only slice 0's programs store y, the residual and the quantization) — y and the
    residual are unchanged, h equals lora_shrink_ref of y, 0 past each slot's rank and for rows of slot -1, and it
    is attached for the layer that owns this A buffer only."""
    from moelora.kernels.groups import SlotGroups
    from moelora.kernels.lora import lora_shrink_ref
    from moelora.kernels.norm_triton import attached_lora_h, rms_norm

    g = torch.Generator().manual_seed(3 + residual)
    T, D, n, S, R = 9, 48, 3, 4, 8
    x = (torch.randn(T, D, generator=g) * 3).to(device, dtype)
    r = torch.randn(T, D, generator=g).to(device, dtype) if residual else None
    w = (torch.rand(D, generator=g) + 0.5).to(device, dtype)
    ranks = torch.tensor([[8, 4, 0, 2], [8, 8, 4, 0], [2, 0, 8, 4]], dtype=torch.int32)
    a = torch.randn(n, S, R, D, generator=g)
    for i in range(n):
        for s in range(S):
            a[i, s, ranks[i, s]:] = float("nan")  # past the rank: never read
    slots = torch.tensor([0, -1, 1, 2, 3, 0, -1, 2, 1], dtype=torch.int32)
    a, ranks_d, slots_d = a.to(device, dtype), ranks.to(device), slots.to(device)
    plain, plain_res = rms_norm(x, w, 1e-6, r)
    y, res = rms_norm(x, w, 1e-6, r, lora_shrink=(a, ranks_d, slots_d))
    assert torch.equal(y, plain) and (res is None or torch.equal(res, plain_res))
    h = attached_lora_h(y, a)
    assert h is not None and h.shape == (1, n, T, R) and attached_lora_h(y, a.clone()) is None
    assert attached_lora_h(plain, a) is None
    ref = torch.zeros(n, T, R, device=device)
    lora_shrink_ref(y, torch.nan_to_num(a), ranks_d, SlotGroups.build(slots, S, device), ref)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(h[0], ref, **tol)
    assert h[0, :, slots == -1].abs().sum() == 0
    with pytest.raises(ValueError, match="lora_shrink expects"):
        rms_norm(x, w, 1e-6, lora_shrink=(a[..., :-1], ranks_d, slots_d))


def test_decoder_layers_hand_their_input_norm_the_qkv_projection(tmp_path, monkeypatch):
    """The wiring of set_lora_norm_shrink: every decoder layer's input norm is given the batch and the layer's own
    qkv LoRALinear (whose norm_shrink_args decide whether the norm writes its shrink); no other norm is."""
    from helpers import save_tiny_model

    from moelora.adapters.metadata import LoRABatch
    from moelora.config import ModelConfig
    from moelora.engine.batch import SeqChunk, build_flat_batch
    from moelora.engine.kv_cache import KVCache
    from moelora.layers.norm import RMSNorm
    from moelora.models.loader import build_model

    save_tiny_model("qwen3_moe", str(tmp_path / "m"))
    cfg = ModelConfig.from_pretrained(str(tmp_path / "m"))
    model = build_model(cfg, load_format="dummy", max_loras=2, max_lora_rank=8)
    seen = []
    real_forward, real_add = RMSNorm.forward, RMSNorm.add_norm

    def forward(self, x, lora=None, lora_next=None):
        seen.append((self, lora, lora_next))
        return real_forward(self, x, lora, lora_next)

    def add_norm(self, x, residual, lora=None, lora_next=None, delta=None):
        assert delta is None  # (set_dense_lora_defer hands o_proj's delta over on a GPU only)
        seen.append((self, lora, lora_next))
        return real_add(self, x, residual, lora, lora_next, delta)

    monkeypatch.setattr(RMSNorm, "forward", forward)
    monkeypatch.setattr(RMSNorm, "add_norm", add_norm)
    kv = KVCache(cfg, 8, 4, torch.float32, "cpu")
    fb = build_flat_batch([SeqChunk([1, 2, 3, 4, 5], 0, kv.allocate(2), 0)], 4)
    lora = LoRABatch.build(fb.token_slots, 2)
    model(fb.input_ids, fb.positions, fb.attn, kv.caches, lora)
    layers = model.model.layers
    inputs = [(lo, nxt) for norm, lo, nxt in seen if any(norm is layer.input_layernorm for layer in layers)]
    assert inputs == [(lora, layer.self_attn.qkv_proj) for layer in layers]
    assert all(nxt is None for norm, _, nxt in seen if all(norm is not layer.input_layernorm for layer in layers))
