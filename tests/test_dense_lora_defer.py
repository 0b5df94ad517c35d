"""set_dense_lora_defer: the dense LoRA delta as a tensor of its own (kernels/lora_delta_triton.py), added by the
kernel that reads the base GEMM's output next (qk_norm_rope for qkv_proj, the post-attention RMSNorm for o_proj).
CPU: the kernels under the interpreter (fp32 / fp16) against their references and against the plain forward; GPU:
compiled in bf16, and a decode step of an FP8 model at Qwen3-30B-A3B's attention dims with the switch on against
off, eagerly and in a CUDA graph."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, ON_GPU, token_slots, tolerance  # sets TRITON_INTERPRET=1 without a GPU

from moelora.adapters.metadata import LoRABatch
from moelora.kernels import _triton
from moelora.kernels.groups import SlotGroups
from moelora.kernels.lora_delta_triton import DELTA_MAX_GROUPS, delta_ok, lora_delta, lora_delta_ref

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [(64, 128), (16, 256), (32, 64)])
def test_lora_delta_tile_changes_no_result(tile, dtype):
    """set_lora_delta_tile: a forced row / column tile gives lora_delta_ref's delta (every row written, rows of slot
    -1 exactly 0); the wide column tile is taken only where every slice boundary is a multiple of it."""
    from moelora.kernels import lora_delta_triton as ldt

    outs = [256, 128, 128]
    gen = torch.Generator().manual_seed(sum(tile))
    b, ranks, scaling, off = _factors(dtype, gen, outs=outs)
    slots = token_slots("with_base_rows", 40, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    h = torch.randn(2, len(outs), 40, R, generator=gen).to(DEVICE)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    before = ldt.lora_delta_tile()
    try:
        ldt.set_lora_delta_tile(*tile)
        assert ldt._block_n(tuple(off)) == (tile[1] if tile[1] <= 128 else ldt.DELTA_BLOCK_N)  # 384 % 256 != 0
        delta = torch.full((40, sum(outs)), float("nan"), dtype=dtype, device=DEVICE)
        lora_delta(h, b, off_t, tuple(off), ranks, scaling, groups.token_slots, groups.active_slots, delta)
    finally:
        ldt.set_lora_delta_tile(*before)
    want = lora_delta_ref(h, b, off_t, ranks, scaling, groups, dtype)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(delta, want, atol=atol, rtol=rtol)
    assert (delta[(slots < 0).to(DEVICE)] == 0).all() and delta.abs().max() > 0.01
    with pytest.raises(ValueError, match="block_n"):
        ldt.set_lora_delta_tile(32, 96)


def test_lora_delta_tile_only_from_a_width():
    """set_lora_delta_tile_min_o: the forced tile serves layers of at least that many output columns, the default
    tile the narrower ones; the delta is the reference's either way."""
    from test_fp8_gpu import launch_records

    from moelora.kernels import lora_delta_triton as ldt

    dtype = DTYPES[0]
    outs = [256, 128, 128]
    gen = torch.Generator().manual_seed(29)
    b, ranks, scaling, off = _factors(dtype, gen, outs=outs)
    slots = token_slots("with_base_rows", 40, S, gen)
    groups = SlotGroups.build(slots, S, DEVICE)
    h = torch.randn(2, len(outs), 40, R, generator=gen).to(DEVICE)
    off_t = torch.tensor(off, dtype=torch.int32, device=DEVICE)
    want = lora_delta_ref(h, b, off_t, ranks, scaling, groups, dtype)
    try:
        ldt.set_lora_delta_tile(64, 128)
        default = (ldt._block_m(40, False), ldt.DELTA_BLOCK_N)
        assert default != (64, 128)
        for min_o, tile in ((1024, default), (512, (64, 128)), (0, (64, 128))):  # the layer has 512 columns
            ldt.set_lora_delta_tile_min_o(min_o)
            delta = torch.full((40, sum(outs)), float("nan"), dtype=dtype, device=DEVICE)
            with launch_records(ldt._lora_delta_kernel) as rec:
                lora_delta(h, b, off_t, tuple(off), ranks, scaling, groups.token_slots, groups.active_slots, delta)
            assert (rec[0]["BLOCK_M"], rec[0]["BLOCK_N"]) == tile, (min_o, rec)
            atol, rtol = tolerance(dtype)
            torch.testing.assert_close(delta, want, atol=atol, rtol=rtol)
    finally:
        ldt.set_lora_delta_tile(0, 0)
        ldt.set_lora_delta_tile_min_o(0)
    with pytest.raises(ValueError, match="min_o"):
        ldt.set_lora_delta_tile_min_o(-1)


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
        from moelora.kernels.norm_triton import qk_norm_rope

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
    from moelora.kernels.norm_triton import rms_norm

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


