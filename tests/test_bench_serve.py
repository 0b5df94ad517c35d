"""`moelora bench serve`'s load generator against a tiny fake OpenAI-compatible server on 127.0.0.1.

The fake server (a ThreadingHTTPServer in a thread) serves GET /v1/models, GET /metrics and
POST /v1/completions. Per model: "base"/"upper" stream `max_tokens` content chunks (after one empty
role-like chunk), then a usage chunk reporting 2 tokens per chunk, then [DONE]; "bad" answers 500;
"garbled" sends a non-JSON data line; "truncated" never sends [DONE]. With `kv` set (see _FakeServer.kv_text) its
/metrics also has the free-block, lowest-free-block and LoRA-slots-in-use gauges of a KV cache that each running
request takes 10 blocks of. The last tests run the load against a real `moelora serve` of the demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moelora.bench import serve

METRICS_TEXT = """\
# HELP moelora_kv_blocks_used KV-cache blocks in use
# TYPE moelora_kv_blocks_used gauge
moelora_kv_blocks_used 12.0
# HELP moelora_kv_blocks_total KV-cache blocks
# TYPE moelora_kv_blocks_total gauge
moelora_kv_blocks_total 1024.0
# HELP moelora_lora_slots_used LoRA slots holding an adapter
# TYPE moelora_lora_slots_used gauge
moelora_lora_slots_used{state="loaded"} 3.0
# HELP moelora_num_requests_running Requests in the running batch
# TYPE moelora_num_requests_running gauge
moelora_num_requests_running 0.0
# HELP moelora_num_requests_waiting Requests waiting
# TYPE moelora_num_requests_waiting gauge
moelora_num_requests_waiting 0.0
# HELP moelora_prompt_tokens Prompt tokens processed
# TYPE moelora_prompt_tokens counter
moelora_prompt_tokens_total 4242.0
"""

NORMAL_MODELS = ("base", "upper")


class _Handler(BaseHTTPRequestHandler):
    server: "_FakeServer"

    def log_message(self, *a):  # keep test output quiet
        pass

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._json(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
        return False

    def do_GET(self):
        if self.path == "/v1/models":
            if self._authorized():
                self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in NORMAL_MODELS]})
        elif self.path == "/metrics":
            if self.server.metrics is None:
                self._json(404, {"detail": "Not Found"})
                return
            data = (self.server.metrics + self.server.kv_text()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with self.server.lock:
            self.server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.path != "/v1/completions":
            self._json(404, {"detail": "Not Found"})
            return
        if not self._authorized():
            return
        model, n = body.get("model"), int(body.get("max_tokens", 4))
        if model == "bad":
            self._json(500, {"error": {"message": "injected failure", "type": "internal_error"}})
            return
        if model not in (*NORMAL_MODELS, "garbled", "truncated"):
            self._json(404, {"error": {"message": f"model {model!r} not found"}})
            return
        self.server.request_started()
        try:
            self._complete(body, model, n)
        finally:
            self.server.request_ended()

    def _complete(self, body, model, n):
        if not body.get("stream"):
            self._json(200, {"id": "cmpl-1", "object": "text_completion", "model": model,
                             "choices": [{"index": 0, "text": "ab" * n, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 2 * n, "total_tokens": 5 + 2 * n}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def chunk(text, finish=None):
            return {"id": "cmpl-1", "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

        try:
            self.wfile.write(b"data: " + json.dumps(chunk("")).encode() + b"\n\n")
            if model == "garbled":
                self.wfile.write(b"data: {this is not json\n\n")
                return
            for i in range(n):
                time.sleep(self.server.chunk_delay)
                self.wfile.write(b"data: " + json.dumps(chunk("ab", "length" if i == n - 1 else None)).encode()
                                 + b"\n\n")
                self.wfile.flush()
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"id": "cmpl-1", "object": "text_completion", "model": model, "choices": [],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 2 * n, "total_tokens": 5 + 2 * n}}
                self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            if model != "truncated":
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            with self.server.lock:
                self.server.client_gone += 1


class _FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default listen backlog of 5 makes concurrent connects wait ~1 s

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.api_key: str | None = None
        self.metrics: str | None = METRICS_TEXT
        self.chunk_delay = 0.002
        self.requests: list[dict] = []
        self.client_gone = 0
        self.lock = threading.Lock()

        # the KV gauges (None: none): {"min_gauge": serve moelora_kv_blocks_free_min?, "free_min": its value,
        # "leak_blocks" / "leak_slots": never given back, "free_delay": seconds a finished request holds its blocks}
        self.kv: dict | None = None
        self.active = 0
        self.releases: list[float] = []  # when finished requests give their blocks back

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def _held(self) -> tuple[int, int]:
        """(KV blocks, LoRA slots in use) now (lock held)."""
        now = time.monotonic()
        busy = self.active + sum(t > now for t in self.releases)
        return 10 * busy + self.kv.get("leak_blocks", 0), min(busy, 1) + self.kv.get("leak_slots", 0)

    def request_started(self) -> None:
        with self.lock:
            self.active += 1
            if self.kv is not None:
                self.kv["free_min"] = min(self.kv.get("free_min", 1024), 1024 - self._held()[0])

    def request_ended(self) -> None:
        with self.lock:
            self.active -= 1
            if self.kv is not None:
                self.releases.append(time.monotonic() + self.kv.get("free_delay", 0.0))

    def kv_text(self) -> str:
        if self.kv is None:
            return ""
        with self.lock:
            blocks, slots = self._held()
            lines = [f"moelora_kv_blocks_free {1024.0 - blocks}", f"moelora_lora_slots_in_use {float(slots)}"]
            if self.kv.get("min_gauge"):
                lines.append(f"moelora_kv_blocks_free_min {float(self.kv.get('free_min', 1024))}")
        return "".join(f"# TYPE {ln.split()[0]} gauge\n{ln}\n" for ln in lines)


@pytest.fixture
def fake_server():
    srv = _FakeServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_add_arguments_defaults_and_existing_out():
    a = _args()
    assert a.url == "http://127.0.0.1:8000" and a.api_key is None and a.models is None
    assert a.concurrency == 16 and a.num_requests is None and a.duration is None
    assert a.prompt_len is None and a.disconnect_fraction == 0 and a.stream is True
    assert a.temperature == 0 and a.out == "bench/results"
    assert _args("--no-stream").stream is False
    # a parser that already has --out (like `moelora bench`) keeps its own
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="elsewhere")
    serve.add_arguments(p)
    assert p.parse_args([]).out == "elsewhere"


def test_specs_are_deterministic_and_demo_format():
    from moelora.demo import MAX_LEN, MIN_LEN, SEPARATOR

    specs = [serve.build_spec(i, ["a", "b"], None, (4, 9), 0.5, True, seed=7) for i in range(50)]
    again = [serve.build_spec(i, ["a", "b"], None, (4, 9), 0.5, True, seed=7) for i in range(50)]
    assert specs == again
    for s in specs:
        assert s.prompt.endswith(SEPARATOR)
        text = s.prompt[: -len(SEPARATOR)]
        assert MIN_LEN <= len(text) <= MAX_LEN and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
        assert 4 <= s.max_tokens <= 9
        assert s.disconnect_after is None or 1 <= s.disconnect_after <= 3
    assert [s.model for s in specs[:4]] == ["a", "b", "a", "b"]
    assert 0 < sum(s.disconnect_after is not None for s in specs) < 50
    words = serve.build_spec(0, ["a"], (10, 10), (1, 1), 0.0, True, seed=1).prompt
    assert len(words[: -len(SEPARATOR)].split(" ")) == 10
    # no disconnects without streaming
    assert all(serve.build_spec(i, ["a"], None, (1, 1), 1.0, False, 0).disconnect_after is None for i in range(10))
    assert serve.parse_range("3:5") == (3, 5) and serve.parse_range("4") == (4, 4)
    with pytest.raises(ValueError):
        serve.parse_range("5:3")


def test_streaming_load_counts_disconnects_and_metrics(fake_server):
    fake_server.api_key = "sk-test"
    n, seed, out_len = 24, 3, 5
    args = _args("--url", fake_server.url, "--api-key", "sk-test", "--num-requests", str(n), "--concurrency", "4",
                 "--disconnect-fraction", "0.5", "--output-len", f"{out_len}:{out_len}", "--seed", str(seed),
                 "--metrics-interval", "0.05")
    serve_models = ["base", "upper"]
    specs = [serve.build_spec(i, serve_models, None, (out_len, out_len), 0.5, True, seed)
             for i in range(n)]
    disc_specs = [s for s in specs if s.disconnect_after is not None]
    assert 0 < len(disc_specs) < n

    s = asyncio.run(serve.run_load(args))

    assert s["config"]["models"] == serve_models  # discovered through GET /v1/models
    assert s["requests"] == n
    assert s["errors"] == {"count": 0, "messages": []}
    assert s["disconnected"] == len(disc_specs)
    assert s["ok"] == n - len(disc_specs)
    assert {m: c["requests"] for m, c in s["per_model"].items()} == {"base": n // 2, "upper": n // 2}
    assert sum(c["disconnected"] for c in s["per_model"].values()) == len(disc_specs)
    # ok: tokens from the usage chunk (2 per chunk); disconnected: the content chunks received
    assert s["output_tokens"] == s["ok"] * 2 * out_len + sum(x.disconnect_after for x in disc_specs)
    assert s["ttft_ms"]["n"] == n and s["ttft_ms"]["p50"] > 0
    assert s["tpot_ms"]["n"] == s["ok"] and s["tpot_ms"]["p99"] >= s["tpot_ms"]["p50"] >= 0
    assert s["latency_ms"]["n"] == s["ok"] and s["latency_ms"]["p50"] >= s["ttft_ms"]["p50"] * 0.5
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0 and s["duration_s"] > 0
    # what the server was sent
    posts = [r for r in fake_server.requests if r["path"] == "/v1/completions"]
    assert len(posts) == n
    assert all(r["auth"] == "Bearer sk-test" for r in posts)
    for r in posts:
        b = r["body"]
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["max_tokens"] == out_len and b["temperature"] == 0 and b["model"] in serve_models
        assert b["prompt"].endswith(" => ")
    # /metrics: the kv_blocks / lora_slots / running / waiting families, nothing else
    m = s["metrics"]
    assert set(m) == {"moelora_kv_blocks_used", "moelora_kv_blocks_total", "moelora_lora_slots_used",
                      "moelora_num_requests_running", "moelora_num_requests_waiting"}
    assert m["moelora_kv_blocks_used"] == {"moelora_kv_blocks_used": 12.0}
    assert m["moelora_lora_slots_used"] == {'moelora_lora_slots_used{state="loaded"}': 3.0}
    assert s["metrics_error"] is None
    assert s["metrics_peak"]["moelora_kv_blocks_total"]["moelora_kv_blocks_total"] == 1024.0


def test_errors_are_counted(fake_server):
    args = _args("--url", fake_server.url, "--models", "base,bad,garbled,truncated", "--num-requests", "8",
                 "--concurrency", "3", "--output-len", "3:3")
    s = asyncio.run(serve.run_load(args))
    assert s["requests"] == 8 and s["ok"] == 2 and s["disconnected"] == 0
    assert s["errors"]["count"] == 6
    msgs = s["errors"]["messages"]
    assert len(msgs) == 6
    assert sum("HTTP 500" in x and "injected failure" in x for x in msgs) == 2
    assert sum("malformed SSE" in x for x in msgs) == 2
    assert sum("[DONE]" in x for x in msgs) == 2
    assert s["per_model"]["bad"] == {"requests": 2, "ok": 0, "errors": 2, "disconnected": 0, "output_tokens": 0}
    assert s["per_model"]["base"]["ok"] == 2


def test_error_messages_capped_and_bad_key(fake_server):
    fake_server.api_key = "right"
    args = _args("--url", fake_server.url, "--api-key", "wrong", "--models", "base", "--num-requests", "15",
                 "--concurrency", "5", "--disconnect-fraction", "1")
    s = asyncio.run(serve.run_load(args))
    # a failing request that was meant to disconnect is still an error: it never got a chunk
    assert s["errors"]["count"] == 15 and s["disconnected"] == 0 and s["ok"] == 0
    assert len(s["errors"]["messages"]) == 10 and "HTTP 401" in s["errors"]["messages"][0]


def test_all_disconnect(fake_server):
    args = _args("--url", fake_server.url, "--num-requests", "10", "--concurrency", "10",
                 "--disconnect-fraction", "1", "--output-len", "20:20")
    fake_server.chunk_delay = 0.01
    s = asyncio.run(serve.run_load(args))
    assert s["disconnected"] == 10 and s["errors"]["count"] == 0 and s["ok"] == 0
    assert s["ttft_ms"]["n"] == 10 and s["tpot_ms"]["n"] == 0
    assert 10 <= s["output_tokens"] <= 30


def test_no_stream(fake_server):
    args = _args("--url", fake_server.url, "--no-stream", "--num-requests", "6", "--concurrency", "2",
                 "--output-len", "4:4", "--disconnect-fraction", "0.5")
    s = asyncio.run(serve.run_load(args))
    assert s["ok"] == 6 and s["errors"]["count"] == 0 and s["disconnected"] == 0
    assert s["output_tokens"] == 6 * 8
    assert s["latency_ms"]["n"] == 6 and s["ttft_ms"]["n"] == 0
    assert all(r["body"]["stream"] is False and "stream_options" not in r["body"] for r in fake_server.requests)


def test_duration_mode_and_missing_metrics(fake_server):
    fake_server.metrics = None  # /metrics answers 404: tolerated
    args = _args("--url", fake_server.url, "--duration", "0.4", "--concurrency", "4", "--output-len", "3:3")
    t0 = time.perf_counter()
    s = asyncio.run(serve.run_load(args))
    assert time.perf_counter() - t0 < 5
    assert s["requests"] > 4 and s["errors"]["count"] == 0 and s["ok"] == s["requests"]
    assert s["config"]["num_requests"] is None
    assert s["metrics"] == {} and "404" in s["metrics_error"] and s["metrics_peak"] == {}
    assert "none" in serve.format_table(s)


def test_unreachable_server_main_returns_1(tmp_path):
    # a port nobody listens on: model discovery fails cleanly
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = _args("--url", f"http://127.0.0.1:{port}", "--num-requests", "2", "--out", str(tmp_path))
    assert serve.main(args) == 1
    assert os.listdir(tmp_path) == []


def test_main_writes_json(fake_server, tmp_path, capsys):
    out = tmp_path / "ok"
    args = _args("--url", fake_server.url, "--num-requests", "6", "--concurrency", "3", "--output-len", "2:4",
                 "--out", str(out))
    assert serve.main(args) == 0
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "base" in printed and "moelora_kv_blocks_used" in printed
    (path,) = glob.glob(str(out / "serve-*.json"))
    data = json.load(open(path))
    assert data["kind"] == "serve" and data["requests"] == 6 and data["ok"] == 6
    assert {"date", "device", "commit", "metrics", "per_model", "ttft_ms", "tpot_ms", "latency_ms"} <= set(data)

    out = tmp_path / "err"
    args = _args("--url", fake_server.url, "--models", "base,bad", "--num-requests", "4", "--out", str(out))
    assert serve.main(args) == 1
    (path,) = glob.glob(str(out / "serve-*.json"))
    data = json.load(open(path))
    assert data["errors"]["count"] == 2 and "HTTP 500" in data["errors"]["messages"][0]


def test_module_standalone(fake_server, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "moelora.bench.serve", "--url", fake_server.url,
                           "--num-requests", "4", "--concurrency", "2", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    assert len(glob.glob(str(tmp_path / "serve-*.json"))) == 1


def test_parse_metrics_fallback_matches(monkeypatch):
    expected = serve.parse_metrics(METRICS_TEXT)
    assert serve.parse_metrics("") == {}
    import builtins

    real_import = builtins.__import__

    def no_prom(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_prom)
    assert serve.parse_metrics(METRICS_TEXT) == expected


# --------------------------------------------------------------------------------------------- progress

def test_progress_on_stderr_never_in_json(fake_server, tmp_path, capsys):
    """A tqdm bar on stderr while the load runs (off with --no-progress); stdout's table and the JSON carry none."""
    pytest.importorskip("tqdm")
    args = _args("--url", fake_server.url, "--num-requests", "6", "--concurrency", "2", "--output-len", "2:2",
                 "--out", str(tmp_path / "on"))
    assert serve.main(args) == 0
    out, err = capsys.readouterr()
    assert "bench serve" in err and "6/6" in err and "ok=6" in err
    assert "6/6" not in out
    (path,) = glob.glob(str(tmp_path / "on" / "serve-*.json"))
    assert "bench serve" not in open(path).read() and "progress" not in json.load(open(path))["config"]

    args = _args("--url", fake_server.url, "--num-requests", "6", "--concurrency", "2", "--output-len", "2:2",
                 "--out", str(tmp_path / "off"), "--no-progress")
    assert serve.main(args) == 0
    assert capsys.readouterr().err == ""


