"""Serving through the graphs of prefill / mixed steps (StepGraphs.run_mixed) gives what eager steps give.

On the CPU a "graph" is the model run again on the graph's static buffers at each replay: what a captured graph
replays, with the same padding rows, padding sequences, static LoRA groups and host-to-buffer copies. (The reference
attention reads host lists, taken here from the buffers; a graph's kernels read the buffers. The GPU captures real
graphs: tests/test_cuda_graphs.py.)"""

import pytest
import torch

from helpers import rows_of, save_peft_adapter, save_tiny_model, tmp
from kernel_cases import ON_GPU
from moelora import LLM, SamplingParams
from moelora.engine.cuda_graphs import StepGraphs

pytestmark = [pytest.mark.skipif(ON_GPU, reason="the GPU captures real graphs (tests/test_cuda_graphs.py)"),
              pytest.mark.usefixtures("one_thread")]
BS = 4  # KV block size


class Rerun:
    """Stands in for a captured graph: replay() runs the captured forward again into the captured output."""

    def __init__(self, forward, out: torch.Tensor) -> None:
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())

    def reset(self) -> None:
        pass


def _record(self, forward):
    attn = forward.args[2]  # functools.partial(model, input_ids, positions, attn, caches, lora)

    def rerun():
        attn.seq_lens, attn.query_start_loc = attn.seq_lens_t.tolist(), attn.query_start_loc_t.tolist()
        return forward()

    out = rerun()
    return Rerun(rerun, out), out, 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill-graphs")
    base = save_tiny_model("qwen3_moe", tmp(d, "m"))
    paths = {"dense": tmp(d, "dense"), "experts": tmp(d, "experts")}
    save_peft_adapter(base, paths["dense"], 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    save_peft_adapter(base, paths["experts"], 2, r=8, lora_alpha=8,
                      target_modules=["gate_proj", "up_proj", "down_proj"])
    return tmp(d, "m"), paths


def _llm(model_dir, graphs: bool, monkeypatch) -> LLM:
    path, adapters = model_dir
    llm = LLM(path, adapters=adapters, device="cpu", max_loras=2, max_lora_rank=16, block_size=BS, max_model_len=128,
              max_num_seqs=8)
    eng = llm.engine
    if graphs:
        monkeypatch.setattr(StepGraphs, "_record", _record)
        g = StepGraphs(eng.model, eng.kv, 2, 4, -(-128 // BS), max_prefill_tokens=128, max_num_seqs=8)
        g.capture()
        eng.runner.graphs = g
    return llm


def _serve(llm: LLM, rounds) -> list:
    out = []
    for prompts, names in rounds:
        params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
        out += [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, adapter=names)]
    return out


def test_serving_through_the_prefill_graphs_gives_the_eager_tokens(model_dir, monkeypatch):
    """Rounds of requests under a dense-only adapter, an experts-only adapter, the base and mixes (each LoRA mode of
    graph), prompts sharing cached prefixes (hits: suffix-only steps), a prompt longer than the largest bucket
    (eager), and decode rows beside prompt chunks: greedy tokens and log-probabilities (fp32) as without graphs."""
    prefix = rows_of(3, [13])[0]
    short = [prefix + r for r in rows_of(4, [3, 6, 2, 9])]
    rounds = [(short, ["dense"] * 4), (short, ["experts"] * 4), (short, [None] * 4),
              (short, ["dense", "experts", None, "dense"]), (rows_of(5, [70, 5]), ["experts", None]),
              ([prefix + r for r in rows_of(6, [1, 4])], ["dense", "experts"])]
    want = _serve(_llm(model_dir, False, monkeypatch), rounds)
    llm = _llm(model_dir, True, monkeypatch)
    got = _serve(llm, rounds)
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(got, want)):
        assert t1 == t2, f"request {i}: tokens {t1} through the graphs, {t2} eager"
        for d1, d2 in zip(lp1, lp2):
            assert d1.keys() == d2.keys() and max(abs(d1[k] - d2[k]) for k in d1) < 1e-5, f"request {i}"
    g = llm.engine.runner.graphs
    prefill = {mode: n for (key, mode), n in g.replays.items() if isinstance(key, tuple)}
    assert set(prefill) == {True, False, "dense", "experts"} and all(prefill.values()), prefill
    assert llm.engine.scheduler.prefix_hits > 0
    dummy = llm.engine.kv.caches[0][0][llm.engine.kv.dummy_block]
    assert dummy.abs().sum() > 0, "padding rows write into the dummy block"
    g.recapture()  # release() then capture() anew (a kernel config changed): the same tokens again
    assert g.graphs and [t for t, _ in _serve(llm, rounds[:1])] == [t for t, _ in want[:4]]
