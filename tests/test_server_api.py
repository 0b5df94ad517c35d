"""The OpenAI API without silent no-ops, with vLLM's extra endpoints, and with every limit enforced (the real
`openai` client on localhost, the demo model on the CPU)."""

import argparse
import json
import math
import shutil

import httpx
import openai
import pytest

from moelora import LLM, SamplingParams
from moelora.demo import adapter_paths, make_prompt, model_path
from moelora.server.launch import ServerThread, add_arguments, build_from_args

KEY = "k"
BASE = "moelora-demo"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(*argv: str) -> ServerThread:
    p = argparse.ArgumentParser()
    add_arguments(p)
    engine, app = build_from_args(p.parse_args(["--device", "cpu", "--api-key", KEY, *argv]))
    return ServerThread(engine, app).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(adapter_paths()["upper"], root / "up")
    srv = start("--lora-root", str(root), "--max-body-bytes", "65536")
    srv.root = root
    yield srv
    srv.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def post(srv, path, body=None, raw=None):
    if raw is not None:
        return httpx.post(srv.url + path, content=raw, headers={**AUTH, "content-type": "application/json"})
    return httpx.post(srv.url + path, json=body, headers=AUTH)


def token_id(srv, ch: str) -> int:
    r = post(srv, "/tokenize", {"prompt": ch, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    (tid,) = r.json()["tokens"]
    return tid


# ---- request checks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,needle", [
    ("response_format", {"type": "json_object"}, "structured output"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool calls"),
    ("tool_choice", "required", "tool calls"),
    ("best_of", 3, "best_of"),
    ("suffix", " tail", "suffix"),
    ("guided_json", {"type": "object"}, "structured output"),
    ("frobnicate", 1, "unknown field 'frobnicate'"),
])
def test_unimplemented_fields_are_refused_not_ignored(server, field, value, needle):
    path = "/v1/chat/completions" if field in ("response_format", "tools", "tool_choice") else "/v1/completions"
    body = {"model": "upper", "max_tokens": 4, field: value}
    body.update({"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a => "})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == field


def test_fields_that_mean_off_are_accepted(server):
    c = client(server)
    r = c.chat.completions.create(model="upper", messages=[{"role": "user", "content": "abc"}], max_tokens=8,
                                  temperature=0, response_format={"type": "text"}, tools=[], user="someone")
    assert r.choices[0].finish_reason in ("stop", "length")
    r = c.completions.create(model="upper", prompt=make_prompt("abc"), max_tokens=8, temperature=0, best_of=1)
    assert r.choices[0].text == "ABC"


@pytest.mark.parametrize("raw,needle,param", [
    (b'{"model": "upper", "prompt": "a", "temperature": NaN}', "temperature", "temperature"),
    (b'{"model": "upper", "prompt": "a", "temperature": Infinity}', "temperature", "temperature"),
    (b'{"model": "upper", "prompt": "a", "top_p": -Infinity}', "top_p", "top_p"),
    (b'{"model": "upper", "prompt": "a", "logprobs": 1000}', "logprobs must be between 0 and 20", "logprobs"),
    (b'{"model": "upper", "prompt": "a", "logprobs": -1}', "logprobs", "logprobs"),
    (b'{"model": "upper", "prompt": "a", "logit_bias": {"5": 500}}', "logit_bias", None),
    (b'{"model": "upper", "prompt": "a", "logit_bias": {"999999": 1}}', "vocabulary", None),
    (b'{"model": "upper", "prompt": "a", "logit_bias": {"x": 1}}', "token ids", None),
    (b'{"model": "upper", "prompt": "a", "max_tokens": -1}', "max_tokens", "max_tokens"),
    (b'{"model": "upper", "prompt": "a",', "not valid JSON", None),
    (b'{"model": "upper", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 50, "logprobs": true}',
     "top_logprobs must be between 0 and 20", "top_logprobs"),
])
def test_invalid_values_get_a_400_naming_the_field(server, raw, needle, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = post(server, path, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["param"] == param


def test_chunked_upload_over_the_body_limit_is_refused(server):
    def chunks():
        yield b'{"model": "upper", "prompt": "'
        for _ in range(100):
            yield b"a" * 1000  # 100 kB without a Content-Length: chunked transfer encoding
        yield b'", "max_tokens": 1}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    small = httpx.post(server.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                       content=iter([b'{"model": "upper", "prompt": "', make_prompt("abc").encode(),
                                     b'", "max_tokens": 8, "temperature": 0}']))
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "ABC"


@pytest.mark.parametrize("name,path_kind,needle,param", [
    ("../x", "ok", "letters, digits", "lora_name"),
    ("a" * 5000, "ok", "at most 128", "lora_name"),
    ("a/b", "ok", "letters, digits", "lora_name"),
    ("with:colon", "ok", "letters, digits", "lora_name"),
    ("nul", "nul", "NUL", "lora_path"),
])
def test_adapter_names_and_paths_are_checked(server, name, path_kind, needle, param):
    path = str(server.root / "up") if path_kind == "ok" else str(server.root / "up") + "\x00x"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["param"] == param
    assert {m.id for m in client(server).models.list().data} == {BASE, "upper", "reverse", "rot13"}


# ---- logit_bias, echo, scoring, offsets ----------------------------------------------------------------------

def test_logit_bias_steers_sampling(server):
    c = client(server)
    z, a = token_id(server, "z"), token_id(server, "a")
    r = c.completions.create(model=BASE, prompt=make_prompt("abc"), max_tokens=4, temperature=0,
                             logit_bias={str(z): 100})
    assert r.choices[0].text == "zzzz"
    plain = c.completions.create(model=BASE, prompt=make_prompt("abc"), max_tokens=1, temperature=0, logprobs=1)
    assert plain.choices[0].text == "a"
    r = c.completions.create(model=BASE, prompt=make_prompt("abc"), max_tokens=1, temperature=0, logprobs=1,
                             logit_bias={str(a): -100})
    assert r.choices[0].text != "a"
    # sampled rows too, and in chat
    r = c.chat.completions.create(model="rot13", messages=[{"role": "user", "content": "abc"}], max_tokens=3,
                                  temperature=1.0, seed=3, logit_bias={str(z): 100})
    assert r.choices[0].message.content == "zzz"


def test_logit_bias_offline_async_scheduling_equals_synchronous():
    texts = ["abc", "hello wor", "xyz"]
    z = None
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(model_path(), adapters=adapter_paths(), device="cpu", max_loras=4, async_scheduling=async_scheduling)
        z = llm.tokenizer.encode("z", add_special_tokens=False)[0]
        params = [SamplingParams(max_tokens=6, temperature=0.0, logit_bias={z: 8.0}),
                  SamplingParams(max_tokens=6, temperature=0.0),
                  SamplingParams(max_tokens=6, temperature=0.0, logit_bias={z: -100.0, z - 1: 100.0})]
        outs.append([o.text for o in llm.generate([make_prompt(t) for t in texts], params,
                                                  adapter=["upper", None, "rot13"])])
        if async_scheduling:
            assert llm.engine.ahead_steps > 0
    assert outs[0] == outs[1]
    assert outs[0][1] == "hello " and outs[0][2] == "yyyyyy"


def test_echo_logprobs_and_max_tokens_zero_score_a_prompt_like_prompt_logprobs(server):
    """lm-eval's loglikelihood: echo + logprobs + max_tokens 0 gives each prompt token's log-probability under
    the adapter, the same as the offline engine's prompt_logprobs."""
    c = client(server)
    text = make_prompt("hello") + "HELLO"
    r = c.completions.create(model="upper", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    assert ch.text == text and r.usage.completion_tokens == 0 and ch.finish_reason == "length"
    llm = LLM(model_path(), adapters=adapter_paths(), device="cpu", max_loras=4)
    (off,) = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), adapter="upper")
    ids = off.prompt_token_ids
    assert len(ch.logprobs.tokens) == len(ids) and "".join(ch.logprobs.tokens) == text
    assert ch.logprobs.token_logprobs[0] is None
    for got, want, tid in zip(ch.logprobs.token_logprobs[1:], off.prompt_logprobs[1:], ids[1:]):
        assert math.isclose(got, want[tid], rel_tol=0, abs_tol=1e-5)
    # the adapter's continuation is likely under it, far less under the base model
    base = c.completions.create(model=BASE, prompt=text, max_tokens=0, echo=True, logprobs=1)
    assert sum(ch.logprobs.token_logprobs[-5:]) > sum(base.choices[0].logprobs.token_logprobs[-5:]) + 5
    # max_tokens 0 without echo: nothing
    r = c.completions.create(model="upper", prompt=text, max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0


def test_streamed_logprobs_carry_text_offsets(server):
    c = client(server)
    prompt = make_prompt("abcd")
    full = c.completions.create(model="upper", prompt=prompt, max_tokens=8, temperature=0, logprobs=1, echo=True)
    chunks = list(c.completions.create(model="upper", prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                       echo=True, stream=True))
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert offsets == full.choices[0].logprobs.text_offset
    assert offsets == [sum(map(len, tokens[:j])) for j in range(len(tokens))] and offsets[-1] > len(prompt)
    plain = list(c.completions.create(model="upper", prompt=prompt, max_tokens=8, temperature=0, logprobs=0, stream=True))
    offs = [o for ch in plain if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offs == list(range(len(offs)))  # one character per token here: 0, 1, 2, ...


# ---- endpoints -------------------------------------------------------------------------------------------------

def test_models_retrieve_tokenize_detokenize_version(server):
    c = client(server)
    m = c.models.retrieve("upper")
    assert m.id == "upper" and m.model_extra["parent"] == BASE
    assert c.models.retrieve(BASE).id == BASE
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    ids = post(server, "/tokenize", {"model": "upper", "prompt": "hello"}).json()
    assert ids["count"] == len(ids["tokens"]) == 5 and ids["max_model_len"] == 256
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "hello"}
    assert post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    from moelora import __version__

    assert httpx.get(server.url + "/version", headers=AUTH).json() == {"version": __version__}


def test_metrics_count_cancellations_and_http_errors(server):
    def value(name):
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    before, errors = value("moelora_requests_cancelled_total"), value("moelora_http_errors_total")
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", headers=AUTH,
                      json={"model": "upper", "prompt": make_prompt("abc"), "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 2:
                    break
    import time

    deadline = time.monotonic() + 10
    while value("moelora_requests_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value("moelora_requests_cancelled_total") == before + 1
    post(server, "/v1/completions", {"model": "nope", "prompt": "a"})
    assert value("moelora_http_errors_total") == errors + 1
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in ("moelora_preemptions_total", "moelora_adapter_loads_total", "moelora_adapter_slot_loads_total",
                 "moelora_adapter_slot_evictions_total", "moelora_adapter_cpu_evictions_total",
                 "moelora_requests_failed_total", "moelora_kv_blocks_free_min"):
        assert name in text


def test_generation_config_defaults_apply_when_a_request_leaves_them_out(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_path(), model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update({"temperature": 0.0, "max_new_tokens": 5})
    (model / "generation_config.json").write_text(json.dumps(cfg))
    srv = start("--model", str(model), "--lora", f"upper={adapter_paths()['upper']}")
    try:
        c = client(srv)
        # temperature 0 from the file: greedy, the same every time, no seed
        outs = {c.completions.create(model="upper", prompt=make_prompt("abcdefgh"), max_tokens=12).choices[0].text
                for _ in range(3)}
        assert outs == {"ABCDEFGH"}
        # chat without max_tokens: the file's max_new_tokens
        r = c.chat.completions.create(model="upper", messages=[{"role": "user", "content": "abcdefgh"}])
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        # a request's own value wins
        r = c.chat.completions.create(model="upper", messages=[{"role": "user", "content": "abcdefgh"}], max_tokens=7)
        assert r.usage.completion_tokens == 7
    finally:
        srv.stop()


# ---- prefix caching ------------------------------------------------------------------------------------------

def test_prefix_cache_reports_cached_tokens_per_adapter(server):
    c = client(server)

    def value(name):
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    prompt = make_prompt("the same long prompt shared by two requests")  # one token per character
    hit = (len(prompt) - 1) // 16 * 16  # whole blocks of 16, never the last token: 32 of 47
    q0, h0 = value("moelora_prefix_cache_queries_total"), value("moelora_prefix_cache_hits_total")
    first = c.completions.create(model="upper", prompt=prompt, max_tokens=4, temperature=0)
    again = c.completions.create(model="upper", prompt=prompt, max_tokens=4, temperature=0)
    other = c.completions.create(model="rot13", prompt=prompt, max_tokens=4, temperature=0)  # never shares
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == hit and again.choices[0].text == first.choices[0].text
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert value("moelora_prefix_cache_queries_total") - q0 == 3 * len(prompt)
    assert value("moelora_prefix_cache_hits_total") - h0 == hit
    chunks = list(c.completions.create(model="upper", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit


def test_no_enable_prefix_caching_turns_it_off():
    srv = start("--no-enable-prefix-caching")
    try:
        c = client(srv)
        prompt = make_prompt("the same long prompt shared by two requests")
        for _ in range(2):
            r = c.completions.create(model="upper", prompt=prompt, max_tokens=4, temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert srv.engine.engine.scheduler.prefix_hits == 0 and srv.engine.engine.kv.num_cached_blocks == 0
    finally:
        srv.stop()