def test_progress_without_tqdm_prints_lines(fake_server, tmp_path, capsys, monkeypatch):
    """Without tqdm: a line on stderr every few seconds and one at the end."""
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm" or name.startswith("tqdm."):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    args = _args("--url", fake_server.url, "--models", "base,bad", "--num-requests", "6", "--concurrency", "2",
                 "--output-len", "2:2", "--out", str(tmp_path))
    assert serve.main(args) == 1
    err = capsys.readouterr().err
    assert "bench serve: 6/6 requests (ok 3, errors 3, disconnected 0)" in err

    p = serve.Progress(total=None, duration=10.0, every=0.0)
    p.update(serve.RequestResult(index=0, model="m", status="ok"))
    p.tick()
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("bench serve: 1 requests (ok 1,") and "s left" in lines[0]
    serve.Progress(total=3, duration=None, enabled=False).close()
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------------------------- KV cache, leaks

def _kv_run(fake_server, *extra: str) -> dict:
    fake_server.chunk_delay = 0.01
    args = _args("--url", fake_server.url, "--num-requests", "12", "--concurrency", "4", "--output-len", "5:5",
                 "--metrics-interval", "0.01", "--no-progress", *extra)
    return asyncio.run(serve.run_load(args))


def test_kv_min_free_from_the_server_gauge(fake_server):
    """The fewest free KV blocks of the run: the server's moelora_kv_blocks_free_min, read after the run (a
    polled peak of the free count only ever showed the total); used at peak = total - min free."""
    fake_server.kv = {"min_gauge": True}
    s = _kv_run(fake_server)
    kv = s["kv_cache"]
    lowest = fake_server.kv["free_min"]
    assert lowest < 1024
    assert kv == {"blocks_total": 1024, "blocks_free_min": lowest, "blocks_used_peak": 1024 - lowest,
                  "blocks_free_min_source": "server", "blocks_free_after": 1024}
    assert s["kv_blocks_leaked"] == 0 and s["lora_slots_leaked"] == 0
    assert "moelora_kv_blocks_free" not in s["metrics_peak"]  # the peak of a free count says nothing
    assert s["metrics"]["moelora_kv_blocks_free_min"] == {"moelora_kv_blocks_free_min": float(lowest)}
    table = serve.format_table(s)
    assert f"min free during the run {lowest} (used at peak {1024 - lowest}" in table
    assert "KV blocks leaked 0, LoRA slots leaked 0" in table and "LEAK" not in table


