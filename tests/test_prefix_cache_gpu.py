"""Prefix caching on the GPU: the demo model in bf16 with CUDA-graph decode and asynchronous scheduling (the
server's defaults there) gives every request its adapter's right output with caching on, the same as with it off,
while repeated prompts hit their own adapter's blocks."""

import random

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, TRANSFORMS, adapter_paths, make_prompt, model_path, random_input

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefix_hits_under_graphs_and_async_scheduling_keep_every_output():
    rng = random.Random("prefix-gpu")
    texts = []
    while len(texts) < 12:
        t = random_input(rng)
        if len(t) >= 18:  # prompt of 22+ tokens: its first block of 16 can be shared
            texts.append(t)
    names = [None, *ADAPTERS]
    rows = [(names[i % 4], texts[i % 12]) for i in range(96)]  # 12 (adapter, text) pairs, each twice a wave
    outs = {}
    for caching in (False, True):
        llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cuda", dtype="bfloat16",
                  enable_prefix_caching=caching, max_num_seqs=32)
        e = llm.engine
        assert e.runner.graphs is not None and e.async_scheduling
        got = []
        for lo in range(0, 96, 24):  # later waves find the blocks of earlier ones
            part = rows[lo:lo + 24]
            got += [o.text for o in llm.generate([make_prompt(t) for _, t in part],
                                                 SamplingParams(max_tokens=32, temperature=0.0),
                                                 adapter=[n for n, _ in part])]
        outs[caching] = got
        assert got == [TRANSFORMS[n](t) for n, t in rows], f"caching={caching}: a wrong output"
        if caching:
            assert e.scheduler.prefix_hits >= 48 * 16 and e.ahead_steps > 0
        else:
            assert e.scheduler.prefix_hits == 0
        assert e.kv.num_free_blocks == e.kv.num_blocks
        del llm, e
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
