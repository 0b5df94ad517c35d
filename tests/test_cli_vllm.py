"""`moelora serve` as a vLLM user types it: vLLM's flag names for what moelora does (--lora-modules in both forms,
--enable-lora, --max-cpu-loras checked against --max-loras, --max-logprobs, --generation-config, a positional
MODEL, ...), one-line reasons for the vLLM flags it does not support, --version, --cpu-threads, the port checked
before the model loads, and --log-level for moelora's loggers and uvicorn's."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import socket
import time
import types

import pytest

from moelora.cli import build_parser, main
from moelora.demo import adapter_paths, model_path
from moelora.kernels.config import KernelConfig
from moelora.server import launch
from test_cli_errors import one_error_line


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(autouse=True)
def restore_logging():
    """configure_logging and uvicorn.Config change process-wide loggers: put them back for the tests after."""
    names = ["moelora", "uvicorn", "uvicorn.error", "uvicorn.access"]
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
             for n in names}
    yield
    for n, (level, handlers, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate = propagate


# ---- adapters: --lora-modules (NAME=PATH, several per flag, repeatable, JSON), --enable-lora, --max-cpu-loras -------

def test_lora_modules_in_both_forms_merge_with_lora(tmp_path):
    spec = json.dumps({"name": "chat", "path": str(tmp_path / "chat"), "base_model_name": "base"})
    args = parse("--model", str(tmp_path / "model"), "--enable-lora", "--lora", f"mine={tmp_path / 'mine'}",
                 "--lora-modules", f"sql={tmp_path / 'sql'}", f"math={tmp_path / 'm=1'}",
                 "--lora-modules", spec, "--served-model-name", "base", "--max-loras", "4", "--max-cpu-loras", "4")
    eargs, adapters, served = launch.engine_args(args)
    assert adapters == {"mine": str(tmp_path / "mine"), "sql": str(tmp_path / "sql"),
                        "math": str(tmp_path / "m=1"), "chat": str(tmp_path / "chat")}
    assert launch.lora_modules(args)["chat"].base_model_name == "base"
    assert served == "base" and eargs.model == str(tmp_path / "model")
    assert (eargs.max_loras, eargs.max_cpu_loras) == (4, 4)  # vLLM's check: max_cpu_loras >= max_loras


def test_lora_modules_join_the_demo_adapters_without_a_model(tmp_path):
    _, adapters, served = launch.engine_args(parse("--lora-modules", f"sql={tmp_path}"))
    assert adapters == {**adapter_paths(), "sql": str(tmp_path)} and served == "moelora-demo"


@pytest.mark.parametrize("item, says", [
    ("/just/a/path", "expected NAME=PATH or JSON"),
    ("{not json", "invalid JSON"),
    ('{"name": "a"}', "string fields name, path"),
    ('{"name": "a", "path": "/p", "rank": 8}', "unknown: ['rank']"),
    ('["a", "/p"]', "expected NAME=PATH or JSON"),
])
def test_a_bad_lora_modules_item_is_one_line(capsys, item, says):
    line = one_error_line(capsys, ["serve", "--lora-modules", item])
    assert line.startswith("moelora serve: error: argument --lora-modules: ") and says in line, line


# ---- the vLLM flags moelora has: parsed into EngineArgs and ServerSettings ------------------------------------------

def test_vllm_engine_flags_reach_engine_args(tmp_path):
    args = parse(str(tmp_path / "qwen3-moe"), "--served-model-name", "my-model", "--tensor-parallel-size", "2",
                 "--gpu-memory-utilization", "0.85", "--max-model-len", "32K", "--max-num-seqs", "128",
                 "--max-num-batched-tokens", "4096", "--max-loras", "4", "--max-lora-rank", "32", "--dtype", "half",
                 "--port", "8080", "--host", "0.0.0.0", "--enable-chunked-prefill", "--disable-log-requests",
                 "--disable-log-stats", "--cpu-threads", "3", "--load-format", "safetensors")
    eargs, _, served = launch.engine_args(args)
    assert served == "my-model" and eargs.model == str(tmp_path / "qwen3-moe")
    assert (eargs.tensor_parallel_size, eargs.gpu_memory_utilization, eargs.max_model_len) == (2, 0.85, 32768)
    assert (eargs.max_num_seqs, eargs.max_num_batched_tokens, eargs.max_loras, eargs.max_lora_rank) == (128, 4096, 4, 32)
    assert (eargs.dtype, eargs.cpu_threads, eargs.load_format) == ("float16", 3, "auto")
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    assert parse("-tp", "2").tensor_parallel_size == 2
    assert parse("--max-model-len", "4k").max_model_len == 4000
    assert parse("--max-model-len", "25.6k").max_model_len == 25600


def test_a_positional_model_works_as_in_vllm_serve(tmp_path, capsys):
    eargs, _, served = launch.engine_args(parse(str(tmp_path / "Qwen3-30B-A3B"), "--port", "8001"))
    assert eargs.model == str(tmp_path / "Qwen3-30B-A3B") and served == "Qwen3-30B-A3B"
    assert parse(str(tmp_path), "--model", str(tmp_path) + "/").model == str(tmp_path)  # the same folder twice
    line = one_error_line(capsys, ["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")])
    assert line.startswith("moelora serve: error: two models: ")


def test_one_served_model_name(capsys):
    line = one_error_line(capsys, ["serve", "--served-model-name", "a", "b"])
    assert line.startswith("moelora serve: error: --served-model-name takes one name")


def test_max_logprobs_and_generation_config_reach_server_settings(monkeypatch, tmp_path):
    """build_from_args hands --max-logprobs / --generation-config to ServerSettings and --cpu-threads to EngineArgs
    (the engine and the app replaced by stand-ins: no model loads)."""
    seen = {}
    monkeypatch.setattr(launch, "LLMEngine", lambda eargs, adapters: seen.setdefault("eargs", eargs))
    monkeypatch.setattr(launch, "AsyncEngine", lambda engine: engine)
    monkeypatch.setattr(launch, "build_app", lambda engine, settings: seen.setdefault("settings", settings))
    (tmp_path / "generation_config.json").write_text("{}")
    launch.build_from_args(parse("--max-logprobs", "5", "--generation-config", str(tmp_path), "--cpu-threads", "2",
                                 "--kernel-config", '{"moe_lora": {"early": false}}'))
    assert (seen["settings"].max_logprobs, seen["settings"].generation_config) == (5, str(tmp_path))
    assert seen["eargs"].cpu_threads == 2 and seen["eargs"].kernel_config == KernelConfig.from_dict({"moe_lora": {"early": False}})
    seen.clear()
    launch.build_from_args(parse())
    assert (seen["settings"].max_logprobs, seen["settings"].generation_config) == (20, "auto")  # vLLM's defaults
    assert seen["eargs"].kernel_config is None  # the engine takes the defaults
    assert parse("--generation-config", "vllm").generation_config == "vllm"


def test_a_generation_config_folder_must_hold_one(tmp_path, capsys):
    line = one_error_line(capsys, ["serve", "--generation-config", str(tmp_path)])
    assert line.startswith("moelora serve: error: argument --generation-config: no generation_config.json in ")
    line = one_error_line(capsys, ["serve", "--generation-config", str(tmp_path / "nowhere")])
    assert "expected auto, vllm or a folder" in line
    line = one_error_line(capsys, ["serve", "--max-logprobs", "-1"])
    assert line.startswith("moelora serve: error: argument --max-logprobs: expected an integer >= 0")


def test_cpu_threads_reaches_the_engine_from_generate_and_demo(monkeypatch):
    import moelora
    from moelora.demo import run as demo_run

    class Loaded(Exception):
        pass

    seen = {}

    def fake_llm(model=None, adapters=None, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(moelora, "LLM", fake_llm)
    monkeypatch.setattr(demo_run, "LLM", fake_llm)
    with pytest.raises(Loaded):
        main(["generate", "--device", "cpu", "--prompt", "hi", "--cpu-threads", "3"])
    assert seen["cpu_threads"] == 3 and seen["kernel_config"] is None
    seen.clear()
    with pytest.raises(Loaded):
        main(["demo", "--device", "cpu", "--cpu-threads", "2", "--kernel-config", '{"moe_lora": {"early": false}}'])
    assert seen["cpu_threads"] == 2 and seen["kernel_config"] == KernelConfig.from_dict({"moe_lora": {"early": False}})
    seen.clear()
    with pytest.raises(Loaded):
        main(["generate", "--device", "cpu", "--prompt", "hi", "--kernel-config", '{"side_stream_priority": "normal"}'])
    assert seen["kernel_config"] == KernelConfig(side_stream_priority="normal")
    seen.clear()

    with pytest.raises(Loaded):
        demo_run.main(["--device", "cpu", "--cpu-threads", "1"])
    assert seen["cpu_threads"] == 1


# ---- the vLLM flags moelora does not support: one line with the reason -----------------------------------------------

@pytest.mark.parametrize("argv, shown", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["-pp", "2"], "--pipeline-parallel-size 2"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["--enable-expert-parallel"], "--enable-expert-parallel"),
    (["--speculative-config", '{"method": "ngram"}'], '--speculative-config {"method": "ngram"}'),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4"),
    (["--lora-dtype", "float16"], "--lora-dtype float16"),
    (["--tokenizer", "/tok"], "--tokenizer /tok"),
    (["--chat-template", "t.jinja"], "--chat-template t.jinja"),
    (["--revision", "main"], "--revision main"),
    (["--tokenizer-revision", "main"], "--tokenizer-revision main"),
    (["--code-revision", "main"], "--code-revision main"),
    (["--download-dir", "/hf"], "--download-dir /hf"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser hermes"),
    (["--reasoning-parser", "qwen3"], "--reasoning-parser qwen3"),
])
def test_an_unsupported_vllm_flag_says_why_in_one_line(capsys, argv, shown):
    line = one_error_line(capsys, ["serve", *argv])
    m = re.fullmatch(r"moelora serve: error: (.+?) is not supported: (.+)", line)
    assert m, line
    assert m.group(1) == shown and len(m.group(2)) > 20


def test_unsupported_vllm_flags_at_their_defaults_are_accepted():
    # --trust-remote-code is in many vLLM command lines (DeepSeek's): moelora runs no remote code, so it is a no-op
    args = parse("--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--kv-cache-dtype", "auto",
                 "--lora-dtype", "auto", "--cpu-offload-gb", "0", "--trust-remote-code")
    assert launch.engine_args(args)[0].tensor_parallel_size == 1


def test_serve_help_explains_the_vllm_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--lora-modules" in out and "--enable-lora" in out and "--max-logprobs" in out
    assert "vLLM flags for features moelora does not have" in out and "--speculative-config" in out
    assert "vLLM's command lines" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moelora {importlib.metadata.version('moelora')}"


# ---- the port is checked before the model loads --------------------------------------------------------------------

def test_a_taken_port_fails_fast_without_loading_the_model(monkeypatch, capsys):
    def load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(launch, "LLMEngine", load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        rc = main(["serve", "--device", "cpu", "--port", str(port)])
        elapsed = time.monotonic() - t0
    assert rc == 1 and elapsed < 5
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.startswith("moelora ")]
    assert lines == [f"moelora serve: error: cannot listen on 127.0.0.1:{port}: address already in use (another "
                     f"server?): stop it or pick another --port"], err


def test_a_free_port_passes_the_check():
    launch.check_bind("127.0.0.1", launch.free_port())


# ---- logging ---------------------------------------------------------------------------------------------------------

def test_configure_logging_prints_moelora_lines_at_the_level(capsys):
    launch.configure_logging("info")
    launch.configure_logging("info")  # once more: still one handler
    logging.getLogger("moelora.adapters").info("loaded adapter %r", "sql")
    logging.getLogger("moelora.adapters").debug("not shown at info")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d moelora\.adapters: loaded adapter 'sql'", err[0]), err
    launch.configure_logging("warning")
    logging.getLogger("moelora.adapters").info("not shown at warning")
    logging.getLogger("moelora.adapters").warning("evicted")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING ") and err[0].endswith("moelora.adapters: evicted"), err


class _FakeServer:
    configs: list = []

    def __init__(self, config) -> None:
        self.configs.append(config)
        self.should_exit = False

    def run(self) -> None:
        pass


def _serve_without_a_model(monkeypatch, *argv: str):
    """main(["serve", ...]) with the engine and uvicorn's server replaced: returns the uvicorn.Config it built."""
    import uvicorn

    async def asgi(scope, receive, send):
        pass

    eng = types.SimpleNamespace(list_adapters=lambda: [], device="cpu", workers=None, shutdown=lambda: None)
    engine = types.SimpleNamespace(engine=eng, start=lambda: None, fatal_error=None, on_fatal=None)
    asgi.state = types.SimpleNamespace(settings=types.SimpleNamespace(served_model_name="m"))
    monkeypatch.setattr(launch, "build_from_args", lambda args: (engine, asgi))
    _FakeServer.configs = []
    monkeypatch.setattr(uvicorn, "Server", _FakeServer)
    assert main(["serve", "--device", "cpu", "--port", str(launch.free_port()), *argv]) == 0
    return _FakeServer.configs[0]


