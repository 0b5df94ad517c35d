"""The HTTP server with the real `openai` client on localhost, serving the bundled demo model on the CPU."""

import argparse
import asyncio
import random
import shutil
import time

import httpx
import openai
import pytest

from moelora import LLM, SamplingParams
from moelora.demo import ADAPTERS, TRANSFORMS, adapter_paths, make_prompt, model_path, random_input
from moelora.server.launch import ServerThread, add_arguments, build_from_args

KEY = "test-key"
BASE = "moelora-demo"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    extra = tmp_path_factory.mktemp("adapters")
    shutil.copytree(adapter_paths()["upper"], extra / "upper2")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--api-key", KEY, "--lora-root", str(extra), "--max-n", "4",
                         "--max-num-seqs", "32", "--max-body-bytes", "65536"])
    engine, app = build_from_args(args)
    srv = ServerThread(engine, app).start()
    srv.extra = extra
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(server, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(server, "moelora_running") == 0 and metric(server, "moelora_waiting") == 0
                and metric(server, "moelora_kv_blocks_free") == metric(server, "moelora_kv_blocks_total")):
            return
        time.sleep(0.1)
    raise AssertionError("server did not return to idle: KV blocks or requests left")


def ok_request(server) -> None:
    r = client(server).completions.create(model="upper", prompt=make_prompt("abc def"), max_tokens=16, temperature=0)
    assert r.choices[0].text == "ABC DEF"


def test_models_lists_base_and_adapters(server):
    models = {m.id: m for m in client(server).models.list().data}
    assert set(models) == {BASE, *ADAPTERS}
    assert all(models[a].model_extra["parent"] == BASE for a in ADAPTERS)


def test_32_concurrent_requests_equal_offline_generate(server):
    rng = random.Random("server-32")
    rows = [(name, random_input(rng)) for name in [None, *ADAPTERS] for _ in range(8)]
    rng.shuffle(rows)
    llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cpu")
    offline = llm.generate([make_prompt(t) for _, t in rows], SamplingParams(max_tokens=32, temperature=0.0),
                           adapter=[n for n, _ in rows])

    async def go():
        c = aclient(server)
        names = [BASE if n is None else (f"{BASE}:{n}" if i % 2 else n) for i, (n, _) in enumerate(rows)]
        return await asyncio.gather(*[
            c.completions.create(model=m, prompt=make_prompt(t), max_tokens=32, temperature=0)
            for m, (_, t) in zip(names, rows)])

    outs = asyncio.run(go())
    for (name, text), got, want in zip(rows, outs, offline):
        assert got.choices[0].text == want.text == TRANSFORMS[name](text)
        assert got.usage.completion_tokens == len(want.token_ids)
    wait_idle(server)


def test_streaming_equals_non_streaming(server):
    c = client(server)
    for model in [BASE, *ADAPTERS]:
        prompt = make_prompt("stream me please")
        full = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "stream me please"}],
                                         max_tokens=32, temperature=0)
        chat_stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "stream me please"}],
                                                max_tokens=32, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chat_stream if ch.choices) == \
            chat.choices[0].message.content == full.choices[0].text


def test_stream_sends_a_chunk_a_token_with_continuous_usage(server):
    """Every generated token gets a chunk, also one whose text is empty (held back while it may start the stop
    string "BQ"), and stream_options.continuous_usage_stats puts the usage so far in each: 1, 2, 3, ... tokens."""
    c = client(server)
    prompt = make_prompt("abc")
    chunks = list(c.completions.create(model="upper", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                       stop=["BQ"], stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True}))
    tokens = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in tokens) == "ABC"
    assert "" in [ch.choices[0].text for ch in tokens[:-1]]  # "B" held back, sent with "C"
    assert [ch.usage.completion_tokens for ch in tokens] == list(range(1, len(tokens) + 1))
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
    plain = list(c.completions.create(model="upper", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                      stop=["BQ"]))
    assert [ch.choices[0].text for ch in plain] == [ch.choices[0].text for ch in tokens]
    assert all(ch.usage is None for ch in plain)


def test_sampling_fields_logprobs_echo_n(server):
    c = client(server)
    r = c.completions.create(model="rot13", prompt=make_prompt("abc"), max_tokens=8, temperature=0, logprobs=2, echo=True)
    ch = r.choices[0]
    assert ch.text == make_prompt("abc") + "nop"
    prompt = make_prompt("abc")
    # echo with logprobs: the prompt's tokens first (the first one has no log-probability), then the generated
    # (the generated tokens end with the EOS token "\n", which is not part of the text)
    assert "".join(ch.logprobs.tokens) == ch.text + "\n" and ch.logprobs.tokens[-4:] == ["n", "o", "p", "\n"]
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in ch.logprobs.token_logprobs[1:])
    assert all(len(t) <= 3 for t in ch.logprobs.top_logprobs[1:])  # the top 2, and the token itself if not in them
    assert ch.logprobs.text_offset == [sum(map(len, ch.logprobs.tokens[:j])) for j in range(len(ch.logprobs.tokens))]
    assert len(ch.logprobs.tokens) == len(prompt) + 4
    kw = dict(model="reverse", prompt=make_prompt("abc"), max_tokens=8, temperature=1.5, seed=7, n=3, top_p=0.9,
              frequency_penalty=0.1, presence_penalty=0.1, extra_body={"top_k": 5, "min_p": 0.01})
    r = c.completions.create(**kw)
    assert [x.index for x in r.choices] == [0, 1, 2] and r.usage.prompt_tokens == len(make_prompt("abc"))
    again = c.completions.create(**kw)  # seeded: reproducible
    assert [x.text for x in again.choices] == [x.text for x in r.choices]
    r = c.completions.create(model="upper", prompt=make_prompt("abcdef"), max_tokens=3, temperature=0)
    assert r.choices[0].text == "ABC" and r.choices[0].finish_reason == "length"
    r = c.completions.create(model="upper", prompt=make_prompt("abc xyz"), max_tokens=16, temperature=0, stop=[" "])
    assert r.choices[0].text == "ABC" and r.choices[0].finish_reason == "stop"