def test_kv_min_free_polled_without_the_gauge_or_with_an_older_low(fake_server):
    """A server without moelora_kv_blocks_free_min: the polled minimum of moelora_kv_blocks_free. A server whose
    lowest mark predates the run (an earlier, heavier load): not that mark, the polled minimum of this run."""
    fake_server.kv = {"min_gauge": False}
    s = _kv_run(fake_server)
    kv = s["kv_cache"]
    assert kv["blocks_free_min_source"] == "polled" and 1024 - 40 <= kv["blocks_free_min"] < 1024
    assert kv["blocks_used_peak"] == 1024 - kv["blocks_free_min"] and kv["blocks_total"] == 1024
    assert "upper bound" in serve.format_table(s)

    fake_server.kv = {"min_gauge": True, "free_min": 500}
    s = _kv_run(fake_server)
    assert fake_server.kv["free_min"] == 500
    assert s["kv_cache"]["blocks_free_min_source"] == "polled"
    assert 1024 - 40 <= s["kv_cache"]["blocks_free_min"] < 1024


def test_kv_without_free_gauges(fake_server):
    """The gauges a server lacks are None, not invented."""
    s = _kv_run(fake_server)
    assert s["kv_cache"] == {"blocks_total": 1024, "blocks_free_min": None, "blocks_used_peak": None,
                             "blocks_free_min_source": None, "blocks_free_after": None}
    assert s["kv_blocks_leaked"] is None and s["lora_slots_leaked"] is None


