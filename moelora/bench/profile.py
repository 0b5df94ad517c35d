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


def format_profile_tax(t: dict, lines: int = 8) -> str:
    """The largest differences, one per line: us per step added (or saved, negative), base -> with adapters."""
    out = [f"  LoRA tax by kernel (profiled): {t['total_us']:+.0f} us per step"]
    for r in t["kernels"][:lines]:
        if r["name"] == "other":
            continue
        out.append(f"    {r['us']:+9.1f} us  ({r['base_us']:.1f} -> {r['lora_us']:.1f})  {r['name'][:90]}")
    return "\n".join(out)
