"""`moelora bench serve`'s load generator against a tiny fake OpenAI-compatible server on 127.0.0.1.

The fake server (a ThreadingHTTPServer in a thread) serves GET /v1/models, GET /metrics and
POST /v1/completions. Per model: "base"/"upper" stream `max_tokens` content chunks (after one empty
role-like chunk), then a usage chunk reporting 2 tokens per chunk, then [DONE]; "bad" answers 500;
"garbled" sends a non-JSON data line; "truncated" never sends [DONE]. With `kv` set (see _FakeServer.kv_text) its
/metrics also has the free-block, lowest-free-block and LoRA-slots-in-use gauges of a KV cache that each running
request takes 10 blocks of. With `prefix` set it is a toy prefix cache per model (see _FakeServer.lookup): /metrics has
the moelora_prefix_cache_queries_total / _hits_total counters and every usage object
prompt_tokens_details.cached_tokens.
The last tests run the load against a real `moelora serve` of the demo model.
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

from moelora_bench import serve

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


def _counter_text(family: str, value, per_label: dict | None = None, labelled: bool = False) -> str:
    """A counter as prometheus_client's generate_latest writes it (TYPE of the `_total` name, `_created` a gauge of its
    own); labelled: one sample per adapter, none at all before the first."""
    out = f"# HELP {family}_total x\n# TYPE {family}_total counter\n"
    if labelled:
        out += "".join(f'{family}_total{{adapter="{k}"}} {float(v)}\n' for k, v in sorted((per_label or {}).items()))
        out += f"# HELP {family}_created x\n# TYPE {family}_created gauge\n"
        out += "".join(f'{family}_created{{adapter="{k}"}} 1.7e9\n' for k in sorted(per_label or {}))
    else:
        out += f"{family}_total {float(value)}\n# HELP {family}_created x\n# TYPE {family}_created gauge\n"
        out += f"{family}_created 1.7e9\n"
    return out


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
            data = (self.server.metrics + self.server.kv_text() + self.server.prefix_text()).encode()
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
        usage_obj = {"prompt_tokens": 5, "completion_tokens": 2 * n, "total_tokens": 5 + 2 * n}
        cached = self.server.lookup(model, body.get("prompt", ""))
        if cached is not None:
            p = len(body.get("prompt", ""))
            usage_obj = {"prompt_tokens": p, "completion_tokens": 2 * n, "total_tokens": p + 2 * n,
                         "prompt_tokens_details": {"cached_tokens": cached}}
        if not body.get("stream"):
            self._json(200, {"id": "cmpl-1", "object": "text_completion", "model": model,
                             "choices": [{"index": 0, "text": "ab" * n, "finish_reason": "length"}],
                             "usage": usage_obj})
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
                         "usage": usage_obj}
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

        # the toy prefix cache (None: none): {"queries": n, "hits": n, "labels": per-model samples?}
        self.prefix: dict | None = None
        self.seen: dict[str, list[str]] = {}  # model -> the prompts it was sent

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

    def lookup(self, model: str, prompt: str) -> int | None:
        """The toy prefix cache: the prompt's characters (= tokens) that an earlier prompt of the same model began
        with too are hits; all of them are queries. Returns the hits (cached_tokens), None without a cache."""
        if self.prefix is None:
            return None
        with self.lock:
            hit = 0
            for old in self.seen.get(model, []):
                hit = max(hit, len(os.path.commonprefix([old, prompt])))
            self.seen.setdefault(model, []).append(prompt)
            self.prefix["queries"] += len(prompt)
            self.prefix["hits"] += hit
            self.prefix.setdefault("per_model", {}).setdefault(model, [0, 0])
            self.prefix["per_model"][model][0] += len(prompt)
            self.prefix["per_model"][model][1] += hit
            return hit

    def prefix_text(self) -> str:
        """The counters as a prometheus_client Counter writes them; with "labels", one sample per model."""
        if self.prefix is None:
            return ""
        with self.lock:
            per_model = self.prefix.get("per_model", {})
            return "".join(_counter_text(f"moelora_prefix_cache_{name}", self.prefix[name],
                                           {m: c[i] for m, c in per_model.items()}, bool(self.prefix.get("labels")))
                           for i, name in enumerate(("queries", "hits")))

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
    assert a.temperature == 0 and a.out == "bench/results" and a.shared_prefix_len == 0
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
    proc = subprocess.run([sys.executable, "-m", "moelora_bench.serve", "--url", fake_server.url,
                           "--num-requests", "4", "--concurrency", "2", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    assert len(glob.glob(str(tmp_path / "serve-*.json"))) == 1


def test_parse_metrics_fallback_matches(monkeypatch):
    texts = [METRICS_TEXT, _prefix_metrics(7, 3), _prefix_metrics(labels={}),
             _prefix_metrics(labels={"a": {"queries": 6, "hits": 2}, "b": {"queries": 4, "hits": 1}})]
    expected = [serve.parse_metrics(t) for t in texts]
    assert expected[1]["moelora_prefix_cache_hits"] == {"moelora_prefix_cache_hits_total": 3.0}
    assert serve.parse_metrics("") == {}
    import builtins

    real_import = builtins.__import__

    def no_prom(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_prom)
    assert [serve.parse_metrics(t) for t in texts] == expected


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


# --------------------------------------------------------------------------------------------- prefix cache

def test_shared_prefixes_per_model_deterministic_and_lengths():
    """Each model its own prefix, the same for every request of it, fixed by --seed; N characters (the demo
    tokenizer's tokens) by default, N words with --prompt-len; the request's own prompt after it unchanged."""
    models = ["base", "upper", "reverse", "rot13"]
    p = serve.shared_prefixes(models, 1000, seed=5)
    assert list(p) == models and len(set(p.values())) == 4  # different across models
    for text in p.values():
        assert len(text) == 1000 and text.endswith(" ") and not text.startswith(" ") and "  " not in text
        assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ") and len(text.split()) > 100
    assert serve.shared_prefixes(models, 1000, seed=5) == p  # deterministic
    assert serve.shared_prefixes(["rot13"], 1000, seed=5) == {"rot13": p["rot13"]}  # not by the other models
    other = serve.shared_prefixes(models, 1000, seed=6)
    assert all(other[m] != p[m] for m in models)
    for n in range(1, 40):  # every length exact, never a double space where the cut fell
        t = serve.shared_prefix("m", n, seed=n)
        assert len(t) == n and t.endswith(" ") and "  " not in t
    words = serve.shared_prefixes(models, 50, seed=5, words=True)
    assert all(len(t.split(" ")) == 51 and t.endswith(" ") for t in words.values()) and len(set(words.values())) == 4
    assert serve.shared_prefixes(models, 0, seed=5) == {} and serve.shared_prefix("m", 0, 5) == ""

    for prompt_len in (None, (4, 8)):
        pre = serve.shared_prefixes(["a", "b"], 64, seed=2, words=prompt_len is not None)
        for i in range(12):
            plain = serve.build_spec(i, ["a", "b"], prompt_len, (4, 9), 0.3, True, seed=2)
            shared = serve.build_spec(i, ["a", "b"], prompt_len, (4, 9), 0.3, True, seed=2, prefixes=pre)
            assert shared.prompt == pre[shared.model] + plain.prompt
            assert (shared.model, shared.max_tokens, shared.disconnect_after) == (
                plain.model, plain.max_tokens, plain.disconnect_after)


def _prefix_metrics(queries=None, hits=None, labels: dict | None = None) -> str:
    out = METRICS_TEXT
    for name, v in (("queries", queries), ("hits", hits)):
        if v is None and labels is None:
            continue
        out += _counter_text(f"moelora_prefix_cache_{name}", v, labels and {k: c[name] for k, c in labels.items()},
                             labelled=labels is not None)
    return out



def test_prefix_cache_summary_arithmetic(monkeypatch):
    """hit_rate = the hits' growth over the queries' growth during the run; None where the server has no counters,
    looked nothing up or restarted; cached_tokens_reported: the sum over the responses that carried it."""
    R = serve.RequestResult
    results = [R(0, "a", "ok", prompt_tokens=110, cached_tokens=96),
               R(1, "b", "ok", prompt_tokens=105, cached_tokens=0),
               R(2, "a", "disconnected"), R(3, "b", "ok", prompt_tokens=120, cached_tokens=112)]

    def check():
        pm = serve.parse_metrics
        pc = serve.prefix_cache_summary(pm(_prefix_metrics(100, 40)), pm(_prefix_metrics(1100, 790)), results)
        assert pc == {"queries": 1000, "hits": 750, "hit_rate": 0.75, "cached_tokens_reported": 208,
                      "prompt_tokens_reported": 335}
        # 1/3: rounded to 4 places
        assert serve.prefix_cache_summary(pm(_prefix_metrics(0, 0)), pm(_prefix_metrics(300, 100)), [])["hit_rate"] \
            == 0.3333
        # labelled per adapter: summed; a labelled counter with no sample yet counts 0
        after = pm(_prefix_metrics(labels={"a": {"queries": 60, "hits": 30}, "b": {"queries": 40, "hits": 10}}))
        pc = serve.prefix_cache_summary(pm(_prefix_metrics(labels={})), after, [])
        assert (pc["queries"], pc["hits"], pc["hit_rate"], pc["cached_tokens_reported"]) == (100, 40, 0.4, None)
        # nothing looked up (caching off): no rate
        pc = serve.prefix_cache_summary(pm(_prefix_metrics(50, 20)), pm(_prefix_metrics(50, 20)), results)
        assert (pc["queries"], pc["hits"], pc["hit_rate"]) == (0, 0, None)
        # a server without the counters, or one restarted mid-run, or no /metrics at all
        none = {"queries": None, "hits": None, "hit_rate": None, "cached_tokens_reported": None,
                "prompt_tokens_reported": None}
        assert serve.prefix_cache_summary(pm(METRICS_TEXT), pm(METRICS_TEXT), []) == none
        assert serve.prefix_cache_summary(None, None, [R(0, "a", "ok")]) == none
        pc = serve.prefix_cache_summary(pm(_prefix_metrics(500, 400)), pm(_prefix_metrics(30, 10)), [])
        assert (pc["queries"], pc["hits"], pc["hit_rate"]) == (None, None, None)
        pc = serve.prefix_cache_summary(pm(METRICS_TEXT), pm(_prefix_metrics(30, 10)), [])
        assert pc["hit_rate"] is None

    check()
    import builtins  # the same without prometheus_client (the fallback parser)

    real_import = builtins.__import__

    def no_prom(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_prom)
    check()


@pytest.mark.parametrize("stream,labels,prompt_len", [(True, False, None), (False, True, None), (True, False, "3:5")])
def test_shared_prefix_load_reports_hit_rate(fake_server, stream, labels, prompt_len):
    """Against the toy prefix cache: every prompt begins with its model's prefix; queries / hits are the counters'
    growth during the run (not their totals), and the cached tokens the responses reported add up to the hits."""
    n, seed, plen = 16, 4, 60
    fake_server.prefix = {"queries": 5000, "hits": 1000, "labels": labels}
    if labels:
        fake_server.prefix["per_model"] = {"old": [5000, 1000]}  # an earlier run's, not this one's
    extra = ["--prompt-len", prompt_len] if prompt_len else []
    args = _args("--url", fake_server.url, "--num-requests", str(n), "--concurrency", "4", "--output-len", "2:3",
                 "--seed", str(seed), "--shared-prefix-len", str(plen), "--no-progress",
                 *(["--stream"] if stream else ["--no-stream"]), *extra)
    s = asyncio.run(serve.run_load(args))
    assert s["ok"] == n and s["errors"]["count"] == 0

    words = prompt_len is not None
    cfg = s["config"]
    assert cfg["shared_prefix_len"] == plen and cfg["shared_prefix_unit"] == ("words" if words else "chars")
    assert cfg["shared_prefix_tokens"] == {"base": None, "upper": None}  # the fake has no /tokenize
    prefixes = serve.shared_prefixes(["base", "upper"], plen, seed, words=words)
    posts = [r["body"] for r in fake_server.requests if r["path"] == "/v1/completions"]
    assert len(posts) == n and all(b["prompt"].startswith(prefixes[b["model"]]) for b in posts)
    assert all(b.get("stream_options") == ({"include_usage": True} if stream else None) for b in posts)

    queries, hits = fake_server.prefix["queries"] - 5000, fake_server.prefix["hits"] - 1000
    assert queries == sum(len(b["prompt"]) for b in posts)
    assert hits >= (n - 2) * len(prefixes["base"])  # all but each model's first request hit its prefix
    assert s["prefix_cache"] == {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4),
                                 "cached_tokens_reported": hits, "prompt_tokens_reported": queries}
    table = serve.format_table(s)
    assert f"prefix cache: hit rate {100 * hits / queries:.1f}% ({hits} of {queries} prompt tokens" in table
    assert f"cached_tokens reported {hits} of {queries} prompt tokens" in table
    assert f"[shared prefix per model: {plen} {'words' if words else 'chars'}]" in table


def test_no_prefix_cache_and_ttft_in_the_table(fake_server):
    """A server without the counters or cached_tokens (and no shared prefix): every prefix-cache figure None, said so
    in the table; TTFT p50 on a line of its own near the top."""
    args = _args("--url", fake_server.url, "--num-requests", "4", "--concurrency", "2", "--output-len", "2:2",
                 "--no-progress")
    s = asyncio.run(serve.run_load(args))
    assert s["prefix_cache"] == {"queries": None, "hits": None, "hit_rate": None, "cached_tokens_reported": None,
                                 "prompt_tokens_reported": 4 * 5}  # the fake's usage: 5 prompt tokens, no details
    assert s["config"]["shared_prefix_len"] == 0 and s["config"]["shared_prefix_unit"] is None
    assert s["config"]["shared_prefix_tokens"] is None
    assert not any(r["path"] == "/tokenize" for r in fake_server.requests)
    lines = serve.format_table(s).splitlines()
    assert lines[2] == f"TTFT p50: {s['ttft_ms']['p50']:.2f} ms (p99 {s['ttft_ms']['p99']:.2f} ms)"
    assert lines[3] == ("prefix cache: hit rate - (no prefix-cache counters on /metrics); cached_tokens reported - "
                        "[no shared prefix]")
    with pytest.raises(ValueError, match="shared-prefix-len"):
        asyncio.run(serve.run_load(_args("--url", fake_server.url, "--shared-prefix-len", "-1")))


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
    # the engine's steps over this run: each of the 12 prompts computed in at least one prefill step; the streams
    # kept to the end (8+ tokens) decode in later steps, one token a request
    steps = s["steps"]
    assert set(steps) == {"prefill", "decode"}
    assert 1 <= steps["prefill"]["steps"] <= 12 and steps["decode"]["steps"] >= 7
    assert all(st["mean_ms"] > 0 for st in steps.values())
    assert s["triton_kernel_builds"] == 0  # the server's counter, read through /metrics: the CPU path runs no Triton
    assert (f"engine steps: prefill {steps['prefill']['steps']} (mean" in serve.format_table(s)
            and "Triton kernel variants built during the run: 0\n" in serve.format_table(s) + "\n")


def test_real_server_shared_prefix(demo_server):
    """Against the real server with a shared prefix per model: no errors; each prefix takes exactly N tokens (the demo
    tokenizer: one per character, counted by /tokenize); the prefix-cache figures are well-formed whether or not this
    server has a prefix cache."""
    n, plen = 8, 100
    args = _args("--url", demo_server.url, "--num-requests", str(n), "--concurrency", "4", "--output-len", "4:8",
                 "--shared-prefix-len", str(plen), "--no-progress")
    s = asyncio.run(serve.run_load(args))
    assert s["errors"]["count"] == 0 and s["ok"] == n, s["errors"]
    models = s["config"]["models"]
    assert s["config"]["shared_prefix_tokens"] == {m: plen for m in models}
    pc = s["prefix_cache"]
    assert set(pc) == {"queries", "hits", "hit_rate", "cached_tokens_reported", "prompt_tokens_reported"}
    assert pc["prompt_tokens_reported"] >= n * plen  # every response's usage has prompt_tokens
    if pc["queries"] is not None:
        assert pc["hits"] is not None and 0 <= pc["hits"] <= pc["queries"]
        assert pc["hit_rate"] is None or 0.0 <= pc["hit_rate"] <= 1.0
    if pc["cached_tokens_reported"] is not None:
        assert 0 <= pc["cached_tokens_reported"] <= pc["prompt_tokens_reported"]
    assert "prefix cache: " in serve.format_table(s)