@contextlib.contextmanager
def _defer(on: bool | str):
    before = _triton.dense_lora_defer()
    _triton.set_dense_lora_defer(on)
    try:
        yield
    finally:
        _triton.set_dense_lora_defer(before)


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


def test_defer_order_main_and_base_into_an_output():
    """set_dense_defer_order takes "main" (the chain on the main stream, the GEMM on the side stream) and refuses
    other names; LoRALinear.base(x, out=) writes the caller's tensor with base(x)'s values (what the side stream's GEMM
    does in that order)."""
    before = _triton.dense_defer_order()
    try:
        _triton.set_dense_defer_order("main")
        assert _triton.dense_defer_order() == "main"
        with pytest.raises(ValueError, match="'chain', 'gemm', 'serial' or 'main'"):
            _triton.set_dense_defer_order("side")
    finally:
        _triton.set_dense_defer_order(before)
    lin, _, _, x = _deferred_case(torch.float32, 3, bias=True)
    out = torch.full((x.shape[0], sum(OUTS)), float("nan"), device=DEVICE)
    assert lin.base(x, out=out) is out and torch.equal(out, lin.base(x))


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
        with _defer(False):
            y_off, d_off = lin.forward_deferred(x, lora)
        with _defer(True):
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
    with torch.no_grad(), _defer(True):
        assert wide.forward_deferred(x, lora)[1] is None


def test_deferred_chain_launch_experiments_change_no_result():
    """Session 28's launch switches of the deferred chain: set_lora_shrink_warps / set_lora_delta_warps reach the
    two kernels' launches (num_warps; the delta's forced warps win over the chain's default) and give the same
    delta bit for bit; set_dense_defer_k_per_split sets the
    shrink's most splits by H (min(8, H // k), k = DEFER_SHRINK_K_PER_SPLIT when 0); bad values raise."""
    from test_fp8_gpu import launch_records

    from moelora.kernels import lora_delta_triton as ldt
    from moelora.kernels import lora_triton
    from moelora.layers.linear import DEFER_SHRINK_K_PER_SPLIT, defer_shrink_max_splits

    dtype = DTYPES[0]
    lin, _, lora, x = _deferred_case(dtype, 3, bias=False, slots=[0, -1, 3, 1, 2, 0, 1])
    with torch.no_grad(), _defer(True):
        y0, d0 = lin.forward_deferred(x, lora)
        try:
            lora_triton.set_lora_shrink_warps(2)
            ldt.set_lora_delta_warps(2)  # in place of the chain's DEFER_DELTA_WARPS (8)
            assert (lora_triton.lora_shrink_warps(), ldt.lora_delta_warps()) == (2, 2)
            with launch_records(lora_triton._shrink_kernel) as shrinks, launch_records(ldt._lora_delta_kernel) as deltas:
                y, d = lin.forward_deferred(x, lora)
        finally:
            lora_triton.set_lora_shrink_warps(0)
            ldt.set_lora_delta_warps(0)
    assert [r.get("num_warps") for r in shrinks] == [2] and [r.get("num_warps") for r in deltas] == [2]
    assert torch.equal(y, y0) and torch.equal(d, d0) and d.abs().max() > 0.01
    for bad in (3, 16, -1):
        with pytest.raises(ValueError, match="num_warps"):
            lora_triton.set_lora_shrink_warps(bad)
        with pytest.raises(ValueError, match="num_warps"):
            ldt.set_lora_delta_warps(bad)
    assert DEFER_SHRINK_K_PER_SPLIT == 512
    assert [defer_shrink_max_splits(h) for h in (256, 2048, 4096, 8192)] == [1, 4, 8, 8]
    try:
        _triton.set_dense_defer_k_per_split(1024)
        assert [defer_shrink_max_splits(h) for h in (256, 2048, 4096, 8192)] == [1, 2, 4, 8]
    finally:
        _triton.set_dense_defer_k_per_split(0)
    assert _triton.dense_defer_k_per_split() == 0
    for bad in (100, 32, -64):
        with pytest.raises(ValueError, match="power of two"):
            _triton.set_dense_defer_k_per_split(bad)