def test_load_use_unload_while_others_run(server):
    c = client(server)
    path = str(server.extra / "upper2")
    resp = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "upper2", "lora_path": path},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    assert "upper2" in {m.id for m in c.models.list().data}

    models = ["rot13", "reverse", BASE, "upper2", "upper2"] * 3
    rng = random.Random("unload")
    texts = [random_input(rng) for _ in models]
    llm = LLM(model_path(), adapters=adapter_paths(), max_loras=4, device="cpu")
    expected = [o.text for o in llm.generate(
        [make_prompt(t) for t in texts], SamplingParams(max_tokens=24, temperature=0.0),
        adapter=[None if m == BASE else ("upper" if m == "upper2" else m) for m in models])]

    async def traffic():
        ac = aclient(server)
        long = [ac.completions.create(model=m, prompt=make_prompt(t), max_tokens=24, temperature=0)
                for m, t in zip(models, texts)]
        tasks = [asyncio.ensure_future(x) for x in long]
        await asyncio.sleep(0.3)  # requests (some on upper2) are running
        async with httpx.AsyncClient() as h:
            unload = await h.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "upper2"},
                                  headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        results = await asyncio.gather(*tasks)
        return unload, results

    unload, results = asyncio.run(traffic())
    assert unload.status_code == 200, unload.text
    assert [r.choices[0].text for r in results] == expected  # no request failed, each got its adapter
    assert "upper2" not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="upper2", prompt="a => ", max_tokens=2)
    ok_request(server)
    wait_idle(server)


def test_client_disconnect_frees_resources(server):
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "reverse", "prompt": make_prompt("y" * 24), "max_tokens": 200,
                            "ignore_eos": True, "stream": True}) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 3:
                    break  # leave mid-stream
    wait_idle(server)
    assert metric(server, "moelora_lora_slots_in_use") == 0
    ok_request(server)


def _post(server, path, body=None, key=KEY, raw=None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "content-type": "application/json"})
    return httpx.post(server.url + path, json=body, headers=headers)


@pytest.mark.parametrize("case", [
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "a"}, 404, "does not exist"),
    ("unknown base in base:adapter", "/v1/completions", {"model": "other:upper", "prompt": "a"}, 404, "base model"),
    ("negative temperature", "/v1/completions", {"model": "upper", "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("n above the limit", "/v1/completions", {"model": "upper", "prompt": "a", "n": 99}, 400, "n must be"),
    ("max_tokens above the context", "/v1/completions", {"model": "upper", "prompt": "a", "max_tokens": 10**6}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"model": "upper", "prompt": ""}, 400, "empty prompt"),
    ("token ids out of vocabulary", "/v1/completions", {"model": "upper", "prompt": [1, 99999]}, 400, "vocabulary"),
    ("missing field", "/v1/completions", {"prompt": "a"}, 400, "model"),
    ("prompt longer than the context", "/v1/completions", {"model": "upper", "prompt": "a" * 300}, 400, "context"),
    ("chat without messages", "/v1/chat/completions", {"model": "upper", "messages": []}, 400, "messages"),
    ("unload unknown adapter", "/v1/unload_lora_adapter", {"lora_name": "ghost"}, 404, "not loaded"),
    ("load outside --lora-root", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400, "lora-root"),
])
def test_errors_then_success(server, case):
    _, path, body, status, needle = case
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]
    ok_request(server)


def test_bad_adapter_load_changes_nothing(server):
    bad = server.extra / "bad"
    shutil.copytree(adapter_paths()["rot13"], bad)
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16, "use_dora": true}')
    before = {m.id for m in client(server).models.list().data}
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"] and "'bad'" in r.json()["error"]["message"]
    traversal = str(server.extra / ".." / ".." / "etc")
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "t", "lora_path": traversal})
    assert r.status_code == 400 and "lora-root" in r.json()["error"]["message"]
    assert {m.id for m in client(server).models.list().data} == before
    ok_request(server)


def test_auth_and_body_limit(server):
    assert httpx.get(server.url + "/health").status_code == 200
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = _post(server, "/v1/completions", raw=b'{"model": "upper", "prompt": "' + b"a" * 70000 + b'"}')
    assert r.status_code == 413
    ok_request(server)


def test_metrics_count_requests_and_tokens(server):
    before = metric(server, "moelora_generation_tokens_total")
    decode_steps = 'moelora_step_duration_seconds_count{kind="decode"}'
    try:
        decode_before = metric(server, decode_steps)
    except KeyError:  # no step of that kind yet on this server
        decode_before = 0.0
    ok_request(server)
    assert metric(server, "moelora_generation_tokens_total") > before
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'moelora_requests_total{adapter="upper",status="stop"}' in text
    # ok_request's "ABC DEF": its prompt and first token in a prefill step, the other 6 tokens in decode steps
    assert 'moelora_step_duration_seconds_count{kind="prefill"}' in text
    assert metric(server, decode_steps) - decode_before >= 6
    for name in ("moelora_time_to_first_token_seconds_bucket", "moelora_time_per_output_token_seconds_bucket",
                 "moelora_batch_size_bucket", "moelora_lora_slots_used", "moelora_kv_blocks_free",
                 "moelora_triton_kernel_builds_total"):
        assert name in text
