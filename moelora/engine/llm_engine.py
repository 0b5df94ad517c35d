"""The engine: requests in, one scheduled model step at a time, tokens and text out."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from functools import partial

import torch

from moelora.adapters.registry import AdapterRegistry
from moelora.adapters.slots import SlotPool
from moelora.config import ModelConfig
from moelora.distributed import ParallelState, check_launch, kv_cache_config
from moelora.engine.async_step import PLACEHOLDER, PendingStep, can_defer, launch_sampling, schedule_ahead
from moelora.engine.cpu_threads import configure_cpu_threads, host_processes
from moelora.engine.kv_cache import KVCache
from moelora.engine.memory import kv_blocks, memory_baseline
from moelora.engine.model_runner import ModelRunner, StepOutput, graph_settings
from moelora.engine.prefix_cache import BASE_IDENTITY, adapter_identity
from moelora.engine.request import Request
from moelora.engine.sampler import (Sampler, apply_logit_bias, apply_penalties, fused_sampler_min_rows, make_generator,
                                    prompt_logprobs)
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.scheduler import Scheduler
from moelora.engine.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from moelora.engine.warmup import warm_up
from moelora.engine.workers import WorkerGroup, build_sharded_model, engine_dtype
from moelora.kernels._triton import DeviceError
from moelora.kernels.config import KernelConfig
from moelora.kernels.streams import make_side_stream
from moelora.layers.configure import configure_kernels


@dataclass
class EngineArgs:
    """Engine settings (names as in vLLM). None means: derive a sensible default."""

    model: str
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    dtype: str | None = None  # None: float32 on the CPU, the checkpoint's dtype on a GPU
    device: str | None = None  # None: "cuda" when a GPU is present, else "cpu"
    block_size: int = 16
    max_model_len: int | None = None  # None: the config's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None  # None: 256 MiB on the CPU; on a GPU what the memory plan leaves
    gpu_memory_utilization: float = 0.9  # GPU: weights + slots + activations + graph pool + KV cache within this share
    load_format: str = "auto"  # "auto" | "dummy"
    quantization: str | None = None  # None (the checkpoint's) | "fp8" (block-scaled W8A8) | "nvfp4" (weight-only)
    seed: int = 0
    show_progress: bool = False  # a progress bar while loading weights
    enforce_eager: bool = False  # no CUDA graphs (they are used on a GPU for bf16/fp16 decode steps)
    max_graph_batch_size: int = 64  # the largest decode batch a CUDA graph is captured for
    # the largest prefill / mixed step (tokens) captured as CUDA graphs, in buckets of 32..512 tokens (0: none);
    # single GPU, attention with device metadata (not MLA). Off until the whole GPU suite has passed with it on
    max_prefill_graph_tokens: int = 0
    lora_overlap: bool = True  # GPU: routed-expert LoRA chains and shared experts on a side stream
    tensor_parallel_size: int = 1  # ranks splitting attention heads, dense layers, vocabulary and expert widths
    expert_parallel_size: int = 1  # ranks splitting the routed experts (world = tensor x expert parallel size)
    # schedule and launch the next decode step before reading this step's tokens (engine/async_step.py); single
    # rank only. None: on for a CUDA device (measured faster on the H200 in every case), off on the CPU
    async_scheduling: bool | None = None
    cpu_threads: int | None = None  # CPU: torch's intra-op threads; None: engine/cpu_threads.py's rule
    enable_prefix_caching: bool = True  # reuse computed prompt prefixes, keyed by adapter content (prefix_cache.py)
    kernel_warmup: bool = True  # GPU: warm up the eager step at start-up (engine/warmup.py): serving builds no kernel
    kernel_config: KernelConfig | None = None  # kernels/config.py's choices (--kernel-config); None: the defaults


def resolve_async_scheduling(requested: bool | None, device: torch.device) -> bool:
    """EngineArgs.async_scheduling: True/False as given; None: on for a CUDA device only."""
    return bool(requested) if requested is not None else device.type == "cuda"


class LLMEngine:
    def __init__(self, args: EngineArgs, adapters: dict[str, str] | None = None) -> None:
        # the kernel config, read once, here: the model (and a parallel engine's workers) get this very object
        self.kernel_config = args.kernel_config or KernelConfig()
        self.args = args = dataclasses.replace(args, kernel_config=self.kernel_config)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise DeviceError("device='cuda' requested but torch sees no GPU: use device='cpu' (--device cpu), or "
                              "install a CUDA build of torch")
        self.device = torch.device(device)
        self.cpu_threads = configure_cpu_threads(args.cpu_threads, self.device, processes=host_processes(args))
        self.config = ModelConfig.from_pretrained(args.model)
        self.max_model_len = args.max_model_len or self.config.max_position_embeddings
        self.workers = None  # tensor/expert parallel: ranks 1..N-1 (engine/workers.py); this process is rank 0
        ps = ParallelState()
        check_launch(args.tensor_parallel_size, args.expert_parallel_size)  # under torchrun: WORLD_SIZE = tp x ep
        if args.tensor_parallel_size * args.expert_parallel_size > 1:
            self.workers = WorkerGroup(args)
            ps = self.workers.state
        baseline = memory_baseline(args, self.device)
        self.model = build_sharded_model(self.config, args, engine_dtype(args, self.device), self.device, ps,
                                         args.show_progress)
        if self.device.type == "cuda":  # the side stream at the config's priority, before any graph records it
            make_side_stream(self.device, self.kernel_config.side_stream_priority)
        self.kv_config = kv_cache_config(self.config, ps)  # this rank's KV heads
        self.tokenizer = _maybe_tokenizer(args.model)
        self.eos_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else self.config.eos_token_ids)
        planned = self.workers is not None and self.device.type == "cuda" and args.kv_cache_memory_bytes is None
        if planned:  # every rank profiles (the forward's collectives pair up) and plans its own GPU
            self.workers.send("plan")
        num_blocks, self.memory_plan = kv_blocks(self.model, self.kv_config, args, self.max_model_len, self.device,
                                                 baseline)
        if planned:  # the KV cache of every rank holds the same blocks: the fewest any rank can afford
            num_blocks = self.workers.agree_min(num_blocks)
        self.kv = KVCache(self.kv_config, num_blocks, args.block_size, self.model.dtype, self.device)
        # the longest sequence that can run: the context, or what the whole KV cache holds if that is less (a
        # request that reaches it ends with finish_reason "length", as at max_model_len)
        self.max_context = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)
        if self.workers is not None:
            self.workers.send("init", self.kv.num_blocks)
        if args.max_loras:
            targets = self.model.lora_targets()
            self.registry: AdapterRegistry | None = AdapterRegistry(targets, args.max_lora_rank, args.max_cpu_loras)
            self.pool: SlotPool | None = SlotPool(
                targets, args.max_loras, on_change=self.workers.slot_changed if self.workers is not None else None)
        else:
            self.registry = self.pool = None
        self.scheduler = Scheduler(self.kv, self.pool, self.registry, args.max_num_seqs, args.max_num_batched_tokens)
        # parallel: the workers build their runners right after "init": their captures' collectives pair up with these
        self.runner = ModelRunner(self.model, self.kv, args.max_loras,
                                  **graph_settings(args, self.model, self.device, self.max_model_len),
                                  broadcast=partial(self.workers.send, "step") if self.workers else None,
                                  broadcast_graph=partial(self.workers.send, "graph") if self.workers else None)
        self.async_scheduling = resolve_async_scheduling(args.async_scheduling, self.device) and self.workers is None
        self.sampler = Sampler(min_rows=fused_sampler_min_rows(self.async_scheduling))
        # the workers warm up too, right after their runners
        warm_up(self.model, self.kv, args, self.max_model_len, self.sampler)
        self._pending: PendingStep | None = None  # asynchronous scheduling: a step launched, its tokens not read
        self.ahead_steps = 0  # steps launched before the previous step's tokens were read (stats and tests)
        self.last_step_prefill = False  # whether the last step() computed prompt tokens (eager, not a graph)
        self.requests: dict[str, Request] = {}
        self._arrival = itertools.count()
        for name, path in (adapters or {}).items():
            self.load_adapter(name, path)

    # ---- adapters -------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, roots: list[str] | None = None) -> None:
        """Read, validate and register a PEFT adapter folder (thread-safe: the server calls it off the engine
        thread). roots: its files (symlinks resolved) must lie under one of these folders."""
        if self.registry is None:
            raise ValueError("this engine was started with max_loras=0: no adapters can be loaded")
        self.registry.load(name, path, roots)
        if self.workers is not None:
            self.workers.send("load", name, path)

    def unload_adapter(self, name: str) -> None:
        """Refuses while requests use the adapter (abort or finish them first)."""
        if self.registry is None or name not in self.registry:
            raise KeyError(f"adapter {name!r} is not loaded; loaded: {self.list_adapters()}")
        users = [r.request_id for r in self.requests.values() if r.adapter == name and not r.finished]
        if users:
            raise RuntimeError(f"adapter {name!r} is used by {len(users)} unfinished requests ({users[:3]}...)")
        self.pool.evict(name)
        digest = self.registry.digest(name)
        self.registry.unload(name)
        if not any(self.registry.digest(n) == digest for n in self.registry.names):  # no other name shares it
            self.kv.drop_identity(adapter_identity(digest))
        if self.workers is not None:
            self.workers.send("unload", name)

    def check_workers(self) -> None:
        """Raise WorkerFailed if a worker process of a parallel engine has exited (nothing otherwise)."""
        if self.workers is not None:
            self.workers.check()

    def reconfigure(self, cfg: KernelConfig) -> None:
        """Another kernel config for the built model (a benchmark comparing configs in one process): every layer
        picks its choices again (configure_kernels), the side stream is made at the config's priority and the
        CUDA graphs are captured again (they keep the kernels and streams they recorded). One rank only."""
        if self.workers is not None:
            raise NotImplementedError("reconfigure: a tensor/expert-parallel engine's workers keep the config they "
                                      "were built with; compare configs with tp = ep = 1")
        configure_kernels(self.model, cfg)
        if self.device.type == "cuda":
            make_side_stream(self.device, cfg.side_stream_priority)
        self.kernel_config = cfg
        if self.runner.graphs is not None:
            self.runner.graphs.recapture()

    def shutdown(self) -> None:
        """Free the CUDA graphs and, for a parallel engine, stop the worker processes and leave the
        torch.distributed process group this process joined (a second parallel engine can then start here).
        Every rank frees its CUDA graphs before leaving the group (graphs that captured NCCL collectives keep
        the communicator alive). Idempotent, and safe on an engine whose __init__ stopped part way (LLM calls it
        then); the workers are stopped even if freeing the graphs fails."""
        runner, workers = getattr(self, "runner", None), getattr(self, "workers", None)
        try:
            if runner is not None:
                if getattr(self, "device", None) is not None and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # no graph still running when it is freed
                runner.release_graphs()
        finally:
            if workers is not None:
                workers.stop()

    def list_adapters(self) -> list[str]:
        return self.registry.names if self.registry else []

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    adapter: str | None = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if adapter is not None and (self.registry is None or adapter not in self.registry):
            raise ValueError(f"unknown adapter {adapter!r}; loaded adapters: {self.list_adapters()}")
        ids = self._prompt_ids(prompt)
        bad = [t for t in (params.logit_bias or {}) if t >= self.config.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids out of vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but the context holds {self.max_model_len} "
                             "(max_model_len) including at least one generated token")
        capacity = self.kv.num_blocks * self.kv.block_size
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens needs more KV blocks than the cache has "
                             f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)")
        if params.max_tokens is not None and len(ids) + params.max_tokens > capacity:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                             f"{len(ids) + params.max_tokens} tokens of KV cache, but the whole cache holds {capacity} "
                             f"({self.kv.num_blocks} blocks of {self.kv.block_size}): lower max_tokens, or give the "
                             "cache more memory (--kv-cache-memory, --gpu-memory-utilization)")
        req = Request(request_id, ids, params, adapter, next(self._arrival))
        if self.args.enable_prefix_caching:
            req.cache_identity = BASE_IDENTITY if adapter is None else adapter_identity(self.registry.digest(adapter))
        req.generator = make_generator(params.seed, self.device)
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            req.stopper = StopChecker(params.stop, params.include_stop_str_in_output)
        elif params.stop:
            raise ValueError("stop strings need a tokenizer; this model folder has none (use stop_token_ids)")
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        if req.output_ids and req.output_ids[-1] == PLACEHOLDER:  # a token still on the device: dropped
            req.output_ids.pop()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._pending is not None

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.args.model} has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that got new tokens or finished.
        With async_scheduling, a decode step's tokens stay on the device while the next step is scheduled and
        launched from them (engine/async_step.py); this call then returns the earlier step's requests."""
        self.last_step_prefill = False
        if self._pending is None:
            chunks = self.scheduler.schedule()
            failed = self.scheduler.take_failed()  # requests whose adapter could not be read: they alone end
            if not chunks:
                if self.scheduler.waiting and not self.scheduler.running:
                    failed += self._fail_unschedulable()
                return failed
            out = self._execute(chunks)
            self._record_prompt_logprobs(chunks, out)
            if not (self.async_scheduling and can_defer(out)):
                return failed + self._sample(out)
            self._pending = launch_sampling(self.sampler, out)
            if failed:
                return failed
        pending, self._pending = self._pending, None
        ahead = schedule_ahead(self.scheduler, self.kv, pending, self.max_context)
        if ahead is not None:
            out = self._execute(ahead.chunks, ahead.input_tokens)
            self.ahead_steps += 1
            self._pending = launch_sampling(self.sampler, out)  # its rows passed can_defer one step earlier
        return self._read(pending)

    def _fail_unschedulable(self) -> list[Request]:
        """Nothing runs and the first waiting request still cannot start: it can never run (add_request and
        max_context keep this from happening; kept as a guard so that such a request fails alone, with the
        reason, instead of the step failing every request)."""
        req = self.scheduler.waiting[0]
        need = self.kv.blocks_needed(req.num_tokens, 0)
        why = (f"it needs {need} KV blocks and the cache has {self.kv.num_blocks}" if need > self.kv.num_blocks
               else "no LoRA slot can be freed for its adapter" if req.adapter is not None else "no KV blocks are free")
        self.scheduler.finish(req)
        req.finish_reason, req.error = "abort", f"request {req.request_id!r} cannot be scheduled: {why}"
        return [req]

    def _execute(self, chunks: list, input_tokens: torch.Tensor | None = None) -> StepOutput:
        """Run the chunks; their tokens then count as computed, and their newly full blocks enter the prefix cache."""
        if self.workers is None:
            out = self.runner.execute(chunks, input_tokens)
        else:
            with self.workers.guard("step"):
                out = self.runner.execute(chunks)
        # a step() may run two executions (asynchronous scheduling: a step, then the next one launched ahead)
        self.last_step_prefill = self.last_step_prefill or any(c.num_tokens > 1 for c in chunks)
        for c in chunks:
            c.request.num_computed += c.num_tokens
            self.scheduler.register_blocks(c.request)
        return out

    def _read(self, pending: PendingStep) -> list[Request]:
        """The tokens of a step launched earlier: placeholders replaced, stop checks; requests finished (or
        aborted) while it ran are skipped (their rows were computed for nothing)."""
        now = time.monotonic()
        reqs = []
        for req, t in pending.read():
            if req.finished:  # stopped on the step before, or aborted: this row was computed for nothing
                continue
            if req.output_ids and req.output_ids[-1] == PLACEHOLDER:
                req.output_ids[-1] = t  # scheduled ahead on this token: its placeholder
                self.scheduler.register_blocks(req)  # a block that held the placeholder is full of known tokens
            else:
                req.output_ids.append(t)
            req.first_token_time = req.first_token_time or now
            self._check_stop(req, t)
            reqs.append(req)
        return reqs

    def _record_prompt_logprobs(self, chunks, out: StepOutput) -> None:
        """Row j of a chunk starting at s predicts prompt position s + j + 1; positions already recorded
        (a prefill recomputed after preemption) are kept as they are."""
        for i, logits in out.prompt_logits.items():
            c = chunks[i]
            req, s, P = c.request, c.start, len(c.request.prompt_ids)
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # nothing predicts position 0
            first, last = len(req.prompt_logprobs), min(s + c.num_tokens, P - 1)
            if first < s + 1 or first > last:
                continue
            ids = req.prompt_ids[first - 1 : last + 1]
            for e in prompt_logprobs(logits[first - 1 - s : last - s], ids, req.params.prompt_logprobs)[1:]:
                d = dict(e["top"])
                d[e["token_id"]] = e["logprob"]
                req.prompt_logprobs.append(d)

    def _sample(self, out: StepOutput) -> list[Request]:
        if not out.sampled:
            return []
        reqs = [c.request for c in out.sampled]
        params = [r.params for r in reqs]
        logits = apply_logit_bias(out.sample_logits, params)
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(logits, [r.prompt_ids for r in reqs], [r.output_ids for r in reqs], params)
        res = self.sampler.sample(logits, params, [r.generator for r in reqs])
        now = time.monotonic()
        for i, req in enumerate(reqs):
            t = res.token_ids[i]
            req.output_ids.append(t)
            req.first_token_time = req.first_token_time or now
            if req.params.logprobs is not None:
                d = dict(res.top_logprobs[i] or [])
                d[t] = res.logprobs[i]
                req.logprobs.append(d)
            self._check_stop(req, t)
        return reqs

    def _check_stop(self, req: Request, t: int) -> None:
        p = req.params
        reason = None
        if (not p.ignore_eos and t in self.eos_ids) or t in p.stop_token_ids:
            reason, req.stop_reason = "stop", t
        if req.detok is not None:
            delta = req.detok.add_token(t) if reason is None else ""
            req.text += req.stopper.update(delta)
            if reason is None and req.stopper.stopped:
                reason, req.stop_reason = "stop", req.stopper.stop_str
        if reason is None and ((p.max_tokens is not None and len(req.output_ids) >= p.max_tokens)
                               or req.num_tokens >= self.max_context):
            reason = "length"
        if reason is None:
            return
        if req.detok is not None and not req.stopper.stopped:
            req.text += req.stopper.update(req.detok.flush())
            req.text += req.stopper.flush()
        req.finish_reason = reason
        self.scheduler.finish(req)


def _maybe_tokenizer(path: str) -> Tokenizer | None:
    has = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return Tokenizer(path) if has else None
