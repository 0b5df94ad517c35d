"""Tensor and expert parallelism on the CPU (gloo, 2 processes) give the single-process results.

Each configuration spawns the ranks once (torch.multiprocessing, a free port); every rank builds the model,
shards it, loads the PEFT adapters through the registry and slot pool (the slots cut them to the rank's part),
runs a mixed-adapter prefill batch and a few greedy decode steps through the paged cache, and rank 0 saves
what it saw. The single-process run of the same code is the reference: fp32 log-probabilities within 1e-4 and
the same greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import rows_of, save_peft_adapter, save_tiny_model, tmp
from moelora.layers.lora_batch import LoRABatch
from moelora.adapters.registry import AdapterRegistry
from moelora.adapters.slots import SlotPool
from moelora.config import ModelConfig
from moelora.distributed import ParallelState, free_port, init_parallel, kv_cache_config, shard_model
from moelora.engine.batch import SeqChunk, build_flat_batch
from moelora.engine.kv_cache import KVCache
from moelora.models.loader import build_model

TOL = 1e-4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MIXED = ["a", "b", None, "a", "c"]  # the prefill batch's adapters, row by row
DECODE = ["c", None, "b"]  # the decode batch's
STEPS = 4


def _make(root: str, family: str, **over) -> dict:
    """A tiny model and three PEFT adapters of different ranks and targets (attention, dense MLP, experts)."""
    d = tmp(root, family + "".join(f"_{k}{v}" for k, v in over.items()))
    base = save_tiny_model(family, tmp(d, "m"), **over)
    paths = {n: tmp(d, n) for n in "abc"}
    if family.startswith("deepseek"):
        q = ["q_proj"] if family == "deepseek_v2" else ["q_a_proj", "q_b_proj"]
        attn = q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        save_peft_adapter(base, paths["a"], 1, r=4, lora_alpha=8, target_modules=attn, target_parameters=EXPERTS)
        save_peft_adapter(base, paths["b"], 2, r=8, lora_alpha=4, target_modules=["kv_b_proj", "gate_proj", "up_proj", "down_proj"])
    else:
        save_peft_adapter(base, paths["a"], 1, r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS)
        b_modules = ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if family == "qwen2_moe":
            b_modules.append("shared_expert_gate")
        save_peft_adapter(base, paths["b"], 2, r=8, lora_alpha=4, use_rslora=True, target_modules=b_modules,
                          rank_pattern={"o_proj": 4})
    save_peft_adapter(base, paths["c"], 3, r=16, lora_alpha=16, target_modules=["o_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    return {"model": tmp(d, "m"), "adapters": paths}


def run_case(case: dict, ps: ParallelState) -> dict:
    """Build, shard, load the adapters; a mixed prefill batch's log-probs and STEPS greedy decode steps."""
    cfg = ModelConfig.from_pretrained(case["model"])
    model = build_model(cfg, case["model"], dtype="float32", max_loras=4, max_lora_rank=16)
    shard_model(model, ps)
    targets = model.lora_targets()
    registry, pool = AdapterRegistry(targets, 16), SlotPool(targets, 4)
    for name, path in case["adapters"].items():
        registry.load(name, path)
        pool.pin(registry.get(name))
    slot = lambda n: -1 if n is None else pool.slot_of(n)  # noqa: E731
    kv = KVCache(kv_cache_config(cfg, ps), 128, 2, torch.float32, "cpu")

    rows = rows_of(0, [7, 5, 9, 4, 6])
    chunks = [SeqChunk(ids, 0, kv.allocate(kv.blocks_needed(len(ids), 0)), slot(n)) for ids, n in zip(rows, MIXED)]
    fb = build_flat_batch(chunks, 2)
    hidden = model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 4))
    prefill = torch.log_softmax(model.compute_logits(hidden), -1)  # [T, V]

    prompts = rows_of(3, [5, 3, 6])
    tables = [kv.allocate(kv.blocks_needed(len(p) + STEPS, 0)) for p in prompts]
    chunks = [SeqChunk(p, 0, t, slot(n)) for p, t, n in zip(prompts, tables, DECODE)]
    tokens, decode = [], []
    for step in range(STEPS):
        fb = build_flat_batch(chunks, 2)
        hidden = model(fb.input_ids, fb.positions, fb.attn, kv.caches, LoRABatch.build(fb.token_slots, 4))
        lp = torch.log_softmax(model.compute_logits(hidden[fb.last_token_rows]), -1)  # [3, V]
        nxt = lp.argmax(-1).tolist()
        tokens.append(nxt)
        decode.append(lp)
        chunks = [SeqChunk([nxt[i]], len(p) + step, tables[i], slot(n)) for i, (p, n) in enumerate(zip(prompts, DECODE))]
    return {"prefill": prefill, "tokens": tokens, "decode": torch.stack(decode)}


