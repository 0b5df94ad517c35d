"""The side stream of the LoRA / shared-expert overlap: made by the engine at KernelConfig.side_stream_priority."""

from types import SimpleNamespace

import pytest
import torch

from moelora.kernels import streams
from moelora.kernels.config import KernelConfig


def test_a_bad_priority_is_refused_before_any_stream_is_made():
    with pytest.raises(ValueError, match="side stream priority: expected one of \\['high', 'normal'\\], got 'urgent'"):
        streams.make_side_stream(torch.device("cuda", 0), "urgent")
    with pytest.raises(ValueError, match="side_stream_priority: 'high' or 'normal', got 'urgent'"):
        KernelConfig(side_stream_priority="urgent")
    assert streams.PRIORITIES == {"high": -1, "normal": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_side_stream_has_the_priority_made_with(monkeypatch):
    """Before the engine makes one, side_stream is the "high" stream (below the main stream's 0); make_side_stream
    switches it (a benchmark comparing two configs), and switching back gives the first stream again."""
    monkeypatch.setattr(streams, "_SIDE_PRIORITY", {})
    dev = torch.device("cuda")
    high = streams.side_stream(dev)
    assert torch.cuda.current_stream().priority == 0 and high.priority < 0
    normal = streams.make_side_stream(dev, "normal")
    assert streams.side_stream(dev) is normal and normal.priority == torch.cuda.current_stream().priority
    assert streams.make_side_stream(dev, "high") is high and streams.side_stream(dev) is high


def test_align_stream_above_needs_a_higher_priority(monkeypatch):
    """The early gate_up launch takes the alignment's stream only where its priority is above the side stream's; a
    GPU that clamps the request to the side stream's priority gets None (the plain order); with the side stream at
    "normal" it is still asked for at -2."""
    asked = []
    clamp = [-5]  # an H200: 0 down to -5

    def fake_stream(idx, priority):
        asked.append(priority)
        return SimpleNamespace(device="dev", priority=max(priority, clamp[0]))

    monkeypatch.setattr(streams, "_stream", fake_stream)
    monkeypatch.setattr(streams, "_index", lambda device: 0)
    side = SimpleNamespace(device="dev", priority=-1)  # "high"
    assert streams.align_stream_above(side).priority == -2 and asked[-1] == -2
    clamp[0] = -1  # a GPU whose range stops at -1
    assert streams.align_stream_above(side) is None
    clamp[0] = -5
    assert streams.align_stream_above(SimpleNamespace(device="dev", priority=0)).priority == -2  # "normal"
    assert asked[-1] == -2
