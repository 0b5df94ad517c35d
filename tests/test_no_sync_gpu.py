"""The host never waits for the GPU while it launches a step's sampling, nor anywhere in an asynchronous decode
step but the two event waits it means to make (GPU only: torch.cuda.set_sync_debug_mode reports every stream or
device synchronisation a torch op makes, e.g. torch.tensor(list, device="cuda"), which copies with
cudaStreamSynchronize). Event waits (PendingStep.read, the kept graph inputs) are not reported: they wait for one
earlier step's work only."""

import traceback

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, adapter_paths, make_prompt, model_path
from moelora.engine.sampler import Sampler, make_generator

pytestmark = pytest.mark.gpu


def _syncs(fn) -> list[str]:
    """[] if fn made no stream or device synchronisation, else the last frames of the first one (the "error"
    mode raises at the synchronising op: its traceback names the line)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return [traceback.format_exc(limit=-5)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return []


@pytest.mark.parametrize("rows", [64, 256])  # the torch path, the fused path (from 256 rows)
def test_sample_tokens_launches_without_a_synchronisation(rows):
    logits = torch.randn(rows, 5000, device="cuda")
    plain = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7) for i in range(rows)]
    filtered = [SamplingParams(temperature=0.9, top_k=20 if i % 2 else -1, top_p=0.9, min_p=0.05)
                for i in range(rows)]
    seeded = [SamplingParams(temperature=0.8, seed=i if i % 2 else None) for i in range(rows)]
    sampler = Sampler()
    for params in (plain, filtered, seeded):
        gens = [make_generator(p.seed, "cuda") for p in params]
        sampler.sample_tokens(logits, params, gens)  # compiled / warmed outside the check
        found = _syncs(lambda: sampler.sample_tokens(logits, params, gens))
        assert found == [], f"{sampler.last_path}: {found[0]}"
    sampler.sample_tokens(logits, plain, [None] * rows)
    assert sampler.last_path == ("fused" if rows >= 256 else "torch")


def test_an_asynchronous_decode_step_waits_for_no_stream():
    """Steps of a steady asynchronous decode (graphs, mixed adapters): scheduling, the graph inputs, the replay
    from device tokens, sampling and the read of the step before make no stream synchronisation."""
    llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cuda", dtype="bfloat16",
              max_num_seqs=16, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    names = [None, *ADAPTERS]
    for i in range(12):
        engine.add_request(f"r{i}", make_prompt(f"steady {i}"), params, names[i % len(names)])
    while engine.ahead_steps < 5:
        engine.step()
    before = engine.ahead_steps
    found = _syncs(lambda: [engine.step() for _ in range(20)])
    assert engine.ahead_steps == before + 20, "the steps were not scheduled ahead"
    assert found == [], found[0]
