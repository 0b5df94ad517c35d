"""CUDA-graph decode equals eager execution for mixed adapters, padding and long generations (GPU only)."""

import random

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, TRANSFORMS, adapter_paths, make_prompt, model_path, random_input
from moelora.kernels.config import KernelConfig
from moelora.kernels.quant.split_k_triton import _COUNTERS

pytestmark = pytest.mark.gpu


def _llm(eager: bool, **kw) -> LLM:
    return LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cuda", dtype="bfloat16",
               enforce_eager=eager, max_num_seqs=64, **kw)


def test_graph_replay_equals_eager_mixed_adapters():
    rng = random.Random("graphs")
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(12)]
    rng.shuffle(rows)  # 48 requests: the batch shrinks as they finish (buckets and padding rows change)
    prompts, names = [make_prompt(t) for _, t in rows], [n for n, _ in rows]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    eager = _llm(True).generate(prompts, params, adapter=names)
    graph_llm = _llm(False)
    graphs = graph_llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs
    out = graph_llm.generate(prompts, params, adapter=names)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    assert sum(o.text == TRANSFORMS[n](t) for o, (n, t) in zip(out, rows)) >= 0.98 * len(rows)
    assert sum(v for (bs, lora), v in graphs.replays.items() if lora) > 10  # the LoRA graphs really ran
    # a base-only batch replays the no-LoRA graphs
    before = sum(v for (bs, lora), v in graphs.replays.items() if not lora)
    graph_llm.generate([make_prompt("abc def")] * 3, params)
    assert sum(v for (bs, lora), v in graphs.replays.items() if not lora) > before
    # the split-KV decode attention's (row, KV head) arrival counters: made, and left at 0 by every launch
    counters = list(_COUNTERS.values())
    assert counters and not any(c.any() for c in counters)


@pytest.fixture
def same_kernels_as_graphs():
    """Eager runs the kernels a graph runs (no cuBLAS single-adapter path) with no split-K atomics, so the two
    can be compared token for token over hundreds of tokens, past the demo's answers (where the trained model's
    next-token choices are near-ties that bf16 rounding differences would flip)."""
    return KernelConfig.from_dict({"dense_lora": {"single_slot": False}})


def test_long_generation_replay_equals_eager(same_kernels_as_graphs):
    """Many replays in a row (the graph-replay bug class that shows after ~100 tokens)."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    prompts = [make_prompt("hello world"), make_prompt("graphs replay")]
    names = ["rot13", None]  # two sequences: the graph bucket (2) is the eager batch size
    eager = _llm(True, kernel_config=same_kernels_as_graphs).generate(prompts, params, adapter=names)
    graph = _llm(False, kernel_config=same_kernels_as_graphs).generate(prompts, params, adapter=names)
    assert [o.token_ids for o in graph] == [o.token_ids for o in eager]
    assert all(len(o.token_ids) == 200 for o in graph)
    assert torch.cuda.is_available()


def test_async_scheduling_replays_equal_the_synchronous_engine(same_kernels_as_graphs):
    """Asynchronous scheduling on the GPU: each step's graph replay takes the last step's tokens from the device
    (StepGraphs.run(input_tokens=...)) before the host has read them. 40 requests, mixed adapters, greedy and
    seeded sampled rows, each ending at its own length or on EOS: the tokens, texts and finish reasons are the
    synchronous engine's (same graphs, same kernels), and most steps were scheduled ahead."""
    rng = random.Random("async-graphs")
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(10)]
    rng.shuffle(rows)
    prompts, names = [make_prompt(t) for _, t in rows], [n for n, _ in rows]
    params = [SamplingParams(max_tokens=rng.randint(4, 48), temperature=0.0 if i % 4 else 0.8,
                             seed=None if i % 4 else 1000 + i, ignore_eos=i % 3 == 0) for i in range(len(rows))]
    sync = _llm(False, async_scheduling=False, kernel_config=same_kernels_as_graphs).generate(prompts, params,
                                                                                               adapter=names)
    llm = _llm(False, async_scheduling=True, kernel_config=same_kernels_as_graphs)
    out = llm.generate(prompts, params, adapter=names)
    engine = llm.engine
    assert engine.ahead_steps > 20, f"only {engine.ahead_steps} steps were scheduled ahead"
    assert sum(v for (bs, lora), v in engine.runner.graphs.replays.items() if lora) > 10
    assert [o.token_ids for o in out] == [o.token_ids for o in sync]
    assert [o.text for o in out] == [o.text for o in sync]
    assert [o.finish_reason for o in out] == [o.finish_reason for o in sync]
    assert all(-1 not in o.token_ids for o in out)


def test_prefill_graph_replay_equals_eager(same_kernels_as_graphs):
    """Prefill steps up to --max-prefill-graph-tokens replay their graphs (T tokens over S sequences, padded):
    groups of requests of every adapter and the base, each group with a prompt cached by the last (suffix-only
    rows), give the eager engine's tokens (the same kernels); the LoRA and base prefill graphs ran, and 0 turns
    them off."""
    rng = random.Random("prefill-graphs")
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(6)]
    rng.shuffle(rows)
    prompts, names = [make_prompt(t) for _, t in rows], [n for n, _ in rows]
    params = SamplingParams(max_tokens=16, temperature=0.0)

    def serve(llm):
        out = []
        for i in range(0, len(rows), 3):
            out += llm.generate(prompts[i:i + 3] + prompts[:1], params, adapter=names[i:i + 3] + names[:1])
        out += llm.generate(prompts[:3], params)  # the base model's rows alone: the graphs without LoRA
        return [o.token_ids for o in out]

    eager = serve(_llm(True, kernel_config=same_kernels_as_graphs))
    llm = _llm(False, kernel_config=same_kernels_as_graphs, max_prefill_graph_tokens=512)
    assert serve(llm) == eager
    replays = {mode: n for (key, mode), n in llm.engine.runner.graphs.replays.items() if isinstance(key, tuple)}
    assert set(replays) >= {False, True} and all(replays.values()), replays
    off = _llm(False, kernel_config=same_kernels_as_graphs, max_prefill_graph_tokens=0)
    assert not off.engine.runner.graphs.prefill_buckets and serve(off) == eager
