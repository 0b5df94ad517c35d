"""FastAPI app: OpenAI completions and chat (streaming or not), models, adapter load/unload, tokenize /
detokenize, version, health, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from moelora import __version__
from moelora.adapters.errors import AdapterError
from moelora.adapters.registry import check_name
from moelora.engine.sampling_params import SamplingParams
from moelora.server.async_engine import AdapterNotFound, AsyncEngine, RequestStream, Update
from moelora.server.generation_config import generation_defaults
from moelora.server.metrics import ServerMetrics
from moelora.server.middleware import Guard
from moelora.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadAdapterRequest,
                                     TokenizeRequest, UnloadAdapterRequest, unsupported_fields)
from moelora.server.responses import CompletionLogprobs, chat_logprobs, prompt_logprobs_field

log = logging.getLogger("moelora.server")


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None = None
    lora_roots: list[str] = field(default_factory=list)  # empty: adapters may be loaded from anywhere
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_logprobs: int = 20  # largest logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's default)
    # sampling defaults for fields a request leaves out: "auto" reads the model folder's generation_config.json
    # (as vLLM), "vllm" uses the built-in defaults, any other value is a folder holding a generation_config.json
    generation_config: str = "auto"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(engine.stats, engine.counters)
    engine.on_step = metrics.observe_step
    tok = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    defaults = generation_defaults(settings.generation_config, settings.model_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="moelora", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    app.add_middleware(Guard, api_key=settings.api_key, max_bytes=settings.max_body_bytes,
                       on_reject=lambda status: metrics.http_errors.labels(status=str(status)).inc())

    def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
        return {"error": {"message": message, "type": type_, "param": param, "code": status}}

    def error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
        metrics.http_errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(status, message, type_, param), status_code=status)

    # ---- errors ----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return error(400, f"the request body is not valid JSON: {first.get('msg', '')} "
                              f"({first.get('ctx', {}).get('error', '')})", "BadRequestError")
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error(400, f"invalid request: {loc}: {first.get('msg', str(e))}", "BadRequestError", loc)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError")

    # ---- helpers ---------------------------------------------------------------------------------
    def model_card(model_id: str) -> dict | None:
        if model_id == settings.served_model_name:
            root, parent = settings.model_path, None
        elif model_id in engine.engine.list_adapters():
            root, parent = engine.engine.registry.path(model_id), settings.served_model_name
        else:
            return None
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "moelora", "root": root,
                "parent": parent, "max_model_len": max_len}

    def resolve_adapter(model: str) -> str | None:
        if model == settings.served_model_name:
            return None
        name = model
        if ":" in model:
            base, name = model.split(":", 1)
            if base != settings.served_model_name:
                raise APIError(404, f"model {model!r} does not exist: the base model is {settings.served_model_name!r}",
                               "NotFoundError", "model")
        if name in engine.engine.list_adapters():
            return name
        raise APIError(404, f"model {model!r} does not exist; models: {[settings.served_model_name, *engine.engine.list_adapters()]}",
                       "NotFoundError", "model")

    def check_supported(req) -> None:
        bad = unsupported_fields(req)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0])

    def check_limits(n: int, max_tokens: int | None, min_tokens: int = 1) -> None:
        if not 1 <= n <= settings.max_n:
            raise APIError(400, f"n must be between 1 and {settings.max_n}, got {n}", param="n")
        if max_tokens is not None and not min_tokens <= max_tokens <= max_len:
            raise APIError(400, f"max_tokens must be between {min_tokens} and {max_len}, got {max_tokens}",
                           param="max_tokens")

    def check_logprobs(value: int | None, name: str) -> int | None:
        if value is not None and not 0 <= value <= settings.max_logprobs:
            raise APIError(400, f"{name} must be between 0 and {settings.max_logprobs} (--max-logprobs), got {value}",
                           param=name)
        return value

    def make_params(req, max_tokens, logprobs, prompt_logprobs) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs, defaults)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def submit_all(prompts, params: SamplingParams, n: int, adapter: str | None, prefix: str) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                for k in range(n):
                    sp = params if n == 1 or params.seed is None else dataclasses.replace(params, seed=params.seed + k)
                    streams.append(await engine.submit(engine.new_request_id(prefix), p, sp, adapter))
        except AdapterNotFound as e:
            _abort(streams)
            raise APIError(404, str(e.args[0]), "NotFoundError", "model") from None
        except (ValueError, TypeError) as e:
            _abort(streams)
            raise APIError(400, str(e)) from None
        return streams

    def _abort(streams: list[RequestStream]) -> None:
        for s in streams:
            s.abort()

    def token_str(tid: int) -> str:
        return tok.decode([tid], skip_special_tokens=False) if tok is not None else str(tid)

    def record(adapter: str | None, t0: float, final: Update, status: str) -> None:
        metrics.requests.labels(status=status, adapter=adapter or "base").inc()
        metrics.prompt_tokens.inc(final.num_prompt_tokens)
        metrics.generation_tokens.inc(final.num_output_tokens)
        if final.first_token_time is not None:
            metrics.ttft.observe(max(0.0, final.first_token_time - t0))
            if final.num_output_tokens > 1:
                metrics.tpot.observe((time.monotonic() - final.first_token_time) / (final.num_output_tokens - 1))

    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Update]]:
        """(choice index, update) from all streams as they come; aborts the rest if the consumer leaves."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            async for upd in s:
                await q.put((i, upd))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, upd = await q.get()
                if upd.finished:
                    left -= 1
                yield i, upd
        finally:
            for t in tasks:
                t.cancel()
            _abort(streams)

    async def collect(streams, raw: Request, adapter: str | None, t0: float) -> list[list[Update]]:
        """All updates of every stream; a client that disconnects aborts its requests, a request that failed
        fails the response (500, its error)."""
        out: list[list[Update]] = [[] for _ in streams]

        async def gather():
            async for i, upd in merged(streams):
                out[i].append(upd)

        task = asyncio.create_task(gather())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                _abort(streams)
                raise APIError(499, "client disconnected")
        task.result()
        failed = [ups[-1] for ups in out if ups[-1].error]
        for final in failed:
            record(adapter, t0, final, "error")
        if failed:
            raise APIError(500, failed[0].error, "InternalServerError")
        return out

    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # ---- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in [settings.served_model_name,
                                                                   *engine.engine.list_adapters()]]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = model_card(model_id)
        if card is None:
            raise APIError(404, f"model {model_id!r} does not exist", "NotFoundError", "model")
        return card

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if req.model is not None:
            resolve_adapter(req.model)
        if req.messages is not None:
            text = render_chat(req.messages, req.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if req.model is not None:
            resolve_adapter(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.engine.config.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of vocabulary [0, {engine.engine.config.vocab_size}): {bad[:5]}",
                           param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(req: LoadAdapterRequest):
        try:
            check_name(req.lora_name)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_name") from None
        if req.lora_name == settings.served_model_name:
            raise APIError(400, f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
        if "\x00" in req.lora_path:
            raise APIError(400, "lora_path contains a NUL byte", param="lora_path")
        path = os.path.realpath(req.lora_path)
        roots = [os.path.realpath(r) for r in settings.lora_roots] or None
        if roots and not any(os.path.commonpath([path, r]) == r for r in roots):
            raise APIError(400, f"lora_path {req.lora_path!r} is not under an allowed --lora-root {settings.lora_roots}",
                           param="lora_path")
        try:
            await engine.load_adapter(req.lora_name, path, roots)
        except (AdapterError, ValueError) as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(req: UnloadAdapterRequest):
        try:
            await engine.unload_adapter(req.lora_name)
        except AdapterNotFound as e:
            raise APIError(404, str(e.args[0]), "NotFoundError", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_supported(req)
        adapter = resolve_adapter(req.model)
        check_limits(req.n, req.max_tokens, min_tokens=0)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        lp = check_logprobs(req.logprobs, "logprobs")
        plp = check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        echo_lp = lp if req.echo else None  # the echoed prompt's tokens get log-probabilities too
        prompt_k = max((k for k in (plp, echo_lp) if k is not None), default=None)
        # max_tokens 0 (scoring a prompt): one token is computed and dropped, so the prompt's logprobs come out
        scoring = req.max_tokens == 0
        params = make_params(req, 1 if scoring else req.max_tokens, lp, prompt_k)
        t0 = time.monotonic()
        streams = await submit_all(prompts, params, req.n, adapter, "cmpl")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_texts = [p if isinstance(p, str) else (tok.decode(p) if tok else "") for p in prompts]

        def chunk(choices, usage_=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": choices, "usage": usage_}

        def finish_reason(u: Update) -> str | None:
            return "length" if scoring else u.finish_reason

        if req.stream:
            async def events():
                started: set[int] = set()
                out_tokens, prompt_tokens, cached = 0, {}, {}
                offsets = [CompletionLogprobs(token_str) for _ in streams]
                async for i, u in merged(streams):
                    prompt_tokens[i // req.n] = u.num_prompt_tokens
                    cached[i // req.n] = max(cached.get(i // req.n, 0), u.num_cached_tokens)
                    if u.error:
                        record(adapter, t0, u, "error")
                        yield sse(error_body(500, u.error, "InternalServerError"))
                        continue
                    text, lps = "", None
                    if i not in started:
                        started.add(i)
                        if req.echo:
                            text = prompt_texts[i // req.n]
                            if lp is not None:
                                lps = offsets[i].prompt(u.prompt_ids, u.prompt_logprobs)
                            else:
                                offsets[i].offset = len(text)
                    if not scoring:
                        text += u.text
                        out_tokens += len(u.token_ids)
                        if lp is not None:
                            gen = offsets[i].tokens([u])
                            lps = gen if lps is None else CompletionLogprobs.join(lps, gen)
                    # a chunk for every token, its text empty or not (held back by a stop string, a partial
                    # character, a token outside the tokenizer), as vLLM: clients time the first token by it
                    if text or u.finished or lps or (u.token_ids and not scoring):
                        choice = {"index": i, "text": text, "logprobs": lps,
                                  "finish_reason": finish_reason(u) if u.finished else None}
                        if plp is not None and u.prompt_logprobs is not None:
                            choice["prompt_logprobs"] = prompt_logprobs_field(u.prompt_ids, u.prompt_logprobs, token_str)
                        so_far = (usage(sum(prompt_tokens.values()), out_tokens, sum(cached.values()))
                                  if req.continuous_usage else None)
                        yield sse(chunk([choice], so_far))
                    if u.finished:
                        record(adapter, t0, u, finish_reason(u) or "stop")
                if req.include_usage:
                    yield sse(chunk([], usage(sum(prompt_tokens.values()), out_tokens, sum(cached.values()))))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        per_choice = await collect(streams, raw, adapter, t0)
        choices, n_prompt, n_out, cached = [], {}, 0, {}
        for i, ups in enumerate(per_choice):
            final = ups[-1]
            record(adapter, t0, final, finish_reason(final) or "stop")
            cached[i // req.n] = max(cached.get(i // req.n, 0), final.num_cached_tokens)
            echo = prompt_texts[i // req.n] if req.echo else ""
            text = "" if scoring else "".join(u.text for u in ups)
            n_prompt[i // req.n] = final.num_prompt_tokens
            n_out += 0 if scoring else final.num_output_tokens
            logprobs = None
            if lp is not None:
                fmt = CompletionLogprobs(token_str)
                parts = [fmt.prompt(final.prompt_ids, final.prompt_logprobs)] if req.echo else []
                parts += [] if scoring else [fmt.tokens(ups)]
                logprobs = CompletionLogprobs.join(*parts) if parts else None
            choice = {"index": i, "text": echo + text, "logprobs": logprobs, "finish_reason": finish_reason(final)}
            if plp is not None:
                choice["prompt_logprobs"] = prompt_logprobs_field(final.prompt_ids, final.prompt_logprobs, token_str)
            choices.append(choice)
        return chunk(choices, usage(sum(n_prompt.values()), n_out, sum(cached.values())))

    def render_chat(messages, add_generation_prompt: bool) -> str:
        for m in messages:
            kind = m.non_text_part()
            if kind is not None:
                raise APIError(400, f"message content of type {kind!r} is not supported: moelora serves text models",
                               param="messages")
        try:
            return tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                           add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a missing template or one that rejects these messages
            raise APIError(400, f"chat template: {e}", param="messages") from None

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_supported(req)
        adapter = resolve_adapter(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        check_limits(req.n, max_tokens)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        k = check_logprobs(req.top_logprobs, "top_logprobs") or 0
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
        prompt = render_chat(req.messages, req.add_generation_prompt)
        params = make_params(req, max_tokens, k if req.logprobs else None, None)
        t0 = time.monotonic()
        streams = await submit_all([prompt], params, req.n, adapter, "chat")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices, usage_=None, obj="chat.completion.chunk"):
            return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices, "usage": usage_}

        if req.stream:
            async def events():
                started, out_tokens, n_prompt, cached = set(), 0, 0, 0
                async for i, u in merged(streams):
                    n_prompt, cached = u.num_prompt_tokens, max(cached, u.num_cached_tokens)
                    if u.error:
                        record(adapter, t0, u, "error")
                        yield sse(error_body(500, u.error, "InternalServerError"))
                        continue
                    if i not in started:
                        started.add(i)
                        yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))
                    out_tokens += len(u.token_ids)
                    lps = chat_logprobs([u], k, token_str) if req.logprobs else None
                    so_far = usage(n_prompt, out_tokens, cached) if req.continuous_usage else None
                    if u.text or lps or (u.token_ids and not u.finished):  # a chunk a token, as completions
                        yield sse(chunk([{"index": i, "delta": {"content": u.text}, "logprobs": lps,
                                          "finish_reason": None}], so_far))
                    if u.finished:
                        record(adapter, t0, u, u.finish_reason or "stop")
                        yield sse(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": u.finish_reason}],
                                        so_far))
                if req.include_usage:
                    yield sse(chunk([], usage(n_prompt, out_tokens, cached)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        per_choice = await collect(streams, raw, adapter, t0)
        choices, n_out, n_prompt, cached = [], 0, 0, 0
        for i, ups in enumerate(per_choice):
            final = ups[-1]
            record(adapter, t0, final, final.finish_reason or "stop")
            n_prompt, n_out = final.num_prompt_tokens, n_out + final.num_output_tokens
            cached = max(cached, final.num_cached_tokens)
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(u.text for u in ups)},
                            "logprobs": chat_logprobs(ups, k, token_str) if req.logprobs else None,
                            "finish_reason": final.finish_reason})
        return chunk(choices, usage(n_prompt, n_out, cached), obj="chat.completion")

    return app
