"""Faults stay with the request that caused them (the real `openai` client on localhost, the demo model on the CPU):
an adapter whose files vanish or change after it left host memory fails its own requests, with an error naming
it, while 32 other streams finish with the right text; a request that cannot fit the KV cache is refused up
front; `--lora-root` confines the files actually opened."""

import argparse
import asyncio
import logging
import os
import shutil

import httpx
import openai
import pytest

from moelora import LLM, SamplingParams
from moelora.demo import adapter_paths, make_prompt, model_path
from moelora.server.launch import ServerThread, add_arguments, build_from_args

KEY = "k"
BASE = "moelora-demo"


def start(*argv: str) -> ServerThread:
    p = argparse.ArgumentParser()
    add_arguments(p)
    engine, app = build_from_args(p.parse_args(["--device", "cpu", "--api-key", KEY, *argv]))
    return ServerThread(engine, app).start()


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    shutil.copytree(adapter_paths()["upper"], r / "r1")
    shutil.copytree(adapter_paths()["rot13"], r / "r2")
    return r


def test_adapter_gone_from_disk_fails_its_request_alone_while_32_streams_finish(root, caplog):
    caplog.set_level(logging.INFO, logger="moelora")
    srv = start("--max-loras", "1", "--max-cpu-loras", "1", "--lora-root", str(root), "--max-num-seqs", "48")
    try:
        for name in ("r1", "r2"):  # loading r2 drops r1 from host memory (--max-cpu-loras 1)
            assert post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(root / name)}).status_code == 200
        assert "adapter 'r1' evicted from host memory" in caplog.text
        assert metric(srv, "moelora_adapter_cpu_evictions_total") >= 1
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        assert c.completions.create(model="r2", prompt=make_prompt("abc"), max_tokens=8, temperature=0).choices[0].text == "nop"
        os.rename(root / "r1", root / "r1-moved")  # r1 is in no slot and not in host memory: it must be read again

        texts = [f"{chr(97 + i % 26)}{chr(97 + (i * 7) % 26)} {chr(97 + (i * 3) % 26)}xy" for i in range(32)]
        llm = LLM(model_path(), device="cpu", max_loras=1)
        expected = [o.text for o in llm.generate([make_prompt(t) for t in texts],
                                                 SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]

        async def traffic():
            ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

            async def stream(t):
                parts, reasons = [], []
                async for ch in await ac.completions.create(model=BASE, prompt=make_prompt(t), max_tokens=40,
                                                            temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    parts.append(ch.choices[0].text)
                    reasons.append(ch.choices[0].finish_reason)
                return "".join(parts), reasons[-1]

            async def bad():
                await asyncio.sleep(0.2)  # the streams are running
                with pytest.raises(openai.InternalServerError) as e:
                    await ac.completions.create(model="r1", prompt=make_prompt("abc"), max_tokens=8, temperature=0)
                return str(e.value)

            return await asyncio.gather(bad(), *[stream(t) for t in texts])

        err, *streams = asyncio.run(traffic())
        assert "adapter 'r1'" in err and "r1" in err
        assert [s for s, _ in streams] == expected and all(r == "length" for _, r in streams)
        assert metric(srv, "moelora_requests_failed_total") == 1
        assert metric(srv, "moelora_adapter_load_failures_total") == 1
        # the other adapter and the base still serve
        assert c.completions.create(model="r2", prompt=make_prompt("abc"), max_tokens=8, temperature=0).choices[0].text == "nop"

        # the folder comes back with other weights under the same name: never served silently
        shutil.copytree(adapter_paths()["reverse"], root / "r1")
        with pytest.raises(openai.InternalServerError, match="changed since the adapter was loaded"):
            c.completions.create(model="r1", prompt=make_prompt("abc"), max_tokens=8, temperature=0)
        with pytest.raises(openai.APIError, match="changed"):  # streamed: an error event
            list(c.completions.create(model="r1", prompt=make_prompt("abc"), max_tokens=8, temperature=0, stream=True))
        assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "r1"}).status_code == 200
        assert post(srv, "/v1/load_lora_adapter", {"lora_name": "r1", "lora_path": str(root / "r1")}).status_code == 200
        assert c.completions.create(model="r1", prompt=make_prompt("abc"), max_tokens=8, temperature=0).choices[0].text == "cba"
        assert "adapter 'r1' unloaded" in caplog.text and "adapter 'r1' loaded from" in caplog.text
        e = srv.engine.engine
        assert e.kv.num_free_blocks == e.kv.num_blocks and not e.has_unfinished_requests()
    finally:
        srv.stop()


