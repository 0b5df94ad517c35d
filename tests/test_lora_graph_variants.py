"""LoRA graph variants: which graph serves a batch, each slot's target groups,
and which layers a variant leaves out (CPU); on a GPU, a variant's replay against the full LoRA graph's."""

import pytest
import torch

from moelora.layers.lora_batch import LoRABatch
from moelora_bench.decode import TINY, random_adapter, target_subset
from moelora.engine.cuda_graphs import lora_graph_mode
from moelora.layers.lora import LORA_SLOT_WRITES, LoRAWeights, lora_active, slot_target_groups


def test_lora_graph_mode():
    groups = [(True, False), (False, True), (True, True), (False, False)]  # attention-only, experts-only, all, none
    assert lora_graph_mode([-1, -1], groups) is False
    assert lora_graph_mode([0, 0, -1], groups) == "dense"
    assert lora_graph_mode([1, -1], groups) == "experts"
    assert lora_graph_mode([0, 1], groups) is True  # the two kinds together need both
    assert lora_graph_mode([2], groups) is True
    assert lora_graph_mode([3, -1], groups) is False  # an adapter that adapts nothing here: the base graph
    assert lora_graph_mode([3, 0], groups) == "dense"


def test_lora_active_in_graph_variants():
    """Graph batches run every LoRA layer, except the kind their variant skips; eager batches go by the ranks."""
    dense = LoRAWeights(8, [8], 2, 4)
    experts = LoRAWeights(8, [8], 2, 4, num_experts=3)
    lb = LoRABatch.static(4, 2, "cpu")
    skip_e = LoRABatch.static(4, 2, "cpu")
    skip_e.skip_experts = True
    skip_d = LoRABatch.static(4, 2, "cpu")
    skip_d.skip_dense = True
    assert lora_active(dense, lb) and lora_active(experts, lb)
    assert lora_active(dense, skip_e) and not lora_active(experts, skip_e)
    assert not lora_active(dense, skip_d) and lora_active(experts, skip_d)
    eager = LoRABatch.build([0, -1], 2)
    assert not lora_active(dense, eager)  # rank 0 everywhere
    dense.set_slot(0, 0, torch.ones(2, 8), torch.ones(8, 2), 1.0)
    assert lora_active(dense, eager)


def test_slot_target_groups_follow_the_slots(tmp_path):
    """Per slot (dense, experts) from the loaded adapters' ranks: attention-only, experts-only and full adapters,
    an empty slot; every slot write moves LORA_SLOT_WRITES (the graphs' cache of these recomputes)."""
    import json

    from moelora.engine.llm_engine import EngineArgs, LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    eng = LLMEngine(EngineArgs(model=str(tmp_path), max_loras=4, max_lora_rank=8, dtype="float32", device="cpu",
                               load_format="dummy"))
    targets = eng.model.lora_targets()
    weights = [m for m in eng.model.modules() if isinstance(m, LoRAWeights)]
    for i, which in enumerate(["attention", "experts", "all"]):
        eng.registry.register(random_adapter(f"a{i}", target_subset(targets, which), 4, i, "cpu", torch.float32))
        before = LORA_SLOT_WRITES[0]
        assert eng.pool.pin(eng.registry.get(f"a{i}")) == i
        assert LORA_SLOT_WRITES[0] > before
    assert slot_target_groups(weights, 4) == [(True, False), (False, True), (True, True), (False, False)]
    eng.pool.unpin("a2")
    eng.pool.evict("a2")
    assert slot_target_groups(weights, 4)[2] == (False, False)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_graph_variants_equal_the_full_lora_graph(tmp_path):
    """A batch of attention-only adapters replays the "dense" graph, one of
    experts-only adapters the "experts" graph, a mix the full one; each variant's logits equal the full LoRA
    graph's on the same inputs (the kernels left out add exact zeros; bf16 rounding of the fused SiLU path aside),
    and the variants record fewer LoRA computations."""
    import json
    import random

    from moelora.engine.llm_engine import EngineArgs, LLMEngine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = {**TINY, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4,
           "num_hidden_layers": 3, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = LLMEngine(EngineArgs(model=str(tmp_path), max_loras=4, max_lora_rank=16, dtype="bfloat16", device="cuda",
                               load_format="dummy", seed=1, max_num_seqs=16, max_model_len=512,
                               kv_cache_memory_bytes=128 << 20))
    targets = eng.model.lora_targets()
    for i, which in enumerate(["attention", "experts", "all"]):
        ad = random_adapter(f"a{i}", target_subset(targets, which), 16, 10 + i, "cuda", torch.bfloat16)
        for m in ad.modules.values():
            m.b.mul_(10.0)  # deltas that move the logits
        eng.registry.register(ad)
        assert eng.pool.pin(eng.registry.get(f"a{i}")) == i
    g = eng.runner.graphs
    assert {m for _, m in g.graphs} == {True, False, "dense", "experts"}
    for bs in g.buckets:
        assert 0 < g.lora_layer_calls[(bs, "dense")] < g.lora_layer_calls[(bs, True)]
        assert 0 < g.lora_layer_calls[(bs, "experts")] < g.lora_layer_calls[(bs, True)]
    rng = random.Random(3)
    n = 6
    positions = [rng.randint(0, 100) for _ in range(n)]
    per = 100 // eng.kv.block_size + 1
    tables = [list(range(i * per, i * per + p // eng.kv.block_size + 1)) for i, p in enumerate(positions)]  # disjoint
    ids = [rng.randrange(eng.config.vocab_size) for _ in range(n)]
    for slots, want in (([0] * n, "dense"), ([1, 1, -1, 1, 1, 1], "experts"), ([0, 1, 0, 1, -1, 0], True),
                        ([2] * n, True)):
        assert g.mode(slots) == want
        got = eng.model.compute_logits(g.run(ids, positions, tables, slots)).clone()
        full = eng.model.compute_logits(g.run(ids, positions, tables, slots, mode=True)).clone()
        diff = (got - full).abs().max().item()
        assert diff < 0.15, (slots, want, diff)
        base = eng.model.compute_logits(g.run(ids, positions, tables, [-1] * n)).clone()
        assert (full - base).abs().max().item() > 0.3  # the adapters move the logits: a skipped delta would show
    assert g.replays[(8, "dense")] >= 1 and g.replays[(8, "experts")] >= 1
