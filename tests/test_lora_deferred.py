"""set_lora_consumer_expand: a projection's dense LoRA expand added by the kernel reading its output (RMSNorm,
fused q/k norm + rotary + KV write) against the torch references (interpreter on the CPU: fp32 and fp16)."""

import pytest
import torch
from kernel_cases import DEVICE, DTYPES  # sets TRITON_INTERPRET=1 without a GPU

from moelora.kernels.lora_deferred import (
    PendingExpand, apply_pending_ref, attach_lora_expand, pending_delta_ref, take_lora_expand,
)
from moelora.kernels.norm import rms_norm_ref

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [(DEVICE, dt) for dt in DTYPES]


def _pending(g, T, bounds, S, R, ranks, slots, dtype, device, split_k=2):
    """A PendingExpand with random h partials and B, NaN past each slot's rank in B and in h, and in h's rows of
    slot -1 (what the shrink leaves unwritten: never read)."""
    n = len(bounds) - 1
    O = bounds[-1]
    h = torch.randn(split_k, n, T, R, generator=g)
    for t, s in enumerate(slots.tolist()):
        for i in range(n):
            h[:, i, t, (int(ranks[i, s]) if s >= 0 else 0):] = float("nan")
    b = torch.randn(S, O, R, generator=g) * 0.5
    for i in range(n):
        for s in range(S):
            b[s, bounds[i]:bounds[i + 1], int(ranks[i, s]):] = float("nan")
    scaling = torch.rand(n, S, generator=g) + 0.5
    return PendingExpand(h.to(device), b.to(device, dtype), ranks.to(device), scaling.to(device),
                         slots.to(device), tuple(bounds))


def _clean(p: PendingExpand) -> PendingExpand:
    return PendingExpand(torch.nan_to_num(p.h), torch.nan_to_num(p.b_cat), p.ranks, p.scaling, p.token_slots,
                         p.slice_bounds)


