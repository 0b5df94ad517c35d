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
``kv_blocks``, ``lora_slots``, ``running``, ``waiting``, ``prefix_cache`` or ``step_duration``; while it runs it also polls them and
keeps each sample's peak (``metrics_peak``; not of the free-block gauges, whose peak says nothing).

The prefix cache (``prefix_cache`` in the summary): ``queries`` and ``hits``, the growth over the run of the server's
``moelora_prefix_cache_queries_total`` (prompt tokens looked up in the prefix cache) and
``moelora_prefix_cache_hits_total`` (prompt tokens served from it) counters, read before the first request and after
the last one settled; ``hit_rate`` = hits / queries (None where the server lacks the counters or looked nothing up);
``cached_tokens_reported``, the sum of ``usage.prompt_tokens_details.cached_tokens`` over the responses (in streams the
final usage chunk, which is always asked for), None where no response carried it; ``prompt_tokens_reported``, the sum
of ``usage.prompt_tokens``. Other clients of the same server count in the counters too.

The engine's steps (``steps`` in the summary): for each kind of the server's ``moelora_step_duration_seconds``
histogram, ``prefill`` (a step that computed prompt tokens, run eagerly) and ``decode`` (one token a request, a CUDA
graph where one was captured), how many ran over the run and their mean duration (``mean_ms``).
``triton_kernel_builds``: the Triton kernel variants the server built at first use during the run (the growth of
``moelora_triton_kernel_builds_total``; None where the server lacks it). Not 0, the run's times include those
builds (seconds each when compiled): warm the server up with the same workload first.

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

Standalone: ``python -m moelora_bench.serve --url http://127.0.0.1:8000 --concurrency 32``. This file holds the
command line and the run; serve_requests.py the requests, serve_metrics.py the server's /metrics, serve_summary.py the
summary, its table and the progress line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import httpx

from moelora_bench.common import write_result
from moelora_bench.serve_metrics import (METRIC_KEYS, fetch_metrics, kernel_builds, kv_summary, leaks, parse_metrics,
                                         poll_metrics, prefix_cache_summary, settle, step_summary, track)
from moelora_bench.serve_requests import (RequestResult, RequestSpec, build_spec, error_text, plain_request,
                                          shared_prefix, shared_prefixes, stream_request)
from moelora_bench.serve_summary import Progress, format_table, summarize, tick

__all__ = ["add_arguments", "run_load", "main", "RequestSpec", "RequestResult", "build_spec",
           "parse_range", "parse_metrics", "summarize", "format_table", "kv_summary", "leaks", "Progress",
           "METRIC_KEYS", "shared_prefix", "shared_prefixes", "prefix_cache_summary"]

DEFAULT_NUM_REQUESTS = 200


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


async def _list_models(client: httpx.AsyncClient) -> list[str]:
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise RuntimeError(f"GET /v1/models failed: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {error_text(resp.content)}")
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
        before, _ = await fetch_metrics(client)  # the server's low marks before this run
        track(before, {}, lows)
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
                    res = await stream_request(client, spec, body)
                else:
                    res = await plain_request(client, spec, body)
                results.append(res)
                progress.update(res)

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_metrics(client, peaks, lows, stop,
                                                   float(_get(args, "metrics_interval", 1.0))))
        ticker = asyncio.create_task(tick(progress, stop))
        try:
            await asyncio.gather(producer(), *(worker() for _ in range(concurrency)))
        finally:
            duration_s = time.perf_counter() - t_start
            stop.set()
            await asyncio.gather(poller, ticker, return_exceptions=True)
            progress.close()
        metrics, metrics_error = await settle(client, float(_get(args, "settle_timeout", 5.0)))
        track(metrics, peaks, lows)

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
    summary["steps"] = step_summary(before, metrics)
    summary["triton_kernel_builds"] = kernel_builds(before, metrics)
    return summary


def main(args: argparse.Namespace) -> int:
    """Run the load, print a table, write the JSON result; 1 if any request failed (or the run could
    not start), else 0."""
    try:
        summary = asyncio.run(run_load(args))
    except (RuntimeError, ValueError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    path = write_result("serve", summary, _get(args, "out", "bench/results"), new_file=True)  # never overwrites
    print(f"\nwrote {path}")
    return 1 if summary["errors"]["count"] else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m moelora_bench.serve", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
