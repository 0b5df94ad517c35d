"""Triton RMSNorm (+ fused residual add) and fused q/k norm + rotary vs the references (interpreter on the CPU:
fp32 and fp16; compiled on a GPU: bf16 too)."""

import pytest
import torch
from kernel_cases import DEVICE, DTYPES  # sets TRITON_INTERPRET=1 without a GPU

from moelora.kernels.norm.rmsnorm import rms_norm_ref
from moelora.kernels.attention.rotary import apply_rotary_ref, rotary_cos_sin

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [(DEVICE, dt) for dt in DTYPES]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,D", [(1, 32), (7, 48), (33, 256)])
def test_rms_norm_and_add_norm(device, dtype, rows, D):
    from moelora.kernels.norm.rmsnorm_triton import rms_norm

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
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1)])  # programs of QK_ROPE_HEADS heads mixing q, k (and v) heads
def test_qk_norm_rope_in_place_on_qkv_views(device, dtype, norm, Hq, Hkv):
    from moelora.kernels.norm.rmsnorm_triton import qk_norm_rope

    T, D = 5, 16
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
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1)])
def test_qk_norm_rope_writes_the_kv_cache_as_write_kv_does(device, dtype, norm, Hq, Hkv):
    """kv_write: the same launch stores the rotated k and the v rows at slot_mapping, bit for bit what
    write_kv_ref stores after a separate qk_norm_rope; other cache rows and slot -1 rows stay untouched."""
    from moelora.kernels.attention.paged import write_kv_ref
    from moelora.kernels.norm.rmsnorm_triton import qk_norm_rope

    T, D, NB, BS = 5, 16, 3, 4
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
