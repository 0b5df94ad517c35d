"""The GPU memory plan's arithmetic and its error; a base-only batch does no LoRA work (CPU, eager)."""

from types import SimpleNamespace

import pytest
import torch

from moelora import SamplingParams
from moelora.demo import adapter_paths, make_prompt, model_path
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine import memory
from moelora.engine.memory import GIB, GPUMemoryError, plan_kv_blocks
from moelora.layers.lora import lora_work_count

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_gives_the_kv_cache_what_is_left():
    plan = plan_kv_blocks(total=80 * GIB, used=60 * GIB, activations=2 * GIB, graph_reserve=GIB // 2,
                          utilization=0.9, per_block=2 << 20, cap=10**9)
    left = int(0.9 * 80 * GIB) - 60 * GIB - 2 * GIB - GIB // 2
    assert plan.num_blocks == left // (2 << 20) and plan.kv_bytes == plan.num_blocks * (2 << 20)
    assert plan.used + plan.activations + plan.graph_reserve + plan.kv_bytes <= plan.budget
    capped = plan_kv_blocks(80 * GIB, 60 * GIB, 2 * GIB, GIB // 2, 0.9, 2 << 20, cap=100)
    assert capped.num_blocks == 100


def test_plan_error_names_every_part():
    with pytest.raises(RuntimeError) as e:
        plan_kv_blocks(total=80 * GIB, used=70 * GIB, activations=3 * GIB, graph_reserve=GIB,
                       utilization=0.9, per_block=2 << 20, cap=10**9)
    msg = str(e.value)
    for part in ("gpu_memory_utilization 0.9", "72.00 GiB", "70.00 GiB", "activations", "3.00 GiB",
                 "CUDA-graph pool", "--gpu-memory-utilization", "--max-num-batched-tokens"):
        assert part in msg, part
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_blocks(80 * GIB, 0, 0, 0, 1.5, 1, 10)


def test_the_budget_is_this_engines_as_vllms(monkeypatch):
    """Two servers on one 80 GiB GPU at 0.45 each: the second starts with the first's 36 GiB in use (its baseline).
    Its budget is its own 36 GiB, not 36 less the first's."""
    monkeypatch.setattr(memory.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(memory.torch.cuda, "mem_get_info", lambda device=None: (80 * GIB - 36 * GIB, 80 * GIB))
    args = SimpleNamespace(kv_cache_memory_bytes=None)
    assert memory.memory_baseline(args, torch.device("cuda")) == 36 * GIB
    assert memory.memory_baseline(args, torch.device("cpu")) == 0  # no plan there: nothing read
    args.kv_cache_memory_bytes = 1 << 30
    assert memory.memory_baseline(args, torch.device("cuda")) == 0
    # its weights (31 GiB) then in use: used is its own growth, and the KV cache gets its budget's rest
    plan = plan_kv_blocks(80 * GIB, used=31 * GIB, activations=GIB, graph_reserve=0, utilization=0.45,
                          per_block=GIB // 4, cap=10**9, baseline=36 * GIB, free=80 * GIB - 36 * GIB - 31 * GIB)
    assert plan.num_blocks == (int(0.45 * 80 * GIB) - 31 * GIB - GIB) // (GIB // 4) > 0
    assert plan.baseline == 36 * GIB and plan.as_gib()["baseline"] == 36.0
    # the old rule (everything in use on the device counted against the budget) left this server nothing
    with pytest.raises(GPUMemoryError):
        plan_kv_blocks(80 * GIB, used=36 * GIB + 31 * GIB, activations=GIB, graph_reserve=0, utilization=0.45,
                       per_block=GIB // 4, cap=10**9)


def test_another_process_taking_memory_after_the_baseline_bounds_the_kv_cache():
    """Within the budget but beyond what is free now (another process started since): the free memory decides,
    less the activations and the graph pool; the error names the memory in use before the engine started."""
    plan = plan_kv_blocks(80 * GIB, used=30 * GIB, activations=GIB, graph_reserve=GIB, utilization=0.9,
                          per_block=GIB, cap=10**9, baseline=GIB, free=12 * GIB)
    assert plan.num_blocks == 10
    with pytest.raises(GPUMemoryError, match=r"besides the 1.00 GiB in use before this engine started"):
        plan_kv_blocks(80 * GIB, used=30 * GIB, activations=GIB, graph_reserve=GIB, utilization=0.9,
                       per_block=GIB, cap=10**9, baseline=GIB, free=2 * GIB)


def test_base_only_steps_do_no_lora_work_with_adapters_loaded():
    eng = LLMEngine(EngineArgs(model=model_path(), max_loras=4), adapter_paths())
    params = SamplingParams(max_tokens=6, temperature=0.0)
    eng.add_request("base", make_prompt("hello world"), params, None)
    before = lora_work_count()
    while eng.has_unfinished_requests():
        eng.step()
    assert lora_work_count() == before  # prefill and decode of a base-only batch: no LoRA computation
    eng.add_request("lora", make_prompt("hello world"), params, "rot13")
    while eng.has_unfinished_requests():
        eng.step()
    assert lora_work_count() > before  # the counter does count: an adapter's batch runs LoRA layers