def test_leaks_wait_for_asynchronous_frees(fake_server):
    """Blocks freed a moment after the last request (aborts are freed asynchronously) are no leak: the load waits
    for them (up to --settle-timeout)."""
    fake_server.kv = {"min_gauge": True, "free_delay": 0.5}
    t0 = time.perf_counter()
    s = _kv_run(fake_server, "--disconnect-fraction", "0.5")
    assert time.perf_counter() - t0 >= 0.5
    assert s["kv_blocks_leaked"] == 0 and s["lora_slots_leaked"] == 0 and s["kv_cache"]["blocks_free_after"] == 1024
    assert s["duration_s"] < time.perf_counter() - t0  # the wait is not part of the run's time


def test_leaks_are_reported(fake_server, tmp_path, capsys):
    """Blocks and slots still held after --settle-timeout: kv_blocks_leaked / lora_slots_leaked in the JSON."""
    fake_server.kv = {"min_gauge": True, "leak_blocks": 8, "leak_slots": 1}
    t0 = time.perf_counter()
    args = _args("--url", fake_server.url, "--num-requests", "4", "--concurrency", "2", "--output-len", "2:2",
                 "--settle-timeout", "0.3", "--no-progress", "--out", str(tmp_path))
    assert serve.main(args) == 0
    assert time.perf_counter() - t0 >= 0.3
    assert "LEAK after the run: KV blocks leaked 8, LoRA slots leaked 1" in capsys.readouterr().out
    (path,) = glob.glob(str(tmp_path / "serve-*.json"))
    data = json.load(open(path))
    assert data["kv_blocks_leaked"] == 8 and data["lora_slots_leaked"] == 1
    assert data["kv_cache"]["blocks_free_after"] == 1016


