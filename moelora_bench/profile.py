"""Where a decode step's time goes: a few engine steps under torch.profiler, summed per kernel (on a GPU: the
CUDA kernels by their own device time, graph replays included; on the CPU: the operators by their own CPU
time), as a table per step for `bench decode --profile-steps`. On a GPU also the kernels' timeline
(`kernel_timeline`): idle time between kernels, time with two streams busy at once, and how much of the LoRA
kernels' time other kernels ran beside — whether the side stream's work hides behind the main stream's."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from moelora_bench.trace import one_layer

TOP = 25  # kernels kept per case (the rest is summed into "other")


def profile_steps(step: Callable[[], object], steps: int, device: torch.device, trace_path: str | None = None) -> dict:
    """Run step() `steps` times under the profiler; returns {"unit": "us per step", "total_us": float,
    "kernels": [{"name", "calls", "us"} ... the TOP largest, then "other"]}, calls and us per step.
    On a GPU also "timeline" (kernel_timeline) and "layer" (trace.one_layer: one decoder layer's kernels in start
    order, medians over the layers). trace_path (a GPU only): also write every kernel of those steps there
    (write_kernel_trace), for reading them offline (python -m moelora_bench.trace)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    timeline = layer = None
    if cuda:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
            timeline = kernel_timeline(events, steps)
            layer = one_layer(*compact_kernels(events))
            if trace_path:
                write_kernel_trace(events, trace_path)
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total  # microseconds over all steps
        if us > 0 and (cuda or not e.key.startswith("ProfilerStep")):
            rows.append({"name": e.key, "calls": e.count / steps, "us": us / steps})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    kept, rest = rows[:TOP], rows[TOP:]
    if rest:
        kept.append({"name": "other", "calls": sum(r["calls"] for r in rest), "us": sum(r["us"] for r in rest)})
    out = {"unit": "us per step", "device": "cuda kernels" if cuda else "cpu operators", "steps": steps,
           "total_us": total, "kernels": kept}
    if timeline is not None:
        out["timeline"] = timeline
    if layer is not None:
        out["layer"] = layer
    return out


def compact_kernels(events: list[dict]) -> tuple[list[str], list[list]]:
    """The kernels of a chrome trace (torch.profiler's export_chrome_trace): ([kernel name ...], [[name index,
    stream, start µs from the first kernel, duration µs] ...] in start order), the form trace.py reads."""
    ks = sorted((float(e["ts"]), float(e["dur"]), e.get("args", {}).get("stream"), e.get("name", ""))
                for e in events if e.get("cat") == "kernel" and e.get("ph") == "X")
    names: dict[str, int] = {}
    t0 = ks[0][0] if ks else 0.0
    rows = [[names.setdefault(n, len(names)), st, round(ts - t0, 3), round(d, 3)] for ts, d, st, n in ks]
    return list(names), rows


def write_kernel_trace(events: list[dict], path: str) -> None:
    """compact_kernels as gzip'd JSON at path: {"names": [...], "kernels": [...]}."""
    names, rows = compact_kernels(events)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"names": names, "kernels": rows}, f)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_timeline(events: list[dict], steps: int, marker: str = "lora") -> dict:
    """When the kernels ran, from a chrome trace's events (torch.profiler's export_chrome_trace; kernels are the
    complete events of category "kernel", ts/dur in µs, args.stream). Per step: span (first kernel's start to the
    last one's end), busy (the union of all kernels), idle = span - busy, concurrent (time with kernels of two or
    more streams at once), busy per stream, and for kernels whose name contains `marker` (the LoRA kernels):
    their summed time, their union, and how much of that union other kernels ran beside (hidden)."""
    ks = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("stream"), e.get("name", ""))
          for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not ks:
        return {"kernels": 0}
    n = max(steps, 1)
    span = max(k[1] for k in ks) - min(k[0] for k in ks)
    busy = _union([(a, b) for a, b, _, _ in ks])
    by_stream: dict = {}
    for a, b, st, _ in ks:
        by_stream.setdefault(st, []).append((a, b))
    stream_busy = {st: _union(v) for st, v in by_stream.items()}
    concurrent = 0.0
    names = sorted(stream_busy, key=str)
    for i, si in enumerate(names):  # pairwise: exact for two streams, an upper bound for more
        for sj in names[i + 1:]:
            concurrent += _intersect(stream_busy[si], stream_busy[sj])
    marked = [(a, b) for a, b, _, name in ks if marker in name.lower()]
    marked_union = _union(marked)
    others = _union([(a, b) for a, b, _, name in ks if marker not in name.lower()])
    return {"kernels": len(ks) / n, "span_us": span / n, "busy_us": _length(busy) / n,
            "idle_us": (span - _length(busy)) / n, "concurrent_us": concurrent / n,
            "stream_busy_us": {str(st): _length(v) / n for st, v in stream_busy.items()},
            "marker": marker, "marked_sum_us": sum(b - a for a, b in marked) / n,
            "marked_union_us": _length(marked_union) / n,
            "marked_hidden_us": _intersect(marked_union, others) / n}