def test_adapter_read_again_with_the_same_content_serves(root):
    """The other side of the content check: an adapter dropped from host memory and read again unchanged serves
    as before (a copy with the same bytes is the same content)."""
    srv = start("--max-loras", "1", "--max-cpu-loras", "1", "--lora-root", str(root))
    try:
        for name in ("r1", "r2"):
            assert post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(root / name)}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        shutil.rmtree(root / "r1")
        shutil.copytree(adapter_paths()["upper"], root / "r1")  # rewritten, same bytes
        for model, want in (("r1", "ABC"), ("r2", "nop"), ("r1", "ABC")):
            assert c.completions.create(model=model, prompt=make_prompt("abc"), max_tokens=8, temperature=0).choices[0].text == want
        assert metric(srv, "moelora_adapter_reloads_total") >= 1
        assert metric(srv, "moelora_adapter_slot_evictions_total") >= 2
    finally:
        srv.stop()


def test_symlinked_weights_outside_the_root_are_refused(root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(adapter_paths()["upper"], outside)
    evil = root / "evil"
    evil.mkdir()
    shutil.copy(outside / "adapter_config.json", evil / "adapter_config.json")
    os.symlink(outside / "adapter_model.safetensors", evil / "adapter_model.safetensors")
    inside = root / "inside"  # a symlink that stays inside the root is fine
    inside.mkdir()
    shutil.copy(outside / "adapter_config.json", inside / "adapter_config.json")
    os.symlink(root / "r1" / "adapter_model.safetensors", inside / "adapter_model.safetensors")
    srv = start("--lora-root", str(root))
    try:
        r = post(srv, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(evil)})
        assert r.status_code == 400 and "outside the allowed --lora-root" in r.json()["error"]["message"], r.text
        assert "evil" not in {m.id for m in openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY).models.list().data}
        assert post(srv, "/v1/load_lora_adapter", {"lora_name": "inside", "lora_path": str(inside)}).status_code == 200
    finally:
        srv.stop()


def test_prompt_plus_max_tokens_over_the_kv_cache_is_refused_up_front():
    from moelora.config import ModelConfig
    from moelora.distributed import ParallelState, kv_cache_config
    from moelora.engine.kv_cache import KVCache
    import torch

    per_block = KVCache.bytes_per_block(kv_cache_config(ModelConfig.from_pretrained(model_path()), ParallelState()),
                                        16, torch.float32)
    # 8 blocks of 16: 128 tokens, under the 256 of context; no max_new_tokens default from generation_config.json
    srv = start("--kv-cache-memory", str(8 * per_block), "--generation-config", "vllm")
    try:
        assert srv.engine.engine.kv.num_blocks == 8
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        prompt = make_prompt("abcdefghij")  # 14 tokens
        with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
            c.completions.create(model=BASE, prompt=prompt, max_tokens=120, temperature=0)
        r = c.completions.create(model=BASE, prompt=prompt, max_tokens=114, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 114
        # no max_tokens (chat): runs until the cache is full, then ends with "length", never a 500
        r = c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "abc"}], temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens + r.usage.completion_tokens == 128
        e = srv.engine.engine
        assert e.kv.num_free_blocks == e.kv.num_blocks
    finally:
        srv.stop()


def test_a_slot_write_that_fails_fails_its_request_alone(monkeypatch):
    """Loading an adapter from host memory into a LoRA slot can fail too (a device error): that request fails with
    an error naming the adapter, the others in the same step finish."""
    srv = start("--max-loras", "1")
    try:
        pool = srv.engine.engine.pool
        real = pool._write

        def write(adapter, slot):
            if adapter.name == "reverse":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            real(adapter, slot)

        monkeypatch.setattr(pool, "_write", write)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

        async def both():
            ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
            ok = ac.completions.create(model=BASE, prompt=make_prompt("abcdef"), max_tokens=8, temperature=0)
            bad = ac.completions.create(model="reverse", prompt=make_prompt("abc"), max_tokens=8, temperature=0)
            return await asyncio.gather(ok, bad, return_exceptions=True)

        ok, bad = asyncio.run(both())
        assert ok.choices[0].text == "abcdef"
        assert isinstance(bad, openai.InternalServerError) and "adapter 'reverse'" in str(bad)
        assert "illegal memory access" in str(bad)
        assert c.completions.create(model="upper", prompt=make_prompt("abc"), max_tokens=8, temperature=0).choices[0].text == "ABC"
    finally:
        srv.stop()
