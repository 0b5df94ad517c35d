"""`bench serve`'s view of the server's /metrics (Prometheus text): the families it keeps (kv_blocks, lora_slots,
running, waiting, prefix_cache), polled during the run for their peaks and low marks, read again once the server
settled after the last request; from them the KV cache's use (kv_summary), the prefix cache's hits
(prefix_cache_summary) and what leaked (leaks)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace
from typing import Any

import httpx

from moelora_bench.serve_requests import RequestResult

METRIC_KEYS = ("kv_blocks", "lora_slots", "running", "waiting", "prefix_cache", "step_duration", "kernel_builds")
KV_FREE = "moelora_kv_blocks_free"
KV_FREE_MIN = "moelora_kv_blocks_free_min"  # the server's lowest free-block count since it started
KV_TOTAL = "moelora_kv_blocks_total"
SLOTS_IN_USE = "moelora_lora_slots_in_use"
PREFIX_QUERIES = "moelora_prefix_cache_queries_total"  # prompt tokens looked up in the prefix cache (a counter)
PREFIX_HITS = "moelora_prefix_cache_hits_total"  # prompt tokens served from it (a counter)
KERNEL_BUILDS = "moelora_triton_kernel_builds_total"  # Triton kernel variants the server built at first use
STEP = "moelora_step_duration_seconds"  # engine steps by kind (a histogram labelled kind="prefill" / "decode")


def _fallback_families(text: str):
    """A minimal Prometheus text parser, used only when prometheus_client is not installed. As prometheus_client's:
    a TYPE line opens a family (listed even without samples; a counter's named without `_total`, its samples with
    it) that takes the samples of its name (and a histogram's or summary's `_bucket` / `_sum` / `_count`); any other
    sample is a family of its own name."""
    fams: dict[str, Any] = {}
    suffixes = {"summary": ("", "_count", "_sum"), "histogram": ("_count", "_sum", "_bucket")}
    cur, allowed, rename = None, (), False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                name, kind = parts[2], parts[3]
                allowed = tuple(name + suf for suf in suffixes.get(kind, ("",)))
                rename = kind == "counter" and not name.endswith("_total")
                if kind == "counter" and name.endswith("_total"):
                    name = name[: -len("_total")]
                cur = fams.setdefault(name, SimpleNamespace(name=name, samples=[]))
            continue
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.rpartition("}") if "}" in line else ("", "", line)
        if head:
            name, _, lab = head.partition("{")
            labels = {}
            for part in lab.split(","):
                k, eq, v = part.partition("=")
                if eq:
                    labels[k.strip()] = v.strip().strip('"')
            value = rest.split()[0]
        else:
            name, value = rest.split()[:2]
            labels = {}
        if cur is not None and name in allowed:
            fam, name = cur, name + ("_total" if rename else "")
        else:
            cur, allowed = None, ()
            fam = fams.setdefault(name, SimpleNamespace(name=name, samples=[]))
        fam.samples.append(SimpleNamespace(name=name, labels=labels, value=float(value)))
    return list(fams.values())


def parse_metrics(text: str, keys: tuple[str, ...] = METRIC_KEYS) -> dict[str, dict[str, float]]:
    """Prometheus text -> {family name: {'sample{label="v",...}': value}} for families whose names
    contain any of `keys`."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
        families = text_string_to_metric_families(text)
    except ImportError:
        families = _fallback_families(text)
    out: dict[str, dict[str, float]] = {}
    for fam in families:
        if not any(k in fam.name for k in keys) or fam.name.endswith("_created"):
            continue  # (a counter's creation time, a family of its own as generate_latest writes it: no figure)
        samples = out.setdefault(fam.name, {})
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{lab}}}" if lab else s.name] = float(s.value)
    return out


async def fetch_metrics(client: httpx.AsyncClient) -> tuple[dict | None, str | None]:
    try:
        resp = await client.get("/metrics")
        if resp.status_code != 200:
            return None, f"GET /metrics: HTTP {resp.status_code}"
        return parse_metrics(resp.text), None
    except Exception as e:  # noqa: BLE001 - metrics are optional; never fail the run on them
        return None, f"GET /metrics: {type(e).__name__}: {e}"


def _is_free_gauge(family: str) -> bool:
    """A count of free blocks (or slots): its low point matters, its peak says nothing."""
    return "_free" in family


def track(m: dict | None, peaks: dict, lows: dict) -> None:
    """Fold one /metrics sample into `peaks` (the maximum of every sample but the free gauges') and `lows` (the
    minimum of the free gauges')."""
    for fam, samples in (m or {}).items():
        free = _is_free_gauge(fam)
        dst = (lows if free else peaks).setdefault(fam, {})
        for k, v in samples.items():
            if not math.isnan(v):
                dst[k] = (min if free else max)(dst.get(k, v), v)


async def poll_metrics(client: httpx.AsyncClient, peaks: dict, lows: dict, stop: asyncio.Event,
                        interval: float) -> None:
    while not stop.is_set():
        m, err = await fetch_metrics(client)
        if err is not None:
            return  # no /metrics (or not parseable): stop polling
        track(m, peaks, lows)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


def _gauge(m: dict | None, name: str) -> float | None:
    """The unlabelled sample of gauge `name` in parse_metrics' output, or None."""
    v = ((m or {}).get(name) or {}).get(name)
    return None if v is None or math.isnan(v) else v


