"""The dense LoRA side-stream overlap (set_dense_lora_overlap): its arithmetic — the delta computed into zeroed
fp32 buffers, then added to the base output once — gives bit for bit what the in-place path gives, for mixed
batches (grouped shrink/expand) and one-adapter batches (plain matmuls), in bf16 and fp32; on a GPU the
overlapped forward (side stream, in and out of a CUDA graph) equals the serial one."""

from __future__ import annotations

import pytest
import torch

from moelora.adapters.metadata import LoRABatch
from moelora.kernels._triton import dense_lora_overlap, set_dense_lora_overlap, set_deterministic
from moelora.layers.linear import LoRALinear


def _layer(dtype: torch.dtype, device: str) -> LoRALinear:
    g = torch.Generator().manual_seed(0)
    lin = LoRALinear(64, [48, 16, 16], bias=True, dtype=dtype, device=device)
    lin.weight.copy_(torch.randn(80, 64, generator=g) * 0.1)
    lin.bias.copy_(torch.randn(80, generator=g))
    w = lin.enable_lora(max_loras=3, max_lora_rank=8)
    for slot, r in ((0, 8), (1, 4), (2, 2)):
        for i, out in enumerate(w.out_features):
            if (slot, i) == (2, 1):
                continue  # rank 0 on one (slot, slice): adds nothing
            w.set_slot(i, slot, torch.randn(r, 64, generator=g), torch.randn(out, r, generator=g), 0.5 + slot)
    return lin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots", [[0, -1, 1, 2, 0, 1, -1, 2], [1, 1, -1, 1]], ids=["mixed", "one-adapter"])
def test_delta_then_add_equals_in_place(dtype, slots):
    lin = _layer(dtype, "cpu")
    x = torch.randn(len(slots), 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    lora = LoRABatch.build(slots, 3)
    in_place = lin(x, lora)
    overlapped = lin.lora_delta_then_add(x, lora)
    assert torch.equal(in_place, overlapped)
    base = lin.base(x)
    assert not torch.equal(in_place, base)  # the adapters did change the output
    assert torch.equal(in_place[torch.tensor(slots) < 0], base[torch.tensor(slots) < 0])  # slot -1 rows untouched


def test_dense_overlap_is_off_by_default_and_needs_a_gpu():
    assert dense_lora_overlap() is False or __import__("os").environ.get("MOELORA_DENSE_LORA_OVERLAP") == "1"
    lin = _layer(torch.float32, "cpu")
    lin.overlap = True
    prev = dense_lora_overlap()
    set_dense_lora_overlap(True)
    try:
        x = torch.randn(4, 64)
        lora = LoRABatch.build([0, 1, -1, 2], 3)
        assert torch.equal(lin(x, lora), lin.lora_delta_then_add(x, lora))  # CPU tensors: the serial path
    finally:
        set_dense_lora_overlap(prev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_overlapped_forward_equals_serial_on_gpu_and_in_a_graph():
    prev = dense_lora_overlap()
    set_deterministic(True)  # no split-K atomics: bit-for-bit comparisons
    lin = _layer(torch.bfloat16, "cuda")
    lin.overlap = True
    try:
        for slots in ([0, -1, 1, 2] * 16, [1] * 7 + [-1]):
            x = torch.randn(len(slots), 64, device="cuda").bfloat16()
            lora = LoRABatch.build(slots, 3, "cuda")
            set_dense_lora_overlap(False)
            serial = lin(x, lora)
            set_dense_lora_overlap(True)
            torch.testing.assert_close(lin(x, lora), serial, rtol=0, atol=0)
        slots = [0, -1, 1, 2] * 4
        lora = LoRABatch.static(16, 3, "cuda")
        lora.update_static(slots, 3)
        x = torch.randn(16, 64, device="cuda").bfloat16()
        outs = []
        for on in (True, False):  # a graph captured with the overlap, one without: the same output
            set_dense_lora_overlap(on)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                lin(x, lora)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = lin(x, lora)
            graph.replay()
            torch.cuda.synchronize()
            outs.append((graph, out))
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)
        assert not torch.equal(outs[0][1], lin.base(x))
    finally:
        set_dense_lora_overlap(prev)
        set_deterministic(False)