def format_timeline(t: dict) -> str:
    if not t.get("kernels"):
        return "  timeline: no kernels"
    streams = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(t["stream_busy_us"].items(), key=lambda kv: -kv[1]))
    return (f"  timeline per step: span {t['span_us']:.0f} us, busy {t['busy_us']:.0f}, idle {t['idle_us']:.0f}, "
            f"two streams at once {t['concurrent_us']:.0f}; busy by stream ({streams}); '{t['marker']}' kernels "
            f"{t['marked_sum_us']:.0f} us (union {t['marked_union_us']:.0f}, beside other kernels "
            f"{t['marked_hidden_us']:.0f})")


def format_profile(p: dict, lines: int = 8) -> str:
    """The largest entries, one per line: share of the total, us per step, calls per step, name (cut to 90); then
    the timeline line on a GPU."""
    out = [f"  profile ({p['device']}, {p['steps']} steps): {p['total_us']:.0f} us per step"]
    for r in p["kernels"][:lines]:
        share = 100 * r["us"] / p["total_us"] if p["total_us"] else 0.0
        out.append(f"    {share:5.1f}%  {r['us']:9.1f} us  x{r['calls']:6.1f}  {r['name'][:90]}")
    if "timeline" in p:
        out.append(format_timeline(p["timeline"]))
    return "\n".join(out)


def profile_tax(base: dict, lora: dict, top: int = TOP) -> dict:
    """Where the LoRA tax goes: the per-kernel difference of two profiles of the same batch (with adapters minus
    without), largest first by absolute difference, then "other" for the rest (kernels cut from either profile
    count as 0 there). Returns {"unit": "us per step", "total_us": lora total - base total,
    "kernels": [{"name", "base_us", "lora_us", "us"} ...]}."""
    b = {k["name"]: k["us"] for k in base["kernels"] if k["name"] != "other"}
    lo = {k["name"]: k["us"] for k in lora["kernels"] if k["name"] != "other"}
    rows = [{"name": n, "base_us": b.get(n, 0.0), "lora_us": lo.get(n, 0.0), "us": lo.get(n, 0.0) - b.get(n, 0.0)}
            for n in sorted(set(b) | set(lo))]
    rows.sort(key=lambda r: -abs(r["us"]))
    total = lora["total_us"] - base["total_us"]
    kept, rest = rows[:top], rows[top:]
    other = total - sum(r["us"] for r in kept)
    kept.append({"name": "other", "base_us": None, "lora_us": None, "us": other})
    return {"unit": "us per step", "total_us": total, "kernels": kept, "rest_count": len(rest)}


def format_profile_tax(t: dict, lines: int = 8, title: str = "LoRA tax by kernel") -> str:
    """The largest differences, one per line: us per step added (or saved, negative), base -> with adapters."""
    out = [f"  {title} (profiled): {t['total_us']:+.0f} us per step"]
    for r in t["kernels"][:lines]:
        if r["name"] == "other":
            continue
        out.append(f"    {r['us']:+9.1f} us  ({r['base_us']:.1f} -> {r['lora_us']:.1f})  {r['name'][:90]}")
    return "\n".join(out)
