"""FastAPI app: OpenAI completions and chat (streaming or not), models, adapter load/unload, health, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from moelora.adapters.errors import AdapterError
from moelora.engine.sampling_params import SamplingParams
from moelora.server.async_engine import AdapterNotFound, AsyncEngine, RequestStream, Update
from moelora.server.metrics import ServerMetrics
from moelora.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadAdapterRequest,
                                     UnloadAdapterRequest)


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None = None
    lora_roots: list[str] = field(default_factory=list)  # empty: adapters may be loaded from anywhere
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_tokens_limit: int | None = None  # None: the context length
    shutdown_timeout: float = 30.0


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else status


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status_code=status)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(engine.stats)
    engine.on_step = lambda n: metrics.batch_size.observe(n) if n else None
    tok = engine.engine.tokenizer
    max_len = engine.engine.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, settings.shutdown_timeout)

    app = FastAPI(title="moelora", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings

    # ---- errors, auth, limits --------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(400, f"invalid request: {loc}: {first.get('msg', str(e))}", "BadRequestError", loc)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if settings.api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "AuthenticationError")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return _error(413, f"request body of {length} bytes is over the limit of {settings.max_body_bytes}",
                          "BadRequestError")
        return await call_next(request)

    # ---- helpers ---------------------------------------------------------------------------------
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

    def check_limits(n: int, max_tokens: int | None) -> None:
        if not 1 <= n <= settings.max_n:
            raise APIError(400, f"n must be between 1 and {settings.max_n}, got {n}", param="n")
        limit = settings.max_tokens_limit or max_len
        if max_tokens is not None and not 1 <= max_tokens <= limit:
            raise APIError(400, f"max_tokens must be between 1 and {limit}, got {max_tokens}", param="max_tokens")

    def make_params(req, max_tokens, logprobs, prompt_logprobs) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
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

    async def collect(streams, raw: Request) -> list[list[Update]]:
        """All updates of every stream; a client that disconnects aborts its requests."""
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
        return out

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def completion_logprobs(updates: list[Update], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for u in updates:
            for tid, d in zip(u.token_ids, u.logprobs):
                s = token_str(tid)
                tokens.append(s)
                lps.append(d.get(tid))
                tops.append({token_str(t): lp for t, lp in d.items()})
                offsets.append(offset)
                offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(updates: list[Update], k: int) -> dict:
        content = []
        for u in updates:
            for tid, d in zip(u.token_ids, u.logprobs):
                s = token_str(tid)
                top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
                content.append({"token": s, "logprob": d.get(tid), "bytes": list(s.encode()),
                                "top_logprobs": [{"token": token_str(t), "logprob": lp, "bytes": list(token_str(t).encode())}
                                                 for t, lp in top]})
        return {"content": content}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # ---- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [{"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "moelora",
                 "root": settings.model_path, "parent": None, "max_model_len": max_len}]
        reg = engine.engine.registry
        for name in engine.engine.list_adapters():
            data.append({"id": name, "object": "model", "created": created, "owned_by": "moelora",
                         "root": reg.path(name), "parent": settings.served_model_name})
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(req: LoadAdapterRequest):
        path = os.path.realpath(req.lora_path)
        if settings.lora_roots:
            roots = [os.path.realpath(r) for r in settings.lora_roots]
            if not any(os.path.commonpath([path, r]) == r for r in roots):
                raise APIError(400, f"lora_path {req.lora_path!r} is not under an allowed --lora-root {settings.lora_roots}",
                               param="lora_path")
        if req.lora_name == settings.served_model_name or ":" in req.lora_name:
            raise APIError(400, f"lora_name {req.lora_name!r} is reserved or contains ':'", param="lora_name")
        try:
            await engine.load_adapter(req.lora_name, path)
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
        adapter = resolve_adapter(req.model)
        check_limits(req.n, req.max_tokens)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        lp = req.logprobs
        params = make_params(req, req.max_tokens, lp, lp if (req.echo and lp is not None) else None)
        t0 = time.monotonic()
        streams = await submit_all(prompts, params, req.n, adapter, "cmpl")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_texts = [p if isinstance(p, str) else (tok.decode(p) if tok else "") for p in prompts]

        def chunk(choices, usage_=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": choices, "usage": usage_}

        if req.stream:
            async def events():
                sent_echo, out_tokens, prompt_tokens = set(), 0, {}
                async for i, u in merged(streams):
                    text = u.text
                    if req.echo and i not in sent_echo:
                        sent_echo.add(i)
                        text = prompt_texts[i // req.n] + text
                    out_tokens += len(u.token_ids)
                    prompt_tokens[i // req.n] = u.num_prompt_tokens
                    lps = completion_logprobs([u], 0) if lp is not None else None
                    if text or u.finished or lps:
                        yield sse(chunk([{"index": i, "text": text, "logprobs": lps,
                                          "finish_reason": u.finish_reason if u.finished else None}]))
                    if u.finished:
                        record(adapter, t0, u, "error" if u.error else (u.finish_reason or "stop"))
                if req.include_usage:
                    yield sse(chunk([], usage(sum(prompt_tokens.values()), out_tokens)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        per_choice = await collect(streams, raw)
        choices, n_prompt, n_out = [], {}, 0
        for i, ups in enumerate(per_choice):
            final = ups[-1]
            if final.error:
                raise APIError(500, final.error, "InternalServerError")
            record(adapter, t0, final, final.finish_reason or "stop")
            text = "".join(u.text for u in ups)
            echo = prompt_texts[i // req.n] if req.echo else ""
            n_prompt[i // req.n] = final.num_prompt_tokens
            n_out += final.num_output_tokens
            choices.append({"index": i, "text": echo + text,
                            "logprobs": completion_logprobs(ups, len(echo)) if lp is not None else None,
                            "finish_reason": final.finish_reason})
        return chunk(choices, usage(sum(n_prompt.values()), n_out))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        adapter = resolve_adapter(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        check_limits(req.n, max_tokens)
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
        try:
            prompt = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # a missing template or one that rejects these messages
            raise APIError(400, f"chat template: {e}", param="messages") from None
        k = req.top_logprobs or 0
        params = make_params(req, max_tokens, k if req.logprobs else None, None)
        t0 = time.monotonic()
        streams = await submit_all([prompt], params, req.n, adapter, "chat")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices, usage_=None, obj="chat.completion.chunk"):
            return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices, "usage": usage_}

        if req.stream:
            async def events():
                started, out_tokens, n_prompt = set(), 0, 0
                async for i, u in merged(streams):
                    if i not in started:
                        started.add(i)
                        yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))
                    out_tokens += len(u.token_ids)
                    n_prompt = u.num_prompt_tokens
                    lps = chat_logprobs([u], k) if req.logprobs else None
                    if u.text or lps:
                        yield sse(chunk([{"index": i, "delta": {"content": u.text}, "logprobs": lps, "finish_reason": None}]))
                    if u.finished:
                        record(adapter, t0, u, "error" if u.error else (u.finish_reason or "stop"))
                        yield sse(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": u.finish_reason}]))
                if req.include_usage:
                    yield sse(chunk([], usage(n_prompt, out_tokens)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        per_choice = await collect(streams, raw)
        choices, n_out, n_prompt = [], 0, 0
        for i, ups in enumerate(per_choice):
            final = ups[-1]
            if final.error:
                raise APIError(500, final.error, "InternalServerError")
            record(adapter, t0, final, final.finish_reason or "stop")
            n_prompt, n_out = final.num_prompt_tokens, n_out + final.num_output_tokens
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(u.text for u in ups)},
                            "logprobs": chat_logprobs(ups, k) if req.logprobs else None,
                            "finish_reason": final.finish_reason})
        return chunk(choices, usage(n_prompt, n_out), obj="chat.completion")

    return app
