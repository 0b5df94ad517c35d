"""`bench serve`'s requests: what each one asks (RequestSpec, build_spec: deterministic in the seed and its index,
with a model's shared prefix), and sending it to POST /v1/completions, streamed (SSE) or not, into a RequestResult
(status, TTFT, TPOT, tokens, latency, the usage the server reported)."""

from __future__ import annotations

import json
import random
import string
import time
from dataclasses import dataclass
from typing import Any

import httpx

from moelora.demo import make_prompt, random_input


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


class _StreamError(Exception):
    pass


def error_text(resp_body: bytes, limit: int = 300) -> str:
    text = resp_body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict) and "message" in err:
            text = str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:limit]


async def stream_request(client: httpx.AsyncClient, spec: RequestSpec, body: dict) -> RequestResult:
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
                raise _StreamError(f"HTTP {resp.status_code}: {error_text(raw)}")
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
                # a chunk a token (text may be empty: held back by a stop string, or a token the tokenizer does
                # not spell); the usage chunk has no choices
                if any(isinstance(c, dict) and isinstance(c.get("text"), str) for c in choices):
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


async def plain_request(client: httpx.AsyncClient, spec: RequestSpec, body: dict) -> RequestResult:
    res = RequestResult(index=spec.index, model=spec.model, status="ok")
    t0 = time.perf_counter()
    try:
        resp = await client.post("/v1/completions", json=body)
        res.http_status = resp.status_code
        if resp.status_code != 200:
            raise _StreamError(f"HTTP {resp.status_code}: {error_text(resp.content)}")
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
