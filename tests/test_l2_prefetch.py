"""set_weight_l2_prefetch (kernels/l2_prefetch.py): base weights prefetched into L2 on a stream of their own, beside
the latency-bound kernels before the GEMM that reads them.

CPU: the byte ranges asked for, the switches, and where a decoder layer issues each prefetch (a recording stand-in,
since the prefetch is PTX and launches nothing on the CPU); the sm_90 compile of both forms is in fp8_aot.py.
GPU (marked gpu): an FP8 decode step at Qwen3-30B-A3B's attention dims bit-equal with every mode and form against
none, eagerly and replayed from a CUDA graph, with the launches each mode implies."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import ON_GPU  # sets TRITON_INTERPRET=1 without a GPU

from moelora.kernels import l2_prefetch as pf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_expert_rows_range_takes_the_first_rows_of_every_expert():
    w = torch.zeros(6, 40, 24, dtype=torch.int8)
    r = pf.expert_rows_range(w, 16)
    assert (r.count, r.stride, r.nbytes, r.limit) == (6, 40 * 24, 16 * 24, 6 * 40 * 24)
    r = pf.expert_rows_range(torch.zeros(6, 40, 24, dtype=torch.bfloat16), 64)  # more rows than N: all, in bytes
    assert (r.count, r.stride, r.nbytes, r.limit) == (6, 2 * 40 * 24, 2 * 40 * 24, 2 * 6 * 40 * 24)
    with pytest.raises(ValueError, match=r"expert stack \[E, N, K\].*\(6, 24, 40\)"):
        pf.expert_rows_range(w.transpose(1, 2), 8)
    with pytest.raises(ValueError, match="expert stack"):
        pf.expert_rows_range(w[0], 8)


def test_whole_range_cuts_a_weight_in_pieces():
    w = torch.zeros(pf.PIECE_BYTES * 2 + 100, dtype=torch.int8).view(-1, 1)
    r = pf.whole_range(w)
    assert (r.count, r.stride, r.nbytes, r.limit) == (3, pf.PIECE_BYTES, pf.PIECE_BYTES, pf.PIECE_BYTES * 2 + 100)
    small = pf.whole_range(torch.zeros(4, 8, dtype=torch.float32))
    assert (small.count, small.limit) == (1, 128)
    with pytest.raises(ValueError, match="contiguous"):
        pf.whole_range(torch.zeros(8, 4).t())


def test_switches_default_off_and_refuse_bad_values():
    assert pf.weight_l2_prefetch() == "0" and pf.l2_prefetch_form() == "line"
    assert pf.expert_l2_prefetch_rows() == 128
    for setter, bad, msg in [(pf.set_weight_l2_prefetch, "all", "one of"), (pf.set_l2_prefetch_form, "tma", "one of"),
                             (pf.set_expert_l2_prefetch_rows, 0, ">= 1")]:
        with pytest.raises(ValueError, match=msg):
            setter(bad)
    with pytest.raises(ValueError, match="form must be one of"):
        pf.l2_prefetch([], "tma")
    x = torch.zeros(4, 8)
    try:
        pf.set_weight_l2_prefetch("both")
        assert pf.LayerPrefetch.start(x) is None  # CPU tensors: nothing to prefetch
    finally:
        pf.set_weight_l2_prefetch("0")
    pf.l2_prefetch([pf.whole_range(x)], "bulk")  # CPU: no launch, no error
    assert pf.prefetch_ref([pf.whole_range(x)]) is None


class _Recorder(pf.LayerPrefetch):
    """LayerPrefetch without a stream: records each launch's ranges and the join, in order."""

    events: list = []

    def __init__(self, x, mode):
        self.mode, self.main = mode, None

    @staticmethod
    def start(x):
        mode = pf.weight_l2_prefetch()
        return None if mode == "0" else _Recorder(x, mode)

    def _launch(self, ranges):
        if ranges:
            _Recorder.events.append(("launch", ranges))
            self.main = True

    def join(self):
        if self.main:  # as LayerPrefetch.join: only after a launch
            _Recorder.events.append(("join", None))


