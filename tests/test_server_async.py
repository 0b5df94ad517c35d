"""The server with --async-scheduling, through the real `openai` client on localhost (the demo model on the CPU):
concurrent requests with mixed adapters that end on EOS at different steps, streamed or not, give the offline
(synchronous) engine's texts, and every KV block and request is released afterwards."""

import argparse
import asyncio
import random
import time

import openai

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, adapter_paths, make_prompt, model_path, random_input
from moelora.server.launch import ServerThread, add_arguments, build_from_args

KEY = "test-key"
BASE = "moelora-demo"


def test_async_scheduling_server_equals_offline_generate():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--api-key", KEY, "--max-num-seqs", "16", "--async-scheduling"])
    engine, app = build_from_args(args)
    srv = ServerThread(engine, app).start()
    try:
        rng = random.Random("server-async")
        rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(4)]
        rng.shuffle(rows)
        llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cpu")
        offline = llm.generate([make_prompt(t) for _, t in rows], SamplingParams(max_tokens=32, temperature=0.0),
                               adapter=[n for n, _ in rows])

        async def go():
            c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

            async def one(i, model, text):
                if i % 2:
                    return (await c.completions.create(model=model, prompt=make_prompt(text), max_tokens=32,
                                                       temperature=0)).choices[0].text
                parts = []
                async for chunk in await c.completions.create(model=model, prompt=make_prompt(text), max_tokens=32,
                                                              temperature=0, stream=True):
                    parts.append(chunk.choices[0].text)
                return "".join(parts)

            return await asyncio.gather(*[one(i, BASE if n is None else n, t) for i, (n, t) in enumerate(rows)])

        outs = asyncio.run(go())
        assert outs == [o.text for o in offline]
        assert engine.engine.ahead_steps > 0, "the asynchronous path never ran"
        e = engine.engine
        deadline = time.monotonic() + 20
        while (e.has_unfinished_requests() or e.kv.num_free_blocks != e.kv.num_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine thread reads a last in-flight step whose rows all finished
        assert not e.has_unfinished_requests() and e.kv.num_free_blocks == e.kv.num_blocks
    finally:
        srv.stop()
