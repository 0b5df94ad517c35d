"""`bench serve`'s numbers: the progress line or bar while it runs (Progress), the summary of the results (latency
percentiles, throughput, per model: summarize) and the table it prints (format_table)."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import Any

from moelora_bench.serve_metrics import KV_FREE, KV_FREE_MIN
from moelora_bench.serve_requests import RequestResult

MAX_ERROR_MESSAGES = 10


class Progress:
    """Requests done, on stderr: a tqdm bar where tqdm is installed, else a line every `every` seconds (tick)
    and one at the end; nothing at all when not enabled."""

    def __init__(self, total: int | None, duration: float | None, enabled: bool = True, every: float = 5.0) -> None:
        self.enabled, self.total, self.duration, self.every = enabled, total, duration, every
        self.counts = {"ok": 0, "error": 0, "disconnected": 0}
        self.done = 0
        self.t0 = self.last = time.perf_counter()
        self.stream = sys.stderr
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="req", desc="bench serve", file=self.stream, mininterval=0.5,
                            dynamic_ncols=True)

    def update(self, res: RequestResult) -> None:
        self.done += 1
        self.counts[res.status] = self.counts.get(res.status, 0) + 1
        if self.bar is not None:
            self.bar.set_postfix({"ok": self.counts["ok"], "errors": self.counts["error"],
                                  "disconnected": self.counts["disconnected"]}, refresh=False)
            self.bar.update(1)

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        left = f", {max(self.duration - el, 0.0):.0f} s left" if self.duration is not None else ""
        of = f"/{self.total}" if self.total is not None else ""
        return (f"bench serve: {self.done}{of} requests (ok {self.counts['ok']}, errors {self.counts['error']}, "
                f"disconnected {self.counts['disconnected']}) in {el:.1f} s{left}")

    def tick(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.refresh()
        elif time.perf_counter() - self.last >= self.every:
            self.last = time.perf_counter()
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(self.line(), file=self.stream, flush=True)


async def tick(progress: Progress, stop: asyncio.Event, interval: float = 0.5) -> None:
    while not stop.is_set():
        progress.tick()
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values_s]
    r = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {"p50": r(_percentile(ms, 50)), "p99": r(_percentile(ms, 99)),
            "mean": r(sum(ms) / len(ms)) if ms else None, "n": len(ms)}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.status == "ok"]
    errs = [r for r in results if r.status == "error"]
    disc = [r for r in results if r.status == "disconnected"]
    per_model: dict[str, dict[str, int]] = {}
    for r in sorted(results, key=lambda r: r.index):
        m = per_model.setdefault(r.model, {"requests": 0, "ok": 0, "errors": 0, "disconnected": 0,
                                           "output_tokens": 0})
        m["requests"] += 1
        m["errors" if r.status == "error" else r.status] += 1
        m["output_tokens"] += r.output_tokens
    out_tokens = sum(r.output_tokens for r in results if r.status != "error")
    dur = max(duration_s, 1e-9)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": {"count": len(errs),
                   "messages": [f"[{r.model}] {r.error}" for r in sorted(errs, key=lambda r: r.index)]
                   [:MAX_ERROR_MESSAGES]},
        "disconnected": len(disc),
        "duration_s": round(duration_s, 4),
        "requests_per_s": round(len(results) / dur, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / dur, 3),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok + disc if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "latency_ms": _stats_ms([r.latency_s for r in ok if r.latency_s is not None]),
        "per_model": per_model,
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _prefix_line(s: dict) -> str:
    """The prefix cache's line of the table: the hit rate of the server's counters over the run, the cached tokens the
    responses reported, and the shared prefix the workload had."""
    pc = s.get("prefix_cache") or {}
    if pc.get("hit_rate") is not None:
        rate = (f"hit rate {100 * pc['hit_rate']:.1f}% ({pc['hits']} of {pc['queries']} prompt tokens looked up, "
                f"server counters)")
    elif pc.get("queries") is not None:
        rate = f"hit rate - ({pc['queries']} prompt tokens looked up)"
    else:
        rate = "hit rate - (no prefix-cache counters on /metrics)"
    cached = pc.get("cached_tokens_reported")
    line = f"prefix cache: {rate}; cached_tokens reported {_fmt(cached)}"
    if cached is not None and pc.get("prompt_tokens_reported"):
        line += f" of {pc['prompt_tokens_reported']} prompt tokens"
    cfg = s.get("config") or {}
    if cfg.get("shared_prefix_len"):
        toks = [t for t in (cfg.get("shared_prefix_tokens") or {}).values() if t is not None]
        took = f", {min(toks)}-{max(toks)} tokens" if toks and min(toks) != max(toks) else (
            f", {toks[0]} tokens" if toks else "")
        line += f" [shared prefix per model: {cfg['shared_prefix_len']} {cfg.get('shared_prefix_unit')}{took}]"
    else:
        line += " [no shared prefix]"
    return line


def format_table(s: dict) -> str:
    lines = [
        f"requests {s['requests']}: ok {s['ok']}, errors {s['errors']['count']}, "
        f"disconnected {s['disconnected']} in {s['duration_s']:.2f} s",
        f"throughput: {s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s "
        f"({s['output_tokens']} tokens)",
        f"TTFT p50: {_fmt(s['ttft_ms']['p50'])} ms (p99 {_fmt(s['ttft_ms']['p99'])} ms)",
        _prefix_line(s),
    ]
    steps, builds = s.get("steps") or {}, s.get("triton_kernel_builds")
    if steps or builds is not None:
        lines.append("engine steps: " + "; ".join(
            f"{kind} {st['steps']} (mean {_fmt(st['mean_ms'])} ms)" for kind, st in steps.items())
            + ("" if builds is None else f"; Triton kernel variants built during the run: {builds}"
               + (" (their build time is in these figures)" if builds else "")))
    lines += [
        "",
        f"{'':12s} {'p50':>10s} {'p99':>10s} {'mean':>10s} {'n':>6s}",
    ]
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        st = s[key]
        lines.append(f"{key:12s} {_fmt(st['p50']):>10s} {_fmt(st['p99']):>10s} {_fmt(st['mean']):>10s} {st['n']:>6d}")
    lines += ["", f"{'model':24s} {'requests':>8s} {'ok':>6s} {'errors':>6s} {'disc':>6s} {'tokens':>8s}"]
    for name, m in s["per_model"].items():
        lines.append(f"{name[:24]:24s} {m['requests']:>8d} {m['ok']:>6d} {m['errors']:>6d} "
                     f"{m['disconnected']:>6d} {m['output_tokens']:>8d}")
    if s["errors"]["messages"]:
        lines += ["", "first errors:"] + [f"  {msg}" for msg in s["errors"]["messages"]]
    kv = s.get("kv_cache") or {}
    if kv.get("blocks_total") is not None or kv.get("blocks_free_min") is not None:
        used = kv.get("blocks_used_peak")
        share = f", {100 * used / kv['blocks_total']:.1f}%" if used is not None and kv.get("blocks_total") else ""
        src = {"server": KV_FREE_MIN,
               "polled": f"polled {KV_FREE}: an upper bound"}.get(kv.get("blocks_free_min_source"))
        lines += ["", f"KV cache: {_fmt(kv.get('blocks_total'))} blocks; min free during the run "
                      f"{_fmt(kv.get('blocks_free_min'))} (used at peak {_fmt(used)}{share})"
                      + (f" [{src}]" if src else "")]
    if s.get("kv_blocks_leaked") is not None or s.get("lora_slots_leaked") is not None:
        leaked = (s.get("kv_blocks_leaked") or 0) + (s.get("lora_slots_leaked") or 0)
        lines += [("LEAK " if leaked else "") + f"after the run: KV blocks leaked {_fmt(s.get('kv_blocks_leaked'))}, "
                  f"LoRA slots leaked {_fmt(s.get('lora_slots_leaked'))}"]
    if s.get("metrics"):
        lines += ["", "server metrics after the run (peak during it):"]
        peak = s.get("metrics_peak") or {}
        for fam, samples in s["metrics"].items():
            for k, v in samples.items():
                p = peak.get(fam, {}).get(k)
                lines.append(f"  {k:56s} {_fmt(v):>10s}" + (f" ({_fmt(p)})" if p is not None else ""))
    elif s.get("metrics_error"):
        lines += ["", f"server metrics: none ({s['metrics_error']})"]
    return "\n".join(lines)