@pytest.mark.parametrize("mode", ["0", "experts", "dense", "both"])
def test_each_layer_prefetches_where_its_mode_says(tmp_path, mode, monkeypatch):
    """A tiny Qwen3-MoE (layer 1 a dense MLP): per layer, "dense" asks for qkv_proj's and o_proj's whole weights
    before the layer's input norm, "experts" for the first expert_l2_prefetch_rows() rows of every expert's
    gate_up_proj after the attention (before the post-attention norm), "both" both; each layer that launched joins
    after its MLP; the log-probabilities do not change."""
    from helpers import Runner, rows_of, save_tiny_model, tmp

    from moelora.models import moe_causal_lm

    save_tiny_model("qwen3_moe", tmp(tmp_path, "m"))
    run = Runner(tmp(tmp_path, "m"))
    layers = run.model.model.layers
    rows = [(r, None) for r in rows_of(3, [4, 2])]
    ref = run.logprobs(rows)
    order: list = []
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_hook(lambda *a, i=i: _Recorder.events.append(("attn", i)))
        layer.mlp.register_forward_hook(lambda *a, i=i: _Recorder.events.append(("mlp", i)))
    monkeypatch.setattr(moe_causal_lm, "LayerPrefetch", _Recorder)
    _Recorder.events = order
    pf.set_weight_l2_prefetch(mode)
    try:
        pf.set_expert_l2_prefetch_rows(8)
        got = run.logprobs(rows)
    finally:
        pf.set_weight_l2_prefetch("0")
        pf.set_expert_l2_prefetch_rows(128)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    want: list = []
    for i, layer in enumerate(layers):
        attn, experts = layer.self_attn, getattr(layer.mlp, "experts", None)
        launched = False
        if mode in ("dense", "both"):
            want.append(("dense", (attn.qkv_proj.weight, attn.o_proj.weight)))
            launched = True
        want.append(("attn", i))
        if mode in ("experts", "both") and experts is not None:
            want.append(("experts", experts.gate_up_proj))
            launched = True
        want.append(("mlp", i))
        if launched:
            want.append(("join", None))
    assert any(w[0] == "experts" for w in want) == (mode in ("experts", "both"))  # layer 0 has routed experts

    def shown(ev):
        kind, v = ev
        if kind != "launch":
            return ev
        if len(v) == 2:
            return ("dense", tuple(r.tensor for r in v))
        (r,) = v
        e, n, k = r.tensor.shape
        assert (r.count, r.nbytes, r.stride) == (e, 8 * k * r.tensor.element_size(), n * k * r.tensor.element_size())
        return ("experts", r.tensor)

    got_events = [shown(ev) for ev in order]
    assert len(got_events) == len(want)
    for g, w in zip(got_events, want):
        assert g[0] == w[0]
        if g[0] == "dense":
            assert all(a is b for a, b in zip(g[1], w[1]))
        elif g[0] == "experts":
            assert g[1] is w[1]
        else:
            assert g == w


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@torch.no_grad()
@pytest.mark.parametrize("form", ["line", "bulk"])
def test_gpu_decode_step_with_weight_prefetch_keeps_the_bits(tmp_path, form):
    """An FP8 Qwen3-MoE at Qwen3-30B-A3B's attention dims (2 layers, layer 1 a dense MLP), a decode step of 64
    sequences over 4 adapters: with each prefetch mode the logits are bit-equal to the step without, eagerly and
    replayed from a CUDA graph captured with it; the prefetch kernel is launched 2 times a layer for "dense"
    (qkv_proj, o_proj), once a routed-expert layer for "experts"."""
    from helpers import attention_lora_decode_case
    from test_fp8_gpu import launch_records

    from moelora.bench.common import captured_graph

    model, step, _ = attention_lora_decode_case(str(tmp_path), "fp8", 64, device="cuda", seed=21)
    layers = model.model.layers
    moe_layers = sum(getattr(layer.mlp, "experts", None) is not None for layer in layers)
    assert moe_layers >= 1
    ref = step()
    pf.set_l2_prefetch_form(form)
    try:
        for mode, launches in [("experts", moe_layers), ("dense", 2 * len(layers)),
                               ("both", moe_layers + 2 * len(layers))]:
            pf.set_weight_l2_prefetch(mode)
            with launch_records(pf._l2_prefetch_kernel) as recs:
                eager = step()
            assert len(recs) == launches, (mode, len(recs))
            graph, replayed = captured_graph(step)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(eager, ref) and torch.equal(replayed, ref), mode
    finally:
        pf.set_weight_l2_prefetch("0")
        pf.set_l2_prefetch_form("line")
