"""The start-up warm-up of the eager step (engine/warmup.py): which token counts it runs, that it leaves the engine's
outputs unchanged, and (GPU) that serving after it builds no Triton kernel variant."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moelora.engine.batch import dummy_chunks, split_tokens
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.warmup import warm_up, warm_up_eager, warmup_token_counts
from moelora.kernels import _triton
from moelora.layers.lora_batch import LoRABatch
from moelora_bench.decode import TINY, random_adapter


def test_token_counts_take_both_classes_of_each_power_of_two_range():
    assert warmup_token_counts(100) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100]
    assert warmup_token_counts(1) == [1]
    counts = warmup_token_counts(2048)
    assert counts[-3:] == [1024, 1025, 2048] and len(counts) == len(set(counts)) == 22
    # every power-of-two range (p, 2p] holds a multiple of 16 and a count that is not, from 32 on
    for p in (16, 32, 64, 128, 256, 512, 1024):
        inside = [n for n in counts if p < n <= 2 * p]
        assert any(n % 16 == 0 for n in inside) and any(n % 16 for n in inside), p


def test_dummy_chunks_take_consecutive_blocks_or_none():
    seqs = dummy_chunks([3, 20], 16, 16, 5)
    assert [(len(c.token_ids), c.num_cached, c.block_table, c.slot) for c in seqs] == [
        (3, 16, [0, 1], -1), (20, 16, [2, 3, 4], -1)]
    assert dummy_chunks([3, 20], 16, 16, 4) is None
    assert [c.block_table for c in dummy_chunks([1] * 3, 0, 16, 3)] == [[0], [1], [2]]


def test_split_tokens_and_the_every_slot_batch():
    assert split_tokens(5, 2) == [2, 2, 1] and split_tokens(4, 4) == [4] and split_tokens(0, 3) == []
    b = LoRABatch.every_slot(5, 2, "cpu")
    assert b.token_slots.tolist() == [0, 1, 0, 1, 0] and b.graph and b.has_lora
    b = LoRABatch.every_slot(3, 0, "cpu")  # no LoRA: base rows, no forced kernels
    assert b.token_slots.tolist() == [-1, -1, -1] and not b.graph and not b.has_lora


def test_warm_up_only_on_a_gpu_and_only_when_asked(tmp_path):
    """The engine's warm-up runs nothing on the CPU, nor on a GPU with kernel_warmup off (a model whose device is
    a GPU stands in: nothing is run before the check)."""
    class GPUModel:
        device = torch.device("cuda")

    class CPUModel:
        device = torch.device("cpu")

    args = EngineArgs(model=str(tmp_path), kernel_warmup=False)
    assert warm_up(GPUModel(), None, args, 256) == 0
    args.kernel_warmup = True
    assert warm_up(CPUModel(), None, args, 256) == 0


def _engine(path, device: str, dtype: str, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), max_loras=2, max_lora_rank=8, dtype=dtype, device=device,
                                load_format="dummy", seed=3, max_num_seqs=max_num_seqs, max_model_len=256,
                                max_num_batched_tokens=128, kv_cache_memory_bytes=32 << 20))


def _generate(eng: LLMEngine, prompts: list[tuple[list[int], str | None]], max_tokens: int = 4) -> list[list[int]]:
    for i, (ids, adapter) in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        adapter=adapter)
    while eng.has_unfinished_requests():
        eng.step()
    return [eng.pop_finished(str(i)).output_ids for i in range(len(prompts))]


def test_warm_up_runs_each_count_twice_and_changes_no_output(tmp_path):
    """An engine warmed up at start-up (as on a GPU) and one not give the same tokens, with and without an adapter,
    prefixes cached and hit (the warm-up writes KV blocks before any request has one)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    rng = random.Random(0)
    prompts = [([rng.randrange(TINY["vocab_size"]) for _ in range(n)], a)
               for n, a in ((5, None), (40, "a"), (37, None))]
    outs = []
    for warm in (False, True):
        eng = _engine(tmp_path, "cpu", "float32")
        if warm:
            forwards = 2 * len(warmup_token_counts(128)) + 2 * len([b for b in warmup_token_counts(8) if b > 1])
            assert warm_up_eager(eng.model, eng.kv, 128, 2, eng.sampler, 8) == forwards
        eng.registry.register(random_adapter("a", eng.model.lora_targets(), 8, 1, "cpu", torch.float32))
        outs.append(_generate(eng, prompts) + _generate(eng, prompts))  # the second time from cached prefixes
    assert outs[1] == outs[0]
    assert outs[0][:3] == outs[0][3:]


def test_no_warm_up_sequence_passes_max_len(tmp_path):
    """Counts beyond max_model_len are split into several sequences: no position reaches it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    eng = _engine(tmp_path, "cpu", "float32")
    seen = []
    eng.model.register_forward_pre_hook(lambda m, a: seen.append((a[0].numel(), int(a[1].max()))))
    warm_up_eager(eng.model, eng.kv, 128, 2, None, 8, max_len=40)
    assert max(p for _, p in seen) < 40 and 128 in [n for n, _ in seen]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_after_the_warm_up_builds_no_kernel(tmp_path):
    """Prompts of lengths in every class, with and without adapters, mixed with decodes, then 37 short requests at
    once, after the engine's warm-up: Triton builds no kernel variant (each would stall a step for seconds)."""
    cfg = {**TINY, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _triton.track_kernel_builds()
    eng = _engine(tmp_path, "cuda", "bfloat16", max_num_seqs=40)
    eng.registry.register(random_adapter("a", eng.model.lora_targets(), 8, 1, "cuda", torch.bfloat16))
    eng.registry.register(random_adapter("b", eng.model.lora_targets(), 4, 2, "cuda", torch.bfloat16))
    rng = random.Random(1)
    lengths = [1, 3, 7, 16, 17, 31, 48, 63, 100, 127, 128, 129, 200]
    prompts = [([rng.randrange(cfg["vocab_size"]) for _ in range(n)], (None, "a", "b")[i % 3])
               for i, n in enumerate(lengths)]
    built = _triton.kernel_builds()
    _generate(eng, prompts[:5], max_tokens=8)  # a few at once: mixed prefill + decode steps
    _generate(eng, prompts[5:], max_tokens=3)
    _generate(eng, [([rng.randrange(cfg["vocab_size"]) for _ in range(3 + i % 5)], (None, "a")[i % 2])
                    for i in range(37)], max_tokens=4)  # up to 37 sequences a step: more than the decode graphs hold
    assert _triton.kernel_builds() == built