@pytest.mark.parametrize("mode", ["own", "next", "both"])
def test_l2_prefetch_reaches_the_chain_and_changes_no_result(mode, monkeypatch):
    """set_lora_l2_prefetch (session 37): "own" hands the shrink its layer's B to prefetch, "next" hands the delta
    kernel the next deferred layer's (A, B) (one slice, as o_proj after qkv_proj), "both" both; the outputs stay bit
    for bit what mode "0" gives (on the CPU the launchers take no PTX; the sm_90 compile is in fp8_aot.py, the GPU
    decode step in test_deferred_dense_lora_in_a_decode_step). A next layer of several slices is not prefetched;
    bad modes and tensors whose slots are not contiguous are refused."""
    from moelora.kernels import lora_delta_triton as ldt
    from moelora.kernels import lora_triton
    from moelora.kernels.lora_triton import l2_prefetch_args

    dtype = DTYPES[0]
    lin, w, lora, x = _deferred_case(dtype, 5)
    nxt_lin, nxt, _, _ = _deferred_case(dtype, 6, outs=[64])
    with torch.no_grad(), _defer(True):
        y0, d0 = lin.forward_deferred(x, lora, prefetch_next=nxt)
        calls: dict[str, list] = {"shrink": [], "delta": []}
        real_shrink, real_delta = lora_triton.lora_shrink, ldt.lora_delta
        monkeypatch.setattr(lora_triton, "lora_shrink",
                            lambda *a, **k: (calls["shrink"].append(k.get("prefetch_b")), real_shrink(*a, **k))[1])
        monkeypatch.setattr(ldt, "lora_delta",
                            lambda *a, **k: (calls["delta"].append(k.get("prefetch")), real_delta(*a, **k))[1])
        try:
            _triton.set_lora_l2_prefetch(mode)
            y, d = lin.forward_deferred(x, lora, prefetch_next=nxt)
            multi = lin.forward_deferred(x, lora, prefetch_next=w)  # a next layer of 3 slices: no A prefetch
        finally:
            _triton.set_lora_l2_prefetch("0")
    assert torch.equal(y, y0) and torch.equal(d, d0) and torch.equal(multi[1], d0)
    own, nxt_pf = mode in ("own", "both"), mode in ("next", "both")
    assert calls["shrink"][0] is (w.b_cat if own else None)
    assert (calls["delta"][0] is not None) == nxt_pf and calls["delta"][1] is None
    if nxt_pf:
        assert calls["delta"][0][0] is nxt.a and calls["delta"][0][1] is nxt.b_cat
    args = l2_prefetch_args(nxt.b_cat, "pfb")
    assert args["pfb_bytes"] == nxt.b_cat[0].numel() * nxt.b_cat.element_size() and args["PREFETCH"]
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch_args(nxt.b_cat.transpose(1, 2), "pfb")
    with pytest.raises(ValueError, match="a \\[1, S, R, H\\]"):
        ldt._prefetch_args((w.a, w.b_cat))
    with pytest.raises(ValueError, match="one of"):
        _triton.set_lora_l2_prefetch("all")


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_deferred_takes_the_producers_shrink(dtype, monkeypatch):
    """A shrink written by the kernel that produced x (attach_lora_h: the decode attention's per-head partial sums
    for o_proj, set_lora_attn_shrink): forward_deferred launches no shrink of its own and its delta adds those
    partials (the same delta as its own shrink's, up to fp32 summation order; 2x the partials give 2x the delta);
    producer_shrink_args offers the producer the shrink when the layer defers, also without the FP8 epilogue."""
    from moelora.kernels import lora_triton
    from moelora.kernels.norm_triton import attach_lora_h
    parts, slots = 4, [0, -1, 3, 1, 2, 0, -1, 1]
    lin, w, lora, x = _deferred_case(dtype, 3, outs=[OUTS[1]], slots=slots)  # o_proj-like: one slice
    T = len(slots)
    with torch.no_grad(), _defer(True):
        _, own = lin.forward_deferred(x, lora)
        assert lin.producer_shrink_args(x, lora) is not None
        with _defer(False):
            assert lin.producer_shrink_args(x, lora) is None  # bf16 base, not deferred: no FP8 epilogue to take it
        # the producer's partials: x's columns in `parts` chunks, each against its slot's A (0 for rows of slot -1)
        a = w.a[0][torch.tensor(slots).clamp(min=0).to(DEVICE)].float()  # [T, R, H]
        xs = x.float().view(T, parts, H // parts)
        h = torch.einsum("tpk,trpk->ptr", xs, a.view(T, R, parts, H // parts))
        h = (h * (torch.tensor(slots, device=DEVICE) >= 0)[None, :, None]).reshape(parts, 1, T, R).contiguous()
        shrinks = []
        real = lora_triton.lora_shrink
        monkeypatch.setattr(lora_triton, "lora_shrink", lambda *a, **k: shrinks.append(1) or real(*a, **k))
        deltas = []
        for scale in (1.0, 2.0):
            xc = x.clone()
            attach_lora_h(xc, h * scale, w.a)
            deltas.append(lin.forward_deferred(xc, lora)[1])
        assert not shrinks
        _, again = lin.forward_deferred(x, lora)  # unmarked x: its own shrink again
        assert len(shrinks) == 1 and torch.equal(again, own)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(deltas[0], own, atol=atol, rtol=rtol)
    torch.testing.assert_close(deltas[1], 2 * own, atol=2 * atol, rtol=rtol)
    assert own.abs().max() > 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_deferred_fused_chain_is_one_launch(dtype, monkeypatch):
    """set_dense_defer_fused: forward_deferred's delta from one lora_fused_decode launch in store mode (no shrink,
    no delta kernel): the default chain's delta up to fp32 summation order, rows without an adapter exactly 0 (the
    buffer starts as NaN: every entry written)."""
    from moelora.kernels import lora_delta_triton, lora_triton
    from moelora.layers import linear

    slots = [0, -1, 3, 1, 2, 0, -1, 1, 3]
    lin, _, lora, x = _deferred_case(dtype, 5, slots=slots)
    calls = {"shrink": 0, "delta": 0, "fused": 0}

    kwargs = []

    def spy(name, fn):
        return lambda *a, **k: kwargs.append(k) or calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    nan_empty = torch.empty
    monkeypatch.setattr(lora_triton, "lora_shrink", spy("shrink", lora_triton.lora_shrink))
    monkeypatch.setattr(lora_delta_triton, "lora_delta", spy("delta", lora_delta_triton.lora_delta))
    monkeypatch.setattr(linear, "lora_fused_decode", spy("fused", linear.lora_fused_decode))
    # every buffer forward_deferred allocates starts as NaN (torch.empty patched for the test): the delta must be written
    monkeypatch.setattr(linear.torch, "empty", lambda *a, **k: nan_empty(*a, **k).fill_(float("nan")))
    before = _triton.dense_defer_fused()
    try:
        with torch.no_grad(), _defer(True):
            _, own = lin.forward_deferred(x, lora)
            assert calls == {"shrink": 1, "delta": 1, "fused": 0}
            assert kwargs[0]["block_k"] == linear.DEFER_SHRINK_BLOCK_K == 128  # the deferred shrink's K tile
            _triton.set_dense_defer_fused(True)
            _, fused = lin.forward_deferred(x, lora)
            assert calls == {"shrink": 1, "delta": 1, "fused": 1}
    finally:
        _triton.set_dense_defer_fused(before)
    assert not fused.isnan().any()
    base = (torch.tensor(slots) < 0).to(DEVICE)
    assert (fused[base] == 0).all()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(fused, own, atol=atol, rtol=rtol)
    assert own.abs().max() > 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("quant,batch,fused", [("fp8", 48, False), ("fp8", 160, False), (None, 48, False),
                                               ("fp8", 48, True), (None, 48, True), ("fp8", 48, "one"),
                                               ("fp8", 160, "one"), (None, 48, "one"), ("fp8", 48, "gemm"),
                                               ("fp8", 160, "gemm"), ("fp8", 48, "gemm14"),
                                               ("fp8", 48, "prefetch"), ("fp8", 160, "prefetch")])
def test_deferred_dense_lora_in_a_decode_step(tmp_path, quant, batch, fused):
    """A Qwen3-MoE at Qwen3-30B-A3B's attention dims (dummy weights, 2 layers, FP8 or bf16), a decode step of 48 /
    160 sequences over 4 adapters and base rows, deferred (the delta kernel runs twice a layer: qkv, o_proj) against
    the default dense path (on FP8 the GEMM's LoRA epilogue): rows without an adapter bit-equal, graph replay
    bit-equal to eager. Adapter rows: on bf16 within 2^-6 (one more bf16 rounding of q / k / v and of o_proj's
    output a layer: 0.0097 measured); on FP8 within 1.5x the distance between the two default paths (the epilogue,
    and the GEMM then lora_expand: 0.06-0.07 measured). Why so wide on FP8: every FP8 GEMM re-quantizes its input
    to e4m3 (3 mantissa bits), so a 1-ulp bf16 change flips ~3% of an input row's roundings and moves the output
    by ~2%; two correct paths that round the LoRA sum differently land 6-7% apart in the logits (session 24,
    scripts/diag_dense_lora_paths.py; session 23's consumer-expand test failed on exactly this).
    fused (set_dense_defer_fused): the chain is one lora_fused_decode launch a projection, no shrink, no delta
    kernel; the same bounds. fused "one" (set_dense_defer_one_launch): the chain is one lora_chain launch a
    projection; the same bounds. fused "gemm" (set_dense_defer_gemm "128x1/64x2"): the default chain, the deferred
    GEMMs at their own launch (qkv 128-wide tiles unsplit, o_proj 2 K splits where the default takes 4): o_proj's
    other fp32 order may move rows without an adapter by an ulp, so those too are held to the FP8 bound; "gemm14"
    ("64x1s14/0"): qkv's GEMM at 14 stages, the same sums, rows without an adapter bit-equal. fused "prefetch"
    (set_lora_l2_prefetch "both"): the same launches with the L2 prefetches, bit-equal to the deferral without them,
    eagerly and on replay."""
    if not ON_GPU or (quant and torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("needs a GPU (FP8: compute capability >= 8.9)")
    from helpers import attention_lora_decode_case
    from test_fp8_gpu import launch_records

    from moelora.bench.common import captured_graph
    from moelora.kernels import fp8_triton
    from moelora.kernels import lora_delta_triton as ldt

    model, step, ad = attention_lora_decode_case(str(tmp_path), quant, batch)

    with _defer(False):
        ref = step().clone()
        fp8_triton.set_fp8_lora_epilogue(False)
        try:
            other = step().clone()  # the GEMM, then lora_expand (bf16: the default path itself)
        finally:
            fp8_triton.set_fp8_lora_epilogue(True)
    from moelora.kernels import lora_triton
    from moelora.layers.linear import DEFER_DELTA_WARPS, DEFER_SHRINK_BLOCK_K, defer_shrink_max_splits

    from moelora.kernels import lora_chain_triton as lct
    from moelora.kernels import lora_fused_triton as lft

    _triton.set_dense_defer_fused(fused is True)
    _triton.set_dense_defer_one_launch(fused == "one")
    fp8_triton.set_dense_defer_gemm({"gemm": "128x1/64x2", "gemm14": "64x1s14/0"}.get(fused, "0"))
    plain = None
    if fused == "prefetch":
        with _defer(True):
            plain = step().clone()  # the deferral without the prefetches
        _triton.set_lora_l2_prefetch("both")
    try:
        with _defer(True):
            with launch_records(ldt._lora_delta_kernel) as deltas, launch_records(
                    lora_triton._shrink_kernel) as shrinks, launch_records(lft._lora_fused_decode_kernel) as chains, \
                    launch_records(lct._lora_chain_kernel) as ones, launch_records(fp8_triton._fp8_gemm_kernel) as gemms:
                eager = step().clone()
            graph, out = captured_graph(step)
            graph.replay()
            graph.replay()  # twice: one-launch chains left their counters at zero for the next replay
            torch.cuda.synchronize()
            replayed = out.clone()
    finally:
        _triton.set_dense_defer_fused(False)
        _triton.set_dense_defer_one_launch(False)
        fp8_triton.set_dense_defer_gemm("0")
        _triton.set_lora_l2_prefetch("0")
    layers = len(model.model.layers)
    if plain is not None:
        assert torch.equal(eager, plain) and torch.equal(replayed, plain)
    gemm_launch = fused == "gemm"
    dense = [(r["BLOCK_N"], r["SPLIT_K"], r.get("num_stages")) for r in gemms if not r["GROUPED"]]
    if gemm_launch:  # the deferred GEMMs at the switch's launches (decode never takes 128-wide tiles otherwise)
        assert [d[:2] for d in dense].count((128, 1)) == layers and [d[:2] for d in dense].count((64, 2)) >= layers
    elif fused == "gemm14":
        assert [d[2] for d in dense].count(14) == layers, dense
    else:
        assert (128, 1) not in [d[:2] for d in dense] and 14 not in [d[2] for d in dense], dense
    fused = False if fused in ("gemm", "gemm14", "prefetch") else fused
    deferred = [r["SPLIT_K"] for r in shrinks if r["BLOCK_K"] == DEFER_SHRINK_BLOCK_K]  # the others walk 64
    if fused == "one":
        assert not deltas and not chains and len(ones) == 2 * layers, ones
        assert not deferred, shrinks
    elif fused:
        assert not deltas and len(chains) == 2 * layers and all(r["STORE"] for r in chains), chains
        assert not deferred, shrinks
    else:
        assert len(deltas) == 2 * layers and not chains and not ones
        assert all(r.get("num_warps") == DEFER_DELTA_WARPS for r in deltas), deltas
        # the deferred shrinks, qkv's and o_proj's a layer, split by their input width (Qwen3-30B-A3B: 4 and 8 ways)
        attn = model.model.layers[0].self_attn
        want = [defer_shrink_max_splits(attn.qkv_proj.in_features), defer_shrink_max_splits(attn.o_proj.in_features)]
        assert want == [4, 8] and deferred == want * layers, shrinks
    assert torch.equal(replayed, eager)
    if gemm_launch and quant:
        assert _rel(eager[~ad], ref[~ad]) < 1.5 * _rel(other[ad], ref[ad])
    else:
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

    from moelora.kernels import lora_delta_triton as ldt

    _, fp8, deq, _ = write_fp8_checkpoint(tmp_path, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    base = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ad = tmp(tmp_path, "ad")
    save_peft_adapter(base, ad, 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with _defer("fp8"):
        run = Runner(fp8, max_loras=2, max_lora_rank=8, dtype="bfloat16", device="cuda")
        run.load("ad", ad)
        rows = rows_of(7, [8, 5, 13])
        with launch_records(ldt._lora_delta_kernel) as deltas:
            got_all = run.logprobs([(r, "ad") for r in rows])
    assert deltas, "the deferred path did not run"
    for ids, got in zip(rows, got_all):
        ref, base_ref = peft_logprobs(base, ad, ids), peft_logprobs(base, None, ids)
        assert (got - ref).abs().mean() < 0.02, (got - ref).abs().mean()
        assert (ref - base_ref).abs().mean() > 0.05


@pytest.mark.gpu
@torch.no_grad()
def test_deferred_chain_issued_after_the_gemm_changes_nothing(tmp_path):
    """set_dense_defer_order("gemm" / "serial" / "main"): the same kernels on the same inputs, only issued in another
    order (or on one stream, or the chain on the main stream and the GEMM on the side stream writing an output made
    on the main stream — also with set_lora_shrink_pdl, the shrink PDL-launched after x's producer), so the decode
    step is bit-equal to the default order, eagerly and on graph replay."""
    if not ON_GPU or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability >= 8.9 (FP8)")
    from helpers import attention_lora_decode_case

    from moelora.bench.common import captured_graph

    _, step, ad = attention_lora_decode_case(str(tmp_path), "fp8", 48)
    before = _triton.dense_defer_order(), _triton.lora_shrink_pdl_enabled()
    outs = []
    try:
        with _defer(True):
            for order in ("chain", "gemm", "serial", "main", "main_pdl"):
                _triton.set_dense_defer_order(order.removesuffix("_pdl"))
                _triton.set_lora_shrink_pdl(order.endswith("_pdl"))
                eager = step().clone()
                graph, out = captured_graph(step)
                graph.replay()
                torch.cuda.synchronize()
                outs += [eager, out.clone()]
    finally:
        _triton.set_dense_defer_order(before[0])
        _triton.set_lora_shrink_pdl(before[1])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert _rel(outs[0][ad], step(None)[ad]) > 0.1  # the adapters are there