def test_kv_summary_arithmetic():
    def m(free=None, total=1024.0, low=None):
        out = {"moelora_kv_blocks_total": {"moelora_kv_blocks_total": total}}
        if free is not None:
            out["moelora_kv_blocks_free"] = {"moelora_kv_blocks_free": free}
        if low is not None:
            out["moelora_kv_blocks_free_min"] = {"moelora_kv_blocks_free_min": low}
        return out

    lows = {"moelora_kv_blocks_free": {"moelora_kv_blocks_free": 900.0}}
    # the run lowered the server's mark: exact
    assert serve.kv_summary(m(1024, low=1024), m(1024, low=700), lows)["blocks_free_min"] == 700
    # the mark predates the run and the polls saw less use: the polled minimum
    k = serve.kv_summary(m(1024, low=600), m(1024, low=600), lows)
    assert (k["blocks_free_min"], k["blocks_free_min_source"]) == (900, "polled")
    # the polls caught the mark itself
    k = serve.kv_summary(m(1024, low=900), m(1024, low=900), lows)
    assert (k["blocks_free_min"], k["blocks_free_min_source"], k["blocks_used_peak"]) == (900, "server", 124)
    assert serve.leaks(m(1000)) == (24, None) and serve.leaks(None) == (None, None)


# --------------------------------------------------------------------------------------------- result files