def test_pending_delta_ref_matches_lora_expand_ref():
    """The consumer's delta equals lora_expand_ref's on a zero output (h rounded to B's dtype first)."""
    from moelora.kernels.groups import SlotGroups
    from moelora.kernels.lora import lora_expand_ref

    g = torch.Generator().manual_seed(0)
    ranks = torch.tensor([[8, 4, 0], [2, 8, 8]], dtype=torch.int32)
    slots = torch.tensor([0, -1, 1, 2, 2, 0], dtype=torch.int32)
    p = _clean(_pending(g, 6, (0, 24, 40), 3, 8, ranks, slots, torch.float32, "cpu"))
    y = torch.zeros(6, 40)
    lora_expand_ref(p.h.sum(0), p.b_cat, torch.tensor(p.slice_bounds, dtype=torch.int32), p.ranks, p.scaling,
                    SlotGroups.build(slots, 3, "cpu"), y)
    torch.testing.assert_close(pending_delta_ref(p), y, rtol=1e-6, atol=1e-6)
    assert pending_delta_ref(p)[1].abs().sum() == 0  # slot -1: nothing
    x = torch.randn(6, 40)
    attach_lora_expand(x, p)
    assert take_lora_expand(x) is p and take_lora_expand(x) is None  # taken once


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_adds_the_deferred_o_proj_expand(device, dtype, residual):
    """rms_norm(lora_expand=p): x + delta rounded once, then the residual add and the norm, as the references;
    rows of slot -1 and slots of rank 0 exactly as without it."""
    from moelora.kernels.norm_triton import rms_norm

    g = torch.Generator().manual_seed(11 + residual)
    T, D, S, R = 7, 64, 3, 8
    ranks = torch.tensor([[8, 0, 4]], dtype=torch.int32)
    slots = torch.tensor([0, -1, 2, 1, 0, 2, -1], dtype=torch.int32)
    p = _pending(g, T, (0, D), S, R, ranks, slots, dtype, device)
    x = (torch.randn(T, D, generator=g) * 3).to(device, dtype)
    r = torch.randn(T, D, generator=g).to(device, dtype) if residual else None
    w = (torch.rand(D, generator=g) + 0.5).to(device, dtype)
    y, res = rms_norm(x, w, 1e-6, r, lora_expand=p)
    xd = apply_pending_ref(x, _clean(p))
    want_in = xd + r if residual else xd
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, rms_norm_ref(want_in, w, 1e-6), **tol)
    if residual:
        torch.testing.assert_close(res, want_in, **tol)
    plain, plain_res = rms_norm(x, w, 1e-6, r)
    same = (slots == -1) | (slots == 1)  # no adapter, or a slot without this module (rank 0)
    assert torch.equal(y[same.to(device)], plain[same.to(device)])
    assert not torch.allclose(y[~same.to(device)], plain[~same.to(device)], **tol)  # the delta is there
    with pytest.raises(ValueError, match="rms_norm: pending LoRA expand"):
        rms_norm(x[:-1], w, 1e-6, None if r is None else r[:-1], lora_expand=p)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_adds_the_deferred_qkv_expand(device, dtype, norm):
    """qk_norm_rope(lora_expand=p): q, k and v heads get their slice's delta (rounded once) before the norm, the
    rotary and the cache writes; equals the references run on apply_pending_ref(qkv)."""
    from moelora.kernels.attention import write_kv_ref
    from moelora.kernels.norm_triton import qk_norm_rope
    from moelora.kernels.rotary import apply_rotary_ref, rotary_cos_sin

    T, Hq, Hkv, D, NB, BS, S, R = 5, 4, 2, 16, 3, 4, 3, 8
    g = torch.Generator().manual_seed(23 + int(norm))
    bounds = (0, Hq * D, (Hq + Hkv) * D, (Hq + 2 * Hkv) * D)
    ranks = torch.tensor([[8, 2, 0], [4, 8, 8], [8, 0, 4]], dtype=torch.int32)
    slots = torch.tensor([2, 0, -1, 1, 2], dtype=torch.int32)
    p = _pending(g, T, bounds, S, R, ranks, slots, dtype, device)
    qkv = torch.randn(T, bounds[-1], generator=g).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 500, 4095], device=device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
    wq = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    wk = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if norm else None
    kv_slots = torch.tensor([5, 0, 11, 2, 6], device=device)
    caches = [torch.zeros(NB, BS, Hkv, D, device=device, dtype=dtype) for _ in range(2)]
    want = [c.clone() for c in caches]

    def views(t):
        q, k, v = t.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)

    rq, rk, rv = views(apply_pending_ref(qkv, _clean(p)))
    if norm:
        rq, rk = rms_norm_ref(rq, wq, 1e-6), rms_norm_ref(rk, wk, 1e-6)
    cos, sin = rotary_cos_sin(positions, inv_freq, 0.9)
    rq, rk = apply_rotary_ref(rq, cos, sin), apply_rotary_ref(rk, cos, sin)
    write_kv_ref(rk, rv, want[0], want[1], kv_slots)
    q, k, v = views(qkv)
    qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9, kv_write=(v, caches[0], caches[1], kv_slots),
                 lora_expand=p)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(q, rq, **tol)
    torch.testing.assert_close(k, rk, **tol)
    torch.testing.assert_close(caches[0], want[0], **tol)
    torch.testing.assert_close(caches[1], want[1], **tol)
    with pytest.raises(ValueError, match="needs kv_write"):
        qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9, lora_expand=p)
    bad = PendingExpand(p.h, p.b_cat, p.ranks, p.scaling, p.token_slots, (0, Hq * D, bounds[-1] - Hkv * D + 8,
                                                                           bounds[-1]))
    with pytest.raises(ValueError, match="expected q, k, v"):
        qk_norm_rope(q, k, wq, wk, 1e-6, positions, inv_freq, 0.9, kv_write=(v, caches[0], caches[1], kv_slots),
                     lora_expand=bad)


def test_consumer_expand_switch_takes_both_one_or_no_projection(monkeypatch):
    """set_lora_consumer_expand: True / "1" both projections, "qkv" or "o_proj" one, False / "0" none; anything else
    is refused naming the choices; bench decode --ab sets it through its switch table."""
    from moelora.bench.switches import SWITCHES
    from moelora.kernels import _triton

    before = _triton.lora_consumer_expand_mode()
    try:
        for mode, qkv, o in [(True, True, True), ("qkv", True, False), ("o_proj", False, True), (False, False, False)]:
            _triton.set_lora_consumer_expand(mode)
            assert (_triton.lora_consumer_expand("qkv"), _triton.lora_consumer_expand("o_proj")) == (qkv, o)
            assert _triton.lora_consumer_expand() == (qkv or o)
        with pytest.raises(ValueError, match="qkv"):
            _triton.set_lora_consumer_expand("gate_up_proj")
        set_, get, values = SWITCHES["MOELORA_LORA_CONSUMER_EXPAND"]
        assert values == _triton.CONSUMER_EXPAND_MODES
        set_("o_proj")
        assert get() == "o_proj" and _triton.lora_consumer_expand("o_proj") and not _triton.lora_consumer_expand("qkv")
    finally:
        _triton.set_lora_consumer_expand(before)
