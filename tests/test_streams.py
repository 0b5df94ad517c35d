"""The side stream of the LoRA / shared-expert overlap: its priority switch (MOELORA_SIDE_STREAM_PRIORITY)."""

import os
import subprocess
import sys

import pytest
import torch

from moelora.kernels.streams import side_stream_priority


def test_side_stream_priority_env(monkeypatch):
    monkeypatch.delenv("MOELORA_SIDE_STREAM_PRIORITY", raising=False)
    assert side_stream_priority() == -1  # high by default
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "high")
    assert side_stream_priority() == -1
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", " Normal ")
    assert side_stream_priority() == 0
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "urgent")
    with pytest.raises(ValueError, match="MOELORA_SIDE_STREAM_PRIORITY='urgent': expected one of"):
        side_stream_priority()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", ["normal", "high"])
def test_gpu_side_stream_has_the_priority(setting):
    """The stream made (in a fresh process: the stream is made once) carries the priority asked for; the main
    stream keeps the default, so "high" ranks the side stream's kernels above the main stream's."""
    code = ("import torch; from moelora.kernels.streams import side_stream; "
            "print(side_stream(torch.device('cuda')).priority, torch.cuda.current_stream().priority)")
    env = {**os.environ, "MOELORA_SIDE_STREAM_PRIORITY": setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    side, main = (int(v) for v in out.split())
    assert main == 0
    assert (side < main) if setting == "high" else (side == main)


def test_set_side_stream_priority_wins_over_the_env(monkeypatch):
    """set_side_stream_priority (the in-process A/B switch) replaces the environment's choice until reset to "";
    bad values raise."""
    from moelora.kernels import streams

    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "high")
    monkeypatch.setattr(streams, "_PRIORITY", [""])
    streams.set_side_stream_priority("normal")
    assert side_stream_priority() == 0 and streams.side_stream_priority_override() == "normal"
    streams.set_side_stream_priority("high")
    assert side_stream_priority() == -1 and streams.side_stream_priority_override() == "high"
    streams.set_side_stream_priority("")  # back to the environment's
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "normal")
    assert side_stream_priority() == 0 and streams.side_stream_priority_override() == ""
    with pytest.raises(ValueError, match="set_side_stream_priority"):
        streams.set_side_stream_priority("urgent")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_each_priority_has_its_own_side_stream(monkeypatch):
    """side_stream gives a stream of the priority asked now: switching set_side_stream_priority in a process (an
    A/B) gives the other stream, and switching back the first one again."""
    from moelora.kernels import streams

    monkeypatch.setattr(streams, "_PRIORITY", ["high"])
    dev = torch.device("cuda")
    high = streams.side_stream(dev)
    streams.set_side_stream_priority("normal")
    normal = streams.side_stream(dev)
    assert normal.priority == torch.cuda.current_stream().priority and high.priority < normal.priority
    streams.set_side_stream_priority("high")
    assert streams.side_stream(dev) is high


def test_align_stream_above_needs_a_higher_priority(monkeypatch):
    """set_moe_lora_early mode "2" takes the alignment's stream only where its priority is above the side stream's;
    a GPU that clamps the request to the side stream's priority gets None (the plain order); with the side stream at
    "normal" it is still asked for at -2."""
    from types import SimpleNamespace

    from moelora.kernels import streams

    asked = []

    def fake_side_stream(device, priority=None):
        asked.append(priority)
        return SimpleNamespace(device=device, priority=max(priority, clamp[0]))

    monkeypatch.setattr(streams, "side_stream", fake_side_stream)
    side = SimpleNamespace(device="dev", priority=-1)
    clamp = [-5]  # an H200: 0 down to -5
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "high")
    assert streams.align_stream_above(side).priority == -2 and asked[-1] == -2
    clamp[0] = -1  # a GPU whose range stops at -1
    assert streams.align_stream_above(side) is None
    monkeypatch.setenv("MOELORA_SIDE_STREAM_PRIORITY", "normal")
    clamp[0] = -5
    assert streams.align_stream_above(SimpleNamespace(device="dev", priority=0)).priority == -2