def _worker(rank: int, world: int, port: int, tp: int, ep: int, cases: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    ps = init_parallel(tp, ep, backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = []
        for c in cases:
            results.append(run_case(c, ps))
        # every rank past its last collective before the groups go: tearing gloo down while a peer still sends
        # aborted a rank now and then ("terminate called without an active exception", SIGABRT)
        dist.barrier()
        if rank == 0:  # written only once every rank has passed the barrier: all results complete
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def run_parallel(tp: int, ep: int, cases: list[dict], out: str) -> list[dict]:
    """The cases on tp x ep CPU processes (gloo); rank 0's results. A rank aborted by gloo's teardown (SIGABRT,
    "terminate called without an active exception", seen in CI once in several runs even after the barrier)
    after the results were written is not a failure of what is tested: the results file only exists once every
    rank has passed the final barrier. Any other exit, or an abort before that, fails."""
    import signal

    world = tp * ep
    if os.path.exists(out):
        os.remove(out)  # only this run's rank 0 may write it
    try:
        mp.spawn(_worker, args=(world, free_port(), tp, ep, cases, out), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        if not (e.signal_name == "SIGABRT" or e.exit_code == -signal.SIGABRT) or not os.path.exists(out):
            raise
    return torch.load(out)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    cs = {
        "qwen3": _make(root, "qwen3_moe"),
        "qwen3_kv1": _make(root, "qwen3_moe", num_key_value_heads=1),  # one KV head over 2 ranks: replicated
        "qwen3_tied": _make(root, "qwen3_moe", tie_word_embeddings=True),  # logits from the split embedding
        "qwen2": _make(root, "qwen2_moe"),  # qkv bias, a gated shared expert
        "olmoe": _make(root, "olmoe"),  # q/k norms over the whole projection: statistics across ranks
        "deepseek_v2": _make(root, "deepseek_v2"),  # MLA, grouped routing, dense first layer, shared expert
        "deepseek_v2_q": _make(root, "deepseek_v2_q"),  # q_lora_rank (fused q_a/kv_a), attention biases, YaRN
    }
    torch.set_num_threads(1)
    refs = {k: run_case(c, ParallelState()) for k, c in cs.items()}
    return cs, refs


def _compare(name: str, got: dict, ref: dict) -> None:
    err = (got["prefill"] - ref["prefill"]).abs().max().item()
    assert err < TOL, f"{name}: prefill max |logprob diff| {err:.3g}"
    assert got["tokens"] == ref["tokens"], f"{name}: greedy tokens {got['tokens']} != {ref['tokens']}"
    err = (got["decode"] - ref["decode"]).abs().max().item()
    assert err < TOL, f"{name}: decode max |logprob diff| {err:.3g}"


# every family under TP; under EP the MoE variants (attention is replicated there); TP+EP (4 ranks on 2 CPU
# cores: slow to start) on Qwen2-MoE: experts split both ways, the gated shared expert over all 4 ranks
PLAN = {(2, 1): None, (1, 2): ["qwen3", "qwen2", "deepseek_v2"], (2, 2): ["qwen2"]}


FOUR_RANKS = pytest.mark.skipif(os.environ.get("MOELORA_TEST_4_RANKS") == "0",
                                reason="MOELORA_TEST_4_RANKS=0 skips the 4 spawned ranks (~25 s on 2 CPU cores)")


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), pytest.param(2, 2, marks=FOUR_RANKS)], ids=["tp2", "ep2", "tp2ep2"])
def test_parallel_matches_single_process(cases, tmp_path, tp, ep):
    cs, refs = cases
    names = PLAN[(tp, ep)] or list(cs)
    results = run_parallel(tp, ep, [cs[n] for n in names], str(tmp_path / "out.pt"))
    for n, got in zip(names, results):
        _compare(f"{n} tp={tp} ep={ep}", got, refs[n])


def test_shard_errors_name_what_is_wrong(cases):
    """No process group needed: the checks run before any collective."""
    cs, _ = cases
    cfg = ModelConfig.from_pretrained(cs["qwen3"]["model"])
    model = build_model(cfg, cs["qwen3"]["model"], dtype="float32", max_loras=2, max_lora_rank=16)
    with pytest.raises(ValueError, match="num_attention_heads = 4 does not split evenly over 3 ranks"):
        shard_model(model, ParallelState(tp_size=3))
    model = build_model(cfg, cs["qwen3"]["model"], dtype="float32", max_loras=2, max_lora_rank=16)
    with pytest.raises(ValueError, match="num_experts = 8 does not split evenly over 3 ranks"):
        shard_model(model, ParallelState(ep_size=3))
    model = build_model(cfg, cs["qwen3"]["model"], dtype="float32", max_loras=2, max_lora_rank=16)
    targets = model.lora_targets()
    registry, pool = AdapterRegistry(targets, 16), SlotPool(targets, 2)
    registry.load("a", cs["qwen3"]["adapters"]["a"])
    pool.pin(registry.get("a"))
    with pytest.raises(RuntimeError, match="before adapters are loaded"):
        shard_model(model, ParallelState(ep_size=2))


def test_lora_shard_cuts_factors():
    from moelora.layers.lora import LoRAShard, LoRAWeights

    w = LoRAWeights(6, [4], 2, 8, num_experts=2)  # rank 1 of 2 experts-parallel, row-parallel over in (12 -> 6)
    w.shard = LoRAShard(12, (4,), 4, in_slice=slice(6, 12), expert_slice=slice(2, 4))
    a, b = torch.randn(4, 3, 12), torch.randn(4, 4, 3)
    w.set_slot(0, 1, a, b, 0.5)
    assert torch.equal(w.a[0, 1, :, :3], a[2:4, :, 6:12]) and torch.equal(w.b[0][1, :, :, :3], b[2:4])
    shared_a = torch.randn(1, 3, 12)  # shared outer: one factor for every expert, kept whole
    w.set_slot(0, 0, shared_a, b, 1.0)
    assert torch.equal(w.a[0, 0, 1, :3], shared_a[0, :, 6:12])
    assert w.full_dims(0) == (12, 4, 4)
    with pytest.raises(ValueError, match="do not fit the unsharded weight"):
        w.set_slot(0, 0, torch.randn(4, 3, 6), b, 1.0)
