"""The offline API: LLM(...).generate(prompts, SamplingParams, adapter=...)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence

from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.outputs import CompletionOutput, RequestOutput
from moelora.engine.sampling_params import SamplingParams
from moelora.models.weights import progress_bar

log = logging.getLogger(__name__)


class LLM:
    """One MoE model with many LoRA adapters, for offline batched generation.

        llm = LLM(model="path", adapters={"name": "path/to/adapter"}, max_loras=8, max_lora_rank=64)
        outs = llm.generate(["a", "b"], SamplingParams(max_tokens=8), adapter=["name", None])

    Every keyword of EngineArgs is accepted (block_size, max_num_seqs, max_model_len, load_format, ...);
    tensor_parallel_size / expert_parallel_size > 1 start one worker process per extra rank. Under torchrun
    (WORLD_SIZE = tp x ep) nothing is started: rank 0 builds the LLM and ranks 1..N-1 call
    moelora.engine.workers.run_worker(EngineArgs(model, ...same keywords...)).

    Lifetime: `shutdown()`, the end of a `with LLM(...) as llm:` block, or the LLM's garbage collection release
    everything it holds: the CUDA graphs, the worker processes, the torch.distributed process group this
    process joined (so another parallel LLM can start in the same process), and the engine (model, KV cache).
    A constructor that fails part way releases what it had started. Afterwards every method raises
    "this LLM was shut down"."""

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **kwargs) -> None:
        self._engine: LLMEngine | None = None
        self._ids = itertools.count()
        engine = LLMEngine.__new__(LLMEngine)  # kept by hand, so a constructor failing part way can be released
        try:
            engine.__init__(EngineArgs(model=model, **kwargs), adapters)
        except BaseException:
            _release(engine)  # e.g. an adapter that does not load after the workers and process group started
            raise
        self._engine = engine
        # on garbage collection (and at interpreter exit) the engine is released; the finalizer holds the engine,
        # never the LLM, so it does not keep the LLM alive
        self._finalizer = weakref.finalize(self, _release, engine)
        if engine.workers is not None:
            engine.workers.on_exit = self._finalizer  # at exit: graphs freed before the group is left

    def shutdown(self) -> None:
        """Release what the LLM holds (see Lifetime above; the model and KV cache once nothing else references the
        engine). Idempotent: a second call does nothing."""
        finalizer = getattr(self, "_finalizer", None)
        self._engine = None
        if finalizer is not None:
            finalizer()  # runs _release(engine) the first time only, then drops its reference to the engine

    def __enter__(self) -> LLM:
        self.engine  # noqa: B018 - raises if already shut down
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down (shutdown(), the end of its `with` block): create a new LLM")
        return self._engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str) -> None:
        self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def list_adapters(self) -> list[str]:
        return self.engine.list_adapters()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: strings or lists of token ids (one prompt alone is accepted too).
        sampling_params, adapter: one for all prompts, or one per prompt (adapter None = base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        adapters = _per_prompt(adapter, len(prompts), "adapter")
        groups: list[tuple[RequestOutput, list[str]]] = []
        added: list[str] = []
        try:
            for prompt, p, a in zip(prompts, params, adapters):
                base_id = f"gen-{next(self._ids)}"
                ids = []
                for k in range(p.n):
                    sub = p if p.n == 1 else dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + k)
                    rid = f"{base_id}-{k}"
                    req = self.engine.add_request(rid, prompt, sub, a)
                    ids.append(rid)
                    added.append(rid)
                groups.append((RequestOutput(base_id, prompt if isinstance(prompt, str) else None,
                                             req.prompt_ids, a), ids))
        except Exception:
            for rid in added:  # leave the engine as it was
                self.engine.abort_request(rid)
                self.engine.pop_finished(rid)
            raise
        bar = progress_bar(None, len(added), "generate", "req") if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for req in self.engine.step():
                if req.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for out, ids in groups:
            reqs = [self.engine.pop_finished(rid) for rid in ids]
            out.outputs = [CompletionOutput(index=k, text=r.text, token_ids=list(r.output_ids),
                                            finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                                            logprobs=r.logprobs if r.params.logprobs is not None else None)
                           for k, r in enumerate(reqs)]
            out.prompt_logprobs = reqs[0].prompt_logprobs if reqs[0].params.prompt_logprobs is not None else None
            out.finished = True
            results.append(out)
        return results


def _release(engine: LLMEngine) -> None:
    """LLMEngine.shutdown that never raises (it runs from a finalizer, at interpreter exit, or while a failed
    constructor's error propagates)."""
    try:
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - releasing anyway; nothing the caller can do
        log.warning("moelora: shutting the engine down: %s: %s", type(e).__name__, e)


def _per_prompt(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what}: got {len(value)} values for {n} prompts (give one, or one per prompt)")
        return list(value)
    return [value] * n