def test_log_level_sets_moelora_and_uvicorn_levels_and_the_access_log(monkeypatch):
    cfg = _serve_without_a_model(monkeypatch)  # vLLM's default: info, one line per request
    assert (cfg.log_level, cfg.access_log) == ("info", True)
    assert logging.getLogger("moelora").level == logging.INFO
    cfg = _serve_without_a_model(monkeypatch, "--log-level", "warning")
    assert (cfg.log_level, cfg.access_log) == ("warning", False)
    assert logging.getLogger("moelora").level == logging.WARNING
    cfg = _serve_without_a_model(monkeypatch, "--log-level", "debug", "--disable-uvicorn-access-log")
    assert (cfg.log_level, cfg.access_log) == ("debug", False)
    assert logging.getLogger("moelora").level == logging.DEBUG
    cfg = _serve_without_a_model(monkeypatch, "--log-level", "error", "--uvicorn-log-level", "info")
    assert (cfg.log_level, cfg.access_log) == ("info", True)
    assert logging.getLogger("moelora").level == logging.ERROR


def test_server_thread_stays_quiet_unless_asked():
    engine = types.SimpleNamespace()

    async def asgi(scope, receive, send):
        pass

    quiet = launch.ServerThread(engine, asgi)
    assert (quiet.server.config.log_level, quiet.server.config.access_log) == ("warning", False)
    loud = launch.ServerThread(engine, asgi, log_level="info")
    assert (loud.server.config.log_level, loud.server.config.access_log) == ("info", True)


# ---- end to end: a vLLM command line serves the demo model with its adapters ---------------------------------------

def test_a_vllm_command_line_serves_the_adapters():
    import httpx

    upper = adapter_paths()["upper"]
    args = build_parser().parse_args([
        "serve", model_path(), "--device", "cpu", "--enable-lora", "--served-model-name", "base",
        "--lora-modules", f"sql={upper}", json.dumps({"name": "chat", "path": upper, "base_model_name": "base"}),
        "--max-loras", "2", "--max-cpu-loras", "4", "--max-model-len", "128", "--max-num-seqs", "4"])
    engine, app = launch.build_from_args(args)
    srv = launch.ServerThread(engine, app).start()
    try:
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert {m["id"]: m["parent"] for m in models} == {"base": None, "sql": "base", "chat": "base"}
        assert models[0]["max_model_len"] == 128
        out = httpx.post(srv.url + "/v1/completions", json={"model": "sql", "prompt": "hello world => ",
                                                              "max_tokens": 16, "temperature": 0}).json()
        assert out["choices"][0]["text"].startswith("HELLO WORLD")
    finally:
        srv.stop()
