"""Where a decode step's time goes: a few engine steps under torch.profiler, summed per kernel (on a GPU: the
CUDA kernels by their own device time, graph replays included; on the CPU: the operators by their own CPU
time), as a table per step for `bench decode --profile-steps`."""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

TOP = 25  # kernels kept per case (the rest is summed into "other")


def profile_steps(step: Callable[[], object], steps: int, device: torch.device) -> dict:
    """Run step() `steps` times under the profiler; returns {"unit": "us per step", "total_us": float,
    "kernels": [{"name", "calls", "us"} ... the TOP largest, then "other"]}, calls and us per step."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
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
    return {"unit": "us per step", "device": "cuda kernels" if cuda else "cpu operators", "steps": steps,
            "total_us": total, "kernels": kept}


def format_profile(p: dict, lines: int = 8) -> str:
    """The largest entries, one per line: share of the total, us per step, calls per step, name (cut to 90)."""
    out = [f"  profile ({p['device']}, {p['steps']} steps): {p['total_us']:.0f} us per step"]
    for r in p["kernels"][:lines]:
        share = 100 * r["us"] / p["total_us"] if p["total_us"] else 0.0
        out.append(f"    {share:5.1f}%  {r['us']:9.1f} us  x{r['calls']:6.1f}  {r['name'][:90]}")
    return "\n".join(out)
