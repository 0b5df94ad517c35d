"""The engine loop in a background thread, fed by asyncio callers.

Every engine mutation (adding, aborting, unloading) runs on the engine thread, between steps, as a
command; HTTP handlers await futures and read per-request queues of updates. Adapter files are read
and validated off the engine thread (the registry is thread-safe), so loading never stalls decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moelora.engine.llm_engine import LLMEngine
from moelora.engine.request import Request
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.workers import WorkerFailed
from moelora.kernels._triton import kernel_builds, track_kernel_builds

log = logging.getLogger("moelora.server")


class AdapterNotFound(KeyError):
    pass


@dataclass
class Update:
    """What one engine step produced for one request (deltas since the previous update)."""

    text: str = ""  # new text (after stop-string handling)
    token_ids: list[int] = field(default_factory=list)  # new tokens
    logprobs: list[dict[int, float]] = field(default_factory=list)  # for the new tokens, when asked
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)  # on the final update, and with prompt_logprobs
    prompt_logprobs: list | None = None  # when asked: on the first update after the prefill, and on the final
    error: str | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    text_sent: int = 0
    tokens_sent: int = 0
    prompt_sent: bool = False  # its prompt logprobs went out (on the first update that has them all)


class RequestStream:
    """Updates of one request, in order; the last has finished=True. abort() (or leaving early) frees it."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.finished = False

    async def __aiter__(self):
        try:
            while not self.finished:
                upd = await self._stream.queue.get()
                self.finished = upd.finished
                yield upd
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        track_kernel_builds()  # from here on (the engine built, its graphs captured): moelora_triton_kernel_builds
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._draining: dict[str, concurrent.futures.Future] = {}  # adapter being unloaded -> its unload's result
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="moelora-engine", daemon=True)
        self.on_step: Callable[[int, float, bool], None] | None = None  # metrics: (updated, seconds, prefill)
        # a failure that ends serving (a tensor/expert-parallel worker died): its message, and the server's hook
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.num_cancelled = 0  # requests aborted before they finished (client gone, shutdown)
        self.num_failed = 0  # requests ended by an error (their adapter's files, or a failed engine step)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests for up to `timeout` seconds, then abort what is left and stop."""
        if not self._thread.is_alive():  # never started, or ended by a fatal error (requests already ended)
            self._stop = True
            return
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        self.call(self._abort_all).result(timeout=10)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- commands -------------------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[], object]):
        return await asyncio.wrap_future(self.call(fn))

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     adapter: str | None) -> "RequestStream":
        """Add a request (raising the engine's ValueError or AdapterNotFound for bad input) and return
        the stream of its updates."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            if adapter is not None and adapter in self._draining:
                raise AdapterNotFound(f"adapter {adapter!r} is being unloaded")
            self.engine.add_request(request_id, prompt, params, adapter)
            self._streams[request_id] = stream

        await self.run(add)
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self.call(lambda: self._abort(request_id))

    async def load_adapter(self, name: str, path: str, roots: list[str] | None = None) -> None:
        """Read and register an adapter off the engine thread. roots: its files must resolve under one of these
        folders (--lora-root), now and whenever they are read again."""
        if name in self._draining:
            raise ValueError(f"adapter {name!r} is being unloaded; load it again once that is done")
        await asyncio.to_thread(self.engine.load_adapter, name, path, roots)

    async def unload_adapter(self, name: str) -> None:
        """Refuses new requests for the adapter at once; unloads once the requests using it finish."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            if name not in self.engine.list_adapters() or name in self._draining:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
            self._draining[name] = fut
            self._finish_unloads()

        await self.run(start)
        await asyncio.wrap_future(fut)

    # ---- stats (read from other threads; plain ints) -------------------------------------------
    def stats(self) -> dict[str, int]:
        e = self.engine
        resident = e.pool.resident if e.pool else {}
        return {
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "kv_blocks_total": e.kv.num_blocks,
            "kv_blocks_free": e.kv.num_free_blocks,
            "lora_slots_total": e.args.max_loras,
            "lora_slots_used": len(resident),
            "lora_slots_in_use": sum(1 for n in resident if e.pool.refcount(n) > 0),
            "adapters_loaded": len(e.list_adapters()),
            "kv_blocks_free_min": e.kv.min_free,
            "prefix_cache_blocks": e.kv.num_cached_blocks,
        }

    def counters(self) -> dict[str, int]:
        """Totals since start (monotonic; read from other threads): requests cancelled and failed, preemptions,
        adapter loads from files, reads again after leaving host memory, failed reads, unloads, writes into a
        LoRA slot (swaps), evictions from a slot and from host memory."""
        e = self.engine
        reg = e.registry.counters if e.registry is not None else {}
        pool = e.pool.counters if e.pool is not None else {}
        return {
            "requests_cancelled": self.num_cancelled,
            "requests_failed": self.num_failed,
            "preemptions": e.scheduler.num_preemptions,
            "adapter_loads": reg.get("loads", 0),
            "adapter_reloads": reg.get("reloads", 0),
            "adapter_load_failures": reg.get("load_failures", 0),
            "adapter_unloads": reg.get("unloads", 0),
            "adapter_slot_loads": pool.get("slot_loads", 0),
            "adapter_slot_evictions": pool.get("slot_evictions", 0),
            "adapter_cpu_evictions": reg.get("cpu_evictions", 0),
            "prefix_cache_queries": e.scheduler.prefix_queries,
            "prefix_cache_hits": e.scheduler.prefix_hits,
            "prefix_cache_evictions": e.kv.evictions,
            "triton_kernel_builds": kernel_builds(),
        }

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._run_commands()
            try:
                if not self.engine.has_unfinished_requests():
                    self.engine.check_workers()  # a worker that dies while the server idles is seen here
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                updated = self.engine.step()
                seconds = time.perf_counter() - t0
            except WorkerFailed as e:  # the model is gone: end every request, stop the engine and the server
                self._fatal(str(e))
                return
            except Exception as e:  # a bug: fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._abort_all(f"internal error in the engine step: {e}")
                continue
            if self.on_step is not None:
                self.on_step(len(updated), seconds, self.engine.last_step_prefill)
            for req in updated:
                self._publish(req)
            if self._draining:
                self._finish_unloads()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the awaiting caller
                    fut.set_exception(e)

    def _publish(self, req: Request) -> None:
        s = self._streams.get(req.request_id)
        if s is None:
            return
        upd = Update(text=req.text[s.text_sent:], token_ids=req.output_ids[s.tokens_sent:],
                     logprobs=req.logprobs[s.tokens_sent:] if req.params.logprobs is not None else [],
                     finished=req.finished, finish_reason=req.finish_reason, num_prompt_tokens=len(req.prompt_ids),
                     num_output_tokens=len(req.output_ids), first_token_time=req.first_token_time, error=req.error,
                     num_cached_tokens=req.num_cached_tokens)
        if req.error is not None:
            self.num_failed += 1
            log.warning("request %s failed: %s", req.request_id, req.error)
        s.text_sent, s.tokens_sent = len(req.text), len(req.output_ids)
        wants_prompt = req.params.prompt_logprobs is not None
        if req.finished or (wants_prompt and not s.prompt_sent and len(req.prompt_logprobs) >= len(req.prompt_ids)):
            upd.prompt_ids = list(req.prompt_ids)
            upd.prompt_logprobs = list(req.prompt_logprobs) if wants_prompt else None
            s.prompt_sent = s.prompt_sent or wants_prompt
        if req.finished:
            del self._streams[req.request_id]
            self.engine.pop_finished(req.request_id)
        s.loop.call_soon_threadsafe(s.queue.put_nowait, upd)

    def _abort(self, request_id: str, cancelled: bool = True) -> None:
        self._streams.pop(request_id, None)
        if request_id in self.engine.requests:
            if cancelled and not self.engine.requests[request_id].finished:
                self.num_cancelled += 1
            self.engine.abort_request(request_id)
            self.engine.pop_finished(request_id)
        if self._draining:
            self._finish_unloads()

    def _fatal(self, message: str) -> None:
        log.error("moelora: %s", message)
        self.fatal_error = message
        self._abort_all(message)
        self._stop = True
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _abort_all(self, error: str | None = None) -> None:
        """End every request in flight (shutdown, or an engine failure when `error` says what happened)."""
        for rid in list(self._streams):
            s = self._streams[rid]
            s.loop.call_soon_threadsafe(s.queue.put_nowait, Update(finished=True, finish_reason="abort", error=error))
            if error is not None:
                self.num_failed += 1
            self._abort(rid, cancelled=error is None)

    def _finish_unloads(self) -> None:
        for name in list(self._draining):
            if any(r.adapter == name and not r.finished for r in self.engine.requests.values()):  # still in use
                continue
            fut = self._draining.pop(name)
            try:
                self.engine.unload_adapter(name)
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)
