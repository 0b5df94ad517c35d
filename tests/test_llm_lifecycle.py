"""The offline LLM cleans up after itself (issue 51): shutdown(), a `with` block, or garbage collection stop a
tensor-parallel LLM's worker processes and leave the torch.distributed process group, so a second parallel LLM
can start in the same process (a notebook, a test, a script comparing two models) and gives the same tokens as
the single-process LLM; a shut-down LLM says so; a constructor that fails part way leaves nothing behind; and
the interpreter exits cleanly with parallel LLMs still alive. CPU, gloo, tp = 2, the tiny Qwen3-MoE."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch.distributed as dist

from helpers import rows_of, save_peft_adapter, save_tiny_model, tmp
from moelora.engine.llm import LLM
from moelora.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "no_group_left")

SHUT = "this LLM was shut down"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lifecycle")
    base = save_tiny_model("qwen3_moe", tmp(d, "m"))
    save_peft_adapter(base, tmp(d, "a"), 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    kw = dict(adapters={"a": tmp(d, "a")}, max_loras=1, max_lora_rank=4, block_size=4, max_num_seqs=2)
    prompts = rows_of(0, [6, 4])
    names = ["a", None]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = _tokens(LLM(tmp(d, "m"), **kw).generate(prompts, params, adapter=names))
    return tmp(d, "m"), kw, prompts, params, names, ref


@pytest.fixture
def no_group_left():
    """Every test starts without a process group and must end without one (if it does not, the group is left
    here so that the next tests are not blamed)."""
    assert not dist.is_initialized()
    yield
    left = dist.is_initialized()
    workers = _workers()
    if left:
        dist.destroy_process_group()
    for p in workers:
        p.kill()
        p.join(5)
    assert not left and not workers, "a test left a process group or worker processes behind"


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _workers() -> list:
    """This process's live worker processes (multiprocessing.active_children also reaps the finished ones)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]


def _released(procs) -> None:
    """The process group is gone and the workers ended on rank 0's "stop" (exit code 0: not terminated)."""
    assert not dist.is_initialized()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert not _workers()


def test_two_parallel_llms_one_after_the_other(setup):
    """shutdown() leaves the group (the second LLM starts) and lets go of the model, though `llm` still exists."""
    model, kw, prompts, params, names, ref = setup
    for _ in range(2):
        llm = LLM(model, tensor_parallel_size=2, **kw)
        procs = list(llm.engine.workers.procs)
        weights = weakref.ref(llm.engine.model)
        assert _tokens(llm.generate(prompts, params, adapter=names)) == ref
        llm.shutdown()
        _released(procs)
        gc.collect()
        assert weights() is None, "the shut-down LLM still holds its model"


def test_two_parallel_llms_released_by_garbage_collection(setup):
    """`del llm` (the last reference), then the same with the LLM in a reference cycle and gc.collect()."""
    model, kw, prompts, params, names, ref = setup
    for cyclic in (False, True):
        llm = LLM(model, tensor_parallel_size=2, **kw)
        procs = list(llm.engine.workers.procs)
        assert _tokens(llm.generate(prompts, params, adapter=names)) == ref
        if cyclic:
            llm.me = llm  # only the cycle collector frees it
        del llm
        gc.collect()
        _released(procs)


def test_context_manager(setup):
    model, kw, prompts, params, names, ref = setup
    with LLM(model, tensor_parallel_size=2, **kw) as llm:
        procs = list(llm.engine.workers.procs)
        assert _tokens(llm.generate(prompts, params, adapter=names)) == ref
    _released(procs)
    with pytest.raises(RuntimeError, match=SHUT):
        llm.generate(prompts, params, adapter=names)
    with pytest.raises(ZeroDivisionError):  # an error inside the block: released too, the error goes on
        with LLM(model, tensor_parallel_size=2, **kw) as llm:
            procs = list(llm.engine.workers.procs)
            1 / 0  # noqa: B018
    _released(procs)


def test_shutdown_twice(setup):
    """The second shutdown() is a no-op: no error, and it leaves a newer LLM's process group alone."""
    model, kw, prompts, params, names, ref = setup
    single = LLM(model, **kw)
    single.shutdown()
    single.shutdown()
    first = LLM(model, tensor_parallel_size=2, **kw)
    procs = list(first.engine.workers.procs)
    first.shutdown()
    first.shutdown()
    _released(procs)
    second = LLM(model, tensor_parallel_size=2, **kw)
    first.shutdown()  # again, while another parallel LLM runs
    assert dist.is_initialized()
    assert _tokens(second.generate(prompts, params, adapter=names)) == ref
    second.shutdown()
    for llm in (single, first):
        with pytest.raises(RuntimeError, match=SHUT):
            llm.generate(prompts, params, adapter=names)


def test_generate_after_shutdown_raises(setup):
    """Single process (tp = 2: test_context_manager): every entry point says the LLM was shut down."""
    model, kw, prompts, params, names, _ = setup
    llm = LLM(model, **kw)
    llm.shutdown()
    for call in (lambda: llm.generate(prompts, params, adapter=names), lambda: llm.generate(prompts[0]),
                 lambda: llm.load_adapter("b", kw["adapters"]["a"]), lambda: llm.unload_adapter("a"),
                 llm.list_adapters, lambda: llm.tokenizer, lambda: llm.__enter__()):
        with pytest.raises(RuntimeError, match=SHUT):
            call()


def test_failed_constructor_leaves_nothing_behind(setup, tmp_path):
    """An adapter that does not load makes LLM(...) raise after the workers and the process group started:
    they are released (so the next parallel LLM can start: test_two_parallel_llms_one_after_the_other)."""
    model, kw, *_ = setup
    adapters = {**kw["adapters"], "b": str(tmp_path / "nothing_here")}
    with pytest.raises(Exception, match="nothing_here"):
        LLM(model, tensor_parallel_size=2, **{**kw, "adapters": adapters})
    assert not dist.is_initialized()
    assert not _workers()


SCRIPT = """
import json, sys
from moelora.engine.llm import LLM
from moelora.engine.sampling_params import SamplingParams

def main(model):
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw = dict(tensor_parallel_size=2, max_loras=0, block_size=4)
    a = LLM(model, **kw)
    a.me = a  # a reference cycle: not freed by `del`; the next LLM's start collects it
    first = a.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    del a
    b = LLM(model, **kw)
    global keep
    keep = b  # still alive (and in a cycle) when the interpreter exits
    b.me = b
    second = b.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    print(json.dumps({"tokens": [first, second], "pids": [w.pid for w in b.engine.workers.procs]}), flush=True)

if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_interpreter_exit_with_parallel_llms_alive(setup, tmp_path):
    """A script whose parallel LLM is unreachable in a cycle when the next starts, and whose last one is still
    alive at exit: it exits at once with status 0, prints no error, and leaves no worker running."""
    import json

    model, *_ = setup
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"][0] == out["tokens"][1]
    for bad in ("Traceback", "Exception", "Error", "Warning", "leaked"):
        assert bad not in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    for pid in out["pids"]:
        assert not _running(pid), f"worker {pid} outlived the script"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False