def test_a_second_run_does_not_overwrite_the_first(fake_server, tmp_path, capsys):
    """Two runs the same day into one folder: two files, each path printed, the first one's result intact."""
    paths = []
    for n in (3, 5):
        args = _args("--url", fake_server.url, "--num-requests", str(n), "--concurrency", "2", "--output-len", "2:2",
                     "--no-progress", "--out", str(tmp_path))
        assert serve.main(args) == 0
        paths.append(capsys.readouterr().out.rsplit("wrote ", 1)[1].strip())
    assert paths[0] != paths[1] and paths[1].endswith("-2.json")
    assert sorted(glob.glob(str(tmp_path / "serve-*.json"))) == sorted(paths)
    assert [json.load(open(p))["requests"] for p in paths] == [3, 5]


# --------------------------------------------------------------------------------------------- a real server

@pytest.fixture(scope="module")
def demo_server():
    """`moelora serve` of the bundled demo model on the CPU, in this process."""
    from moelora.server.launch import ServerThread, add_arguments, build_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    engine, app = build_from_args(p.parse_args(["--device", "cpu", "--max-num-seqs", "8"]))
    srv = ServerThread(engine, app).start()
    yield srv
    srv.stop()


def test_real_server_kv_minimum_and_no_leaks(demo_server, tmp_path):
    """Against the real server, with half the streams dropped mid-way: the KV cache's minimum of free blocks is below
    its total, and once the run settles every block and slot is free again."""
    args = _args("--url", demo_server.url, "--num-requests", "12", "--concurrency", "4", "--output-len", "8:16",
                 "--disconnect-fraction", "0.5", "--metrics-interval", "0.02", "--no-progress", "--out",
                 str(tmp_path))
    s = asyncio.run(serve.run_load(args))
    assert s["errors"]["count"] == 0 and s["ok"] + s["disconnected"] == 12 and s["disconnected"] > 0
    kv = s["kv_cache"]
    assert kv["blocks_total"] > 0 and kv["blocks_free_min_source"] in ("server", "polled")
    assert 0 <= kv["blocks_free_min"] < kv["blocks_total"]
    assert kv["blocks_used_peak"] == kv["blocks_total"] - kv["blocks_free_min"] > 0
    assert kv["blocks_free_after"] == kv["blocks_total"]
    assert s["kv_blocks_leaked"] == 0 and s["lora_slots_leaked"] == 0
