"""The side CUDA stream of the LoRA / shared-expert overlap, and its capture-safe fork and join.

Pattern (eager and under CUDA-graph capture alike): every buffer the side stream writes is allocated on
the main stream before `fork`; the side stream waits for the main stream's work so far (`fork`); the
main stream waits for the side stream (`join`) before it reads those buffers. Under capture the side
stream is pulled into the graph by the fork and leaves it at the join.

The engine makes the side stream when it is built (`make_side_stream`, from KernelConfig.side_stream_priority);
the layers take it with `side_stream(device)`. Its priority matters because PyTorch instantiates CUDA graphs with
cudaGraphInstantiateFlagUseNodePriority: a kernel captured on a high-priority stream keeps that priority on replay,
and the block scheduler hands it SMs ahead of the pending blocks of the main stream's kernel.
"""

from __future__ import annotations

import contextlib

import torch

PRIORITIES = {"normal": 0, "high": -1}  # torch: a lower number is a higher priority; "high" measured faster
ALIGN_STREAM_PRIORITY = -2  # above the side stream's "high" (-1); the H200 takes 0 down to -5

_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}  # (GPU, priority) -> its stream, made once
_SIDE_PRIORITY: dict[int, int] = {}  # GPU -> the priority of the side stream the engine made there


def _index(device: torch.device | str) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _stream(idx: int, priority: int) -> "torch.cuda.Stream":
    """The stream of this priority on GPU idx, created on first use (outside capture: the graph warm-up runs
    first) and kept, so that a benchmark comparing two configs gets the first stream back."""
    key = (idx, priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=idx, priority=priority)
    return _STREAMS[key]


def make_side_stream(device: torch.device | str, priority: str = "high") -> "torch.cuda.Stream":
    """Make the side stream of `device` at `priority` ("high" or "normal": KernelConfig.side_stream_priority) the
    one `side_stream` gives from now on; returns it. The engine calls it when it is built, before the CUDA graphs
    are captured (they keep the stream they recorded)."""
    if priority not in PRIORITIES:
        raise ValueError(f"side stream priority: expected one of {sorted(PRIORITIES)}, got {priority!r}")
    idx = _index(device)
    _SIDE_PRIORITY[idx] = PRIORITIES[priority]
    return _stream(idx, PRIORITIES[priority])


def side_stream(device: torch.device | str) -> "torch.cuda.Stream":
    """The side stream of `device` the engine made (make_side_stream); a model run without an engine gets the
    default ("high") one."""
    idx = _index(device)
    return _stream(idx, _SIDE_PRIORITY.get(idx, PRIORITIES["high"]))


def align_stream(device: torch.device | str) -> "torch.cuda.Stream":
    """The stream of the experts' alignment under the early gate_up LoRA launch: a priority above the side
    stream's, so that the block scheduler places the alignment's one program before the pending CTAs of the
    routed-expert LoRA kernel issued beside it."""
    return _stream(_index(device), min(ALIGN_STREAM_PRIORITY, side_stream(device).priority - 1))


def align_stream_above(side: "torch.cuda.Stream") -> "torch.cuda.Stream | None":
    """align_stream(side's device) where its priority is above side's, else None: a GPU whose priority range stops
    at side's clamps the request to it, and the alignment would then wait for SMs behind the LoRA kernel (that
    order lost 1.5%)."""
    stream = _stream(_index(side.device), min(ALIGN_STREAM_PRIORITY, side.priority - 1))
    return stream if stream.priority < side.priority else None


def fork(side: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """side waits for everything issued so far on the current (main) stream; returns the main stream."""
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    return main


def join(main: "torch.cuda.Stream", side: "torch.cuda.Stream") -> None:
    """main waits for everything issued so far on side."""
    main.wait_stream(side)


@contextlib.contextmanager
def launched_on(stream: "torch.cuda.Stream | None"):
    """Launches inside the block run on `stream` (None: on the current stream, nothing else done): fork before
    (stream waits for the current stream's work so far), join after (the current stream waits for it). Allocate
    what the launches write before the block, on the current stream."""
    if stream is None:
        yield
        return
    main = fork(stream)
    with torch.cuda.stream(stream):
        yield
    join(main, stream)