def _idle(m: dict | None) -> bool | None:
    """Whether the server holds no KV block and no LoRA slot for a request; None where it has neither gauge."""
    free, total, in_use = _gauge(m, KV_FREE), _gauge(m, KV_TOTAL), _gauge(m, SLOTS_IN_USE)
    kv_known, slots_known = free is not None and total is not None, in_use is not None
    if not kv_known and not slots_known:
        return None
    return (not kv_known or free >= total) and (not slots_known or in_use == 0)


async def settle(client: httpx.AsyncClient, timeout: float, poll_s: float = 0.1) -> tuple[dict | None, str | None]:
    """/metrics after the run, once the server is idle (see _idle) or `timeout` seconds have passed."""
    deadline = time.perf_counter() + max(timeout, 0.0)
    while True:
        m, err = await fetch_metrics(client)
        if m is None or _idle(m) is not False or time.perf_counter() >= deadline:
            return m, err
        await asyncio.sleep(poll_s)


def kv_summary(before: dict | None, after: dict | None, lows: dict) -> dict:
    """The KV cache over the run: total blocks, the fewest free (and from where), the most used, the free blocks
    after it. `before` / `after`: /metrics (parse_metrics) before the first request and after the last one settled;
    `lows`: the polled minima of the free gauges (see track)."""
    total = _gauge(after, KV_TOTAL)
    if total is None:
        total = _gauge(before, KV_TOTAL)
    polled = _gauge(lows, KV_FREE)
    low_before, low_after = _gauge(before, KV_FREE_MIN), _gauge(after, KV_FREE_MIN)
    free_min, source = None, None
    if low_after is not None and (low_before is None or low_after < low_before or polled is None
                                  or polled <= low_after):
        free_min, source = low_after, "server"  # the run set the server's low mark (or met it)
    elif polled is not None:  # no such gauge, or its low mark predates the run
        free_min, source = polled, "polled"
    out = {"blocks_total": None if total is None else int(total),
           "blocks_free_min": None if free_min is None else int(free_min),
           "blocks_used_peak": None if free_min is None or total is None else int(total - free_min),
           "blocks_free_min_source": source,
           "blocks_free_after": None if _gauge(after, KV_FREE) is None else int(_gauge(after, KV_FREE))}
    return out


def _counter(m: dict | None, sample: str) -> float | None:
    """The sum of every sample named `sample` (any labels) in parse_metrics' output; 0 for a family listed without
    samples (a labelled counter none of whose labels has counted yet); None where there is no such counter."""
    total, found = 0.0, False
    for samples in (m or {}).values():
        for k, v in samples.items():
            if (k == sample or k.startswith(sample + "{")) and not math.isnan(v):
                total, found = total + v, True
    if not found and m and (sample in m or sample.removesuffix("_total") in m):
        return 0.0
    return total if found else None


def prefix_cache_summary(before: dict | None, after: dict | None, results: list[RequestResult]) -> dict:
    """The prefix cache over the run: the growth of the server's query and hit counters (prompt tokens) between
    `before` and `after` (parse_metrics of /metrics before the first request and after the last one settled), their
    ratio, and the cached / prompt tokens the responses' usage reported. None where the server does not say (a
    counter missing before or after the run, or one that went down: the server restarted)."""
    deltas = []
    for name in (PREFIX_QUERIES, PREFIX_HITS):
        a, b = _counter(before, name), _counter(after, name)
        deltas.append(None if a is None or b is None or b < a else int(round(b - a)))
    queries, hits = deltas
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    return {"queries": queries, "hits": hits,
            "hit_rate": round(hits / queries, 4) if queries and hits is not None else None,
            "cached_tokens_reported": sum(cached) if cached else None,
            "prompt_tokens_reported": sum(prompt) if prompt else None}


def step_summary(before: dict | None, after: dict | None) -> dict:
    """The engine's steps over the run by kind (prefill: computed prompt tokens; decode: one token a request): how
    many, and their mean duration in ms, from the growth of the server's step histogram between `before` and
    `after`; {} where the server lacks it."""
    out = {}
    for kind in ("prefill", "decode"):
        n0, n1 = _counter(before, f'{STEP}_count{{kind="{kind}"}}'), _counter(after, f'{STEP}_count{{kind="{kind}"}}')
        s0, s1 = _counter(before, f'{STEP}_sum{{kind="{kind}"}}'), _counter(after, f'{STEP}_sum{{kind="{kind}"}}')
        if n1 is None or s1 is None:
            continue
        n, t = int(round(n1 - (n0 or 0))), s1 - (s0 or 0)
        out[kind] = {"steps": n, "mean_ms": round(1000 * t / n, 3) if n > 0 else None}
    return out


def kernel_builds(before: dict | None, after: dict | None) -> int | None:
    """Triton kernel variants the server built (compiled, or loaded from disk) during the run: the growth of its
    counter between `before` and `after`; None where the server lacks it. Not 0: the run's figures include those
    builds' stalls (seconds each when compiled)."""
    a, b = _counter(before, KERNEL_BUILDS), _counter(after, KERNEL_BUILDS)
    return None if a is None or b is None or b < a else int(round(b - a))


def leaks(after: dict | None) -> tuple[int | None, int | None]:
    """(KV blocks, LoRA slots) still held once every request finished (and the server had time to settle), or None
    where the server lacks the gauges."""
    free, total, in_use = _gauge(after, KV_FREE), _gauge(after, KV_TOTAL), _gauge(after, SLOTS_IN_USE)
    kv = None if free is None or total is None else int(max(total - free, 0))
    return kv, None if in_use is None else int(in_use)
