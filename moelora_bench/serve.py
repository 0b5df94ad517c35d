"""`moelora bench serve`: a load generator against a running OpenAI-compatible server.

N concurrent workers pull request specs from a queue and send them to ``POST /v1/completions``
(streaming by default, with ``stream_options: {"include_usage": true}``), until ``--num-requests``
requests are done or ``--duration`` seconds have passed, whichever comes first. Requests are spread
round-robin over ``--models`` (by default every model that ``GET /v1/models`` lists: the base model and
each adapter). A share of the streaming clients (``--disconnect-fraction``) close the connection on
purpose after 1-3 content chunks, to exercise the server's abort path; those are counted apart and are
not errors.

With ``--shared-prefix-len N`` every model requests are sent to (the base model and each adapter) gets a fixed random
prefix of about N tokens of its own (``shared_prefixes``: deterministic in --seed and the model's name), and each
request's prompt is its model's prefix followed by the usual short per-request prompt (the same one the unshared
workload sends; --prompt-len still sets its length): a workload for a prefix cache keyed by adapter. The prefix is N
characters of random lowercase words with the default (demo) prompts, whose tokenizer has one token per character, or
N random words with --prompt-len (for other tokenizers, so only about N tokens). The tokens each prefix really takes
are asked of the server (vLLM's ``POST /tokenize``) and kept in the config (``shared_prefix_tokens``, None where it
cannot say).

Per request it records the model, the status (``ok`` / ``error`` with a message / ``disconnected``),
TTFT (time to the first content chunk), TPOT ((last chunk time - first chunk time) / (tokens - 1)),
the output tokens (from the final usage chunk, else the number of content chunks) and the latency.
After the run it reads ``GET /metrics`` (Prometheus text) and keeps the families whose names contain
``kv_blocks``, ``lora_slots``, ``running``, ``waiting`` or ``prefix_cache``; while it runs it also polls them and
keeps each sample's peak (``metrics_peak``; not of the free-block gauges, whose peak says nothing).

The prefix cache (``prefix_cache`` in the summary): ``queries`` and ``hits``, the growth over the run of the server's
``moelora_prefix_cache_queries_total`` (prompt tokens looked up in the prefix cache) and
``moelora_prefix_cache_hits_total`` (prompt tokens served from it) counters, read before the first request and after
the last one settled; ``hit_rate`` = hits / queries (None where the server lacks the counters or looked nothing up);
``cached_tokens_reported``, the sum of ``usage.prompt_tokens_details.cached_tokens`` over the responses (in streams the
final usage chunk, which is always asked for), None where no response carried it; ``prompt_tokens_reported``, the sum
of ``usage.prompt_tokens``. Other clients of the same server count in the counters too.

The KV cache (``kv_cache`` in the summary): ``blocks_total``; ``blocks_free_min``, the fewest free blocks
during the run, and ``blocks_used_peak`` = total - min free. The minimum comes from the server's
``moelora_kv_blocks_free_min`` gauge (its lowest since it started; read before and after the run, so a low
mark older than the run is not taken for the run's) where the server has it (``blocks_free_min_source``
"server"), else from the polled ``moelora_kv_blocks_free`` samples ("polled": every --metrics-interval
seconds, so an upper bound of the true minimum).

Leaks: after the last request, aborted requests are freed asynchronously, so it polls ``/metrics`` for up
to --settle-timeout seconds until every KV block is free and no LoRA slot is in use, then reports
``kv_blocks_leaked`` (total - free) and ``lora_slots_leaked`` (``moelora_lora_slots_in_use``), None where the
server lacks the gauge. Other clients of the same server count as leaks.

A progress bar (tqdm where installed, the ``bench`` extra; else a line every few seconds) goes to stderr,
never into the JSON; --no-progress turns it off. The JSON goes to <out>/serve-<date>-<device>.json, or with
-2, -3, ... added when an earlier run of the day has that name.

Standalone: ``python -m moelora_bench.serve --url http://127.0.0.1:8000 --concurrency 32``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import string
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["add_arguments", "run_load", "main", "RequestSpec", "RequestResult", "build_spec",
           "parse_range", "parse_metrics", "summarize", "format_table", "kv_summary", "leaks", "Progress",
           "METRIC_KEYS", "shared_prefix", "shared_prefixes", "prefix_cache_summary"]

METRIC_KEYS = ("kv_blocks", "lora_slots", "running", "waiting", "prefix_cache")
KV_FREE = "moelora_kv_blocks_free"
KV_FREE_MIN = "moelora_kv_blocks_free_min"  # the server's lowest free-block count since it started
KV_TOTAL = "moelora_kv_blocks_total"
SLOTS_IN_USE = "moelora_lora_slots_in_use"
PREFIX_QUERIES = "moelora_prefix_cache_queries_total"  # prompt tokens looked up in the prefix cache (a counter)
PREFIX_HITS = "moelora_prefix_cache_hits_total"  # prompt tokens served from it (a counter)
MAX_ERROR_MESSAGES = 10
DEFAULT_NUM_REQUESTS = 200


# --------------------------------------------------------------------------------------------- args

def _add(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """add_argument, skipping an option the parser already has (e.g. `moelora bench`'s own --out)."""
    if any(f in parser._option_string_actions for f in flags):  # noqa: SLF001
        return
    parser.add_argument(*flags, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moelora bench serve` (and of `python -m moelora_bench.serve`)."""
    _add(parser, "--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    _add(parser, "--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    _add(parser, "--models", default=None,
         help="comma list of model names to spread requests over (base model name and/or adapter names); "
              "default: every model of GET /v1/models")
    _add(parser, "--concurrency", type=int, default=16, help="concurrent clients (default %(default)s)")
    _add(parser, "--num-requests", type=int, default=None,
         help=f"requests to send (default {DEFAULT_NUM_REQUESTS}, or unlimited when --duration is given)")
    _add(parser, "--duration", type=float, default=None, help="stop starting requests after this many seconds")
    _add(parser, "--prompt-len", default=None,
         help="MIN:MAX prompt length in words (~tokens) of random lowercase words, followed by ' => '; "
              "default: the demo task's inputs (moelora.demo.random_input, 3..24 characters)")
    _add(parser, "--shared-prefix-len", type=int, default=0,
         help="give each model (the base and each adapter requests go to) a fixed random prefix of about N tokens of "
              "its own, deterministic in --seed, before every request's prompt (whose length --prompt-len still "
              "sets): N characters of random words with the demo prompts (the demo tokenizer: one token per "
              "character), N random words with --prompt-len (other tokenizers: approximate); the tokens it really "
              "takes are asked of the server's /tokenize. Default 0: no shared prefix")
    _add(parser, "--output-len", default="16:64", help="MIN:MAX max_tokens per request (default %(default)s)")
    _add(parser, "--disconnect-fraction", type=float, default=0.0,
         help="share of streaming requests whose client closes the connection after 1-3 chunks (default 0)")
    _add(parser, "--stream", action=argparse.BooleanOptionalAction, default=True,
         help="stream responses (SSE); --no-stream for plain JSON responses (default: stream)")
    _add(parser, "--temperature", type=float, default=0.0, help="sampling temperature (default %(default)s)")
    _add(parser, "--seed", type=int, default=0, help="seed of the prompt/length/disconnect choices (default 0)")
    _add(parser, "--timeout", type=float, default=300.0, help="per-request timeout in seconds (default %(default)s)")
    _add(parser, "--metrics-interval", type=float, default=1.0,
         help="seconds between /metrics polls during the run, for the peaks (default %(default)s)")
    _add(parser, "--settle-timeout", type=float, default=5.0,
         help="after the last request, seconds to wait for the server to free every KV block and LoRA slot "
              "(aborted requests are freed asynchronously) before counting what is left as leaked "
              "(default %(default)s)")
    _add(parser, "--progress", action=argparse.BooleanOptionalAction, default=True,
         help="a progress bar on stderr (tqdm if installed, else a line every few seconds); --no-progress: none")
    _add(parser, "--out", default="bench/results", help="folder for the JSON results (default %(default)s)")


def parse_range(spec: str | None, name: str = "range") -> tuple[int, int] | None:
    """'MIN:MAX' (or 'N') -> (min, max); None -> None."""
    if spec is None:
        return None
    lo, sep, hi = str(spec).partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"{name} expects MIN:MAX, got {spec!r}") from None
    if a < 1 or b < a:
        raise ValueError(f"{name} expects 1 <= MIN <= MAX, got {spec!r}")
    return a, b


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


# --------------------------------------------------------------------------------------------- specs

@dataclass
class RequestSpec:
    index: int
    model: str
    prompt: str
    max_tokens: int
    disconnect_after: int | None = None  # close the stream after this many content chunks


@dataclass
class RequestResult:
    index: int
    model: str
    status: str  # "ok" | "error" | "disconnected"
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    latency_s: float | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens, where the response reported it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the response reported it


def _read_usage(usage: Any, res: RequestResult) -> int | None:
    """Take prompt_tokens and prompt_tokens_details.cached_tokens of a usage object into `res`; return its
    completion_tokens (None where absent)."""
    if not isinstance(usage, dict):
        return None
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])
    return None if usage.get("completion_tokens") is None else int(usage["completion_tokens"])


def _random_words(rng: random.Random, n_words: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
                    for _ in range(n_words))


def shared_prefix(model: str, length: int, seed: int, words: bool = False) -> str:
    """`model`'s shared prefix: random lowercase words separated by single spaces and one space after the last,
    deterministic in (seed, model). words=False: exactly `length` characters (= tokens for the demo model's tokenizer,
    one per character); words=True: `length` words (about that many tokens for other tokenizers). '' for length 0."""
    if length <= 0:
        return ""
    rng = random.Random(f"{seed}:shared-prefix:{model}")
    if words:
        return _random_words(rng, length) + " "
    text = ""
    while len(text) < length - 1:
        text += ("" if not text else " ") + "".join(rng.choice(string.ascii_lowercase)
                                                      for _ in range(rng.randint(2, 7)))
    text = text[: length - 1]
    if text.endswith(" "):  # a cut at a word break: no double space before the separator
        text = text[:-1] + rng.choice(string.ascii_lowercase)
    return text + " "


def shared_prefixes(models: list[str], length: int, seed: int, words: bool = False) -> dict[str, str]:
    """Every model's shared prefix (see shared_prefix); {} for length 0."""
    if length <= 0:
        return {}
    return {m: shared_prefix(m, length, seed, words) for m in models}


def build_spec(index: int, models: list[str], prompt_len: tuple[int, int] | None, output_len: tuple[int, int],
               disconnect_fraction: float, stream: bool, seed: int,
               prefixes: dict[str, str] | None = None) -> RequestSpec:
    """The index-th request: deterministic in (seed, index), whatever the order workers take them in. `prefixes`
    (model -> its shared prefix, see shared_prefixes) goes before the prompt; the rest of the request is the same
    with or without it."""
    from moelora.demo import make_prompt, random_input

    rng = random.Random(f"{seed}:{index}")
    if prompt_len is None:
        text = random_input(rng)
    else:
        text = _random_words(rng, rng.randint(*prompt_len))
    max_tokens = rng.randint(*output_len)
    disconnect = rng.random() < disconnect_fraction
    after = rng.randint(1, 3)
    model = models[index % len(models)]
    return RequestSpec(index=index, model=model, prompt=(prefixes or {}).get(model, "") + make_prompt(text),
                       max_tokens=max_tokens, disconnect_after=after if (disconnect and stream) else None)


# --------------------------------------------------------------------------------------------- requests

class _StreamError(Exception):
    pass


def _error_text(resp_body: bytes, limit: int = 300) -> str:
    text = resp_body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict) and "message" in err:
            text = str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:limit]


async def _stream_request(client: httpx.AsyncClient, spec: RequestSpec, body: dict) -> RequestResult:
    res = RequestResult(index=spec.index, model=spec.model, status="ok")
    t0 = time.perf_counter()
    first = last = None
    usage_tokens = None
    got_done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            res.http_status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                raise _StreamError(f"HTTP {resp.status_code}: {_error_text(raw)}")
            async for line in resp.aiter_lines():
                line = line.rstrip("\r")
                if not line or line.startswith(":"):
                    continue  # event separator / SSE comment
                if got_done:
                    continue
                field_name, sep, value = line.partition(":")
                if not sep or field_name not in ("data", "event", "id", "retry"):
                    raise _StreamError(f"malformed SSE line: {line[:120]!r}")
                if field_name != "data":
                    continue
                value = value[1:] if value.startswith(" ") else value
                if value.strip() == "[DONE]":
                    got_done = True
                    continue
                try:
                    chunk = json.loads(value)
                except ValueError:
                    raise _StreamError(f"malformed SSE data: {value[:120]!r}") from None
                if not isinstance(chunk, dict):
                    raise _StreamError(f"malformed SSE data: {value[:120]!r}")
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise _StreamError(f"error in stream: {str(msg)[:300]}")
                completion = _read_usage(chunk.get("usage"), res)
                if completion is not None:
                    usage_tokens = completion
                choices = chunk.get("choices") or []
                if any(isinstance(c, dict) and c.get("text") for c in choices):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    last = now
                    res.chunks += 1
                    if spec.disconnect_after is not None and res.chunks >= spec.disconnect_after:
                        res.status = "disconnected"
                        break  # leaving the block closes the response and its connection
        if res.status != "disconnected" and not got_done:
            raise _StreamError("stream ended without data: [DONE]")
    except _StreamError as e:
        res.status, res.error = "error", str(e)
    except Exception as e:  # noqa: BLE001 - transport errors (httpx.HTTPError) and anything unexpected
        res.status, res.error = "error", f"{type(e).__name__}: {e}"[:300]
    res.latency_s = time.perf_counter() - t0
    res.output_tokens = usage_tokens if (usage_tokens is not None and res.status != "disconnected") else res.chunks
    if first is not None:
        res.ttft_s = first - t0
        if res.status == "ok" and res.output_tokens > 1:
            res.tpot_s = (last - first) / (res.output_tokens - 1)
    return res


async def _plain_request(client: httpx.AsyncClient, spec: RequestSpec, body: dict) -> RequestResult:
    res = RequestResult(index=spec.index, model=spec.model, status="ok")
    t0 = time.perf_counter()
    try:
        resp = await client.post("/v1/completions", json=body)
        res.http_status = resp.status_code
        if resp.status_code != 200:
            raise _StreamError(f"HTTP {resp.status_code}: {_error_text(resp.content)}")
        try:
            obj = resp.json()
        except ValueError:
            raise _StreamError(f"malformed JSON response: {resp.text[:120]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            raise _StreamError(f"response without choices: {resp.text[:120]!r}")
        completion = _read_usage(obj.get("usage"), res)
        if completion is not None:
            res.output_tokens = completion
        else:
            res.output_tokens = sum(1 for c in obj["choices"] if c.get("text"))
    except _StreamError as e:
        res.status, res.error = "error", str(e)
    except Exception as e:  # noqa: BLE001
        res.status, res.error = "error", f"{type(e).__name__}: {e}"[:300]
    res.latency_s = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------------------------- metrics

def _fallback_families(text: str):
    """A minimal Prometheus text parser, used only when prometheus_client is not installed. As prometheus_client's:
    a TYPE line opens a family (listed even without samples; a counter's named without `_total`, its samples with
    it) that takes the samples of its name (and a histogram's or summary's `_bucket` / `_sum` / `_count`); any other
    sample is a family of its own name."""
    from types import SimpleNamespace

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


async def _fetch_metrics(client: httpx.AsyncClient) -> tuple[dict | None, str | None]:
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


def _track(m: dict | None, peaks: dict, lows: dict) -> None:
    """Fold one /metrics sample into `peaks` (the maximum of every sample but the free gauges') and `lows` (the
    minimum of the free gauges')."""
    for fam, samples in (m or {}).items():
        free = _is_free_gauge(fam)
        dst = (lows if free else peaks).setdefault(fam, {})
        for k, v in samples.items():
            if not math.isnan(v):
                dst[k] = (min if free else max)(dst.get(k, v), v)


async def _poll_metrics(client: httpx.AsyncClient, peaks: dict, lows: dict, stop: asyncio.Event,
                        interval: float) -> None:
    while not stop.is_set():
        m, err = await _fetch_metrics(client)
        if err is not None:
            return  # no /metrics (or not parseable): stop polling
        _track(m, peaks, lows)
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


async def _settle(client: httpx.AsyncClient, timeout: float, poll_s: float = 0.1) -> tuple[dict | None, str | None]:
    """/metrics after the run, once the server is idle (see _idle) or `timeout` seconds have passed."""
    deadline = time.perf_counter() + max(timeout, 0.0)
    while True:
        m, err = await _fetch_metrics(client)
        if m is None or _idle(m) is not False or time.perf_counter() >= deadline:
            return m, err
        await asyncio.sleep(poll_s)


def kv_summary(before: dict | None, after: dict | None, lows: dict) -> dict:
    """The KV cache over the run: total blocks, the fewest free (and from where), the most used, the free blocks
    after it. `before` / `after`: /metrics (parse_metrics) before the first request and after the last one settled;
    `lows`: the polled minima of the free gauges (see _track)."""
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


def leaks(after: dict | None) -> tuple[int | None, int | None]:
    """(KV blocks, LoRA slots) still held once every request finished (and the server had time to settle), or None
    where the server lacks the gauges."""
    free, total, in_use = _gauge(after, KV_FREE), _gauge(after, KV_TOTAL), _gauge(after, SLOTS_IN_USE)
    kv = None if free is None or total is None else int(max(total - free, 0))
    return kv, None if in_use is None else int(in_use)


# --------------------------------------------------------------------------------------------- progress

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


async def _tick(progress: Progress, stop: asyncio.Event, interval: float = 0.5) -> None:
    while not stop.is_set():
        progress.tick()
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


# --------------------------------------------------------------------------------------------- summary

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


# --------------------------------------------------------------------------------------------- run

async def _list_models(client: httpx.AsyncClient) -> list[str]:
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise RuntimeError(f"GET /v1/models failed: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {_error_text(resp.content)}")
    models = [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and m.get("id")]
    if not models:
        raise RuntimeError("GET /v1/models listed no models; pass --models")
    return models


async def _count_tokens(client: httpx.AsyncClient, model: str, text: str) -> int | None:
    """The tokens `text` takes in `model`'s tokenizer, from vLLM's POST /tokenize; None where the server cannot say."""
    try:
        resp = await client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        count = resp.json().get("count") if resp.status_code == 200 else None
        return None if count is None else int(count)
    except Exception:  # noqa: BLE001 - only a note in the config; never fail the run on it
        return None


async def run_load(args: argparse.Namespace) -> dict:
    """Run the load described by `args` (the options of add_arguments) and return the summary dict
    (see summarize), with 'config', 'metrics' (after the run, once settled), 'metrics_peak' (polled during it),
    'metrics_error' (None, or why /metrics could not be read), 'kv_cache' (see kv_summary), 'kv_blocks_leaked'
    and 'lora_slots_leaked' (see leaks), 'prefix_cache' (see prefix_cache_summary)."""
    concurrency = int(_get(args, "concurrency", 16))
    if concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    duration = _get(args, "duration")
    num_requests = _get(args, "num_requests")
    if num_requests is None and duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    frac = float(_get(args, "disconnect_fraction", 0.0) or 0.0)
    if not 0.0 <= frac <= 1.0:
        raise ValueError("--disconnect-fraction must be within [0, 1]")
    prompt_len = parse_range(_get(args, "prompt_len"), "--prompt-len")
    output_len = parse_range(_get(args, "output_len", "16:64"), "--output-len")
    stream = bool(_get(args, "stream", True))
    seed = int(_get(args, "seed", 0) or 0)
    temperature = float(_get(args, "temperature", 0.0))
    timeout = float(_get(args, "timeout", 300.0) or 300.0)
    prefix_len = int(_get(args, "shared_prefix_len", 0) or 0)
    if prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    prefix_words = prompt_len is not None  # random words with --prompt-len, characters with the demo prompts

    headers = {}
    if _get(args, "api_key"):
        headers["Authorization"] = f"Bearer {args.api_key}"
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=_get(args, "url", "http://127.0.0.1:8000").rstrip("/"),
                                 headers=headers, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        models_arg = _get(args, "models")
        if models_arg:
            models = [m.strip() for m in models_arg.split(",") if m.strip()]
        else:
            models = await _list_models(client)
        prefixes = shared_prefixes(models, prefix_len, seed, prefix_words)
        prefix_tokens = {m: await _count_tokens(client, m, p) for m, p in prefixes.items()} if prefixes else None

        queue: asyncio.Queue[RequestSpec | None] = asyncio.Queue(maxsize=2 * concurrency)
        results: list[RequestResult] = []
        peaks: dict = {}
        lows: dict = {}
        before, _ = await _fetch_metrics(client)  # the server's low marks before this run
        _track(before, {}, lows)
        progress = Progress(num_requests, duration, bool(_get(args, "progress", True)))
        t_start = time.perf_counter()
        deadline = t_start + duration if duration is not None else None

        async def producer() -> None:
            i = 0
            while (num_requests is None or i < num_requests) and (deadline is None or time.perf_counter() < deadline):
                await queue.put(build_spec(i, models, prompt_len, output_len, frac, stream, seed, prefixes))
                i += 1
            for _ in range(concurrency):
                await queue.put(None)

        async def worker() -> None:
            while True:
                spec = await queue.get()
                if spec is None:
                    return
                if deadline is not None and time.perf_counter() >= deadline:
                    continue  # drain: time is up, start nothing new
                body = {"model": spec.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                        "temperature": temperature, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                    res = await _stream_request(client, spec, body)
                else:
                    res = await _plain_request(client, spec, body)
                results.append(res)
                progress.update(res)

        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_metrics(client, peaks, lows, stop,
                                                   float(_get(args, "metrics_interval", 1.0))))
        ticker = asyncio.create_task(_tick(progress, stop))
        try:
            await asyncio.gather(producer(), *(worker() for _ in range(concurrency)))
        finally:
            duration_s = time.perf_counter() - t_start
            stop.set()
            await asyncio.gather(poller, ticker, return_exceptions=True)
            progress.close()
        metrics, metrics_error = await _settle(client, float(_get(args, "settle_timeout", 5.0)))
        _track(metrics, peaks, lows)

    summary = summarize(results, duration_s)
    summary["config"] = {
        "url": _get(args, "url"), "models": models, "concurrency": concurrency, "num_requests": num_requests,
        "duration": duration, "prompt_len": _get(args, "prompt_len") or "demo", "output_len": _get(args, "output_len"),
        "disconnect_fraction": frac, "stream": stream, "temperature": temperature, "seed": seed,
        "shared_prefix_len": prefix_len,
        "shared_prefix_unit": ("words" if prefix_words else "chars") if prefix_len else None,
        "shared_prefix_tokens": prefix_tokens,
    }
    summary["metrics"] = metrics or {}
    summary["metrics_peak"] = peaks
    summary["metrics_error"] = metrics_error
    summary["kv_cache"] = kv_summary(before, metrics, lows)
    summary["kv_blocks_leaked"], summary["lora_slots_leaked"] = leaks(metrics)
    summary["prefix_cache"] = prefix_cache_summary(before, metrics, results)
    return summary


# --------------------------------------------------------------------------------------------- main

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


def main(args: argparse.Namespace) -> int:
    """Run the load, print a table, write the JSON result; 1 if any request failed (or the run could
    not start), else 0."""
    try:
        summary = asyncio.run(run_load(args))
    except (RuntimeError, ValueError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    from moelora_bench.common import write_result

    path = write_result("serve", summary, _get(args, "out", "bench/results"), new_file=True)  # never overwrites
    print(f"\nwrote {path}")
    return 1 if summary["errors"]["count"] else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m moelora_bench.serve", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
