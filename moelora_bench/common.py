"""Shared benchmark plumbing: device facts, bandwidth ceiling, timing, result files."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time

import torch


def git_commit() -> str:
    """HEAD of the checkout, or $MOELORA_COMMIT where there is no .git (e.g. a copied tree)."""
    if os.environ.get("MOELORA_COMMIT"):
        return os.environ["MOELORA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def time_ms(fn, warmup: int = 5, rep: int = 50) -> float:
    """Median time of fn() in milliseconds (CUDA events through triton.testing.do_bench on a GPU)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    for _ in range(2):
        fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def captured_graph(fn, warm=None):
    """warm() (default fn()) run on a side stream, as CUDA graph capture asks, then fn() captured: (graph, fn's
    output in the graph's memory, rewritten by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_time_us(fn, layers: int, iters: int = 20) -> float:
    """µs per call of fn(layer), replayed from one CUDA graph of `iters` rounds over the layers (best of 5)."""
    def rounds(n: int) -> None:
        for _ in range(n):
            for li in range(layers):
                fn(li)

    g, _ = captured_graph(lambda: rounds(iters), warm=lambda: rounds(1))
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (iters * layers))
    return best


def hbm_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep=100)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def hbm_read_bandwidth_gbs(nbytes: int = 1 << 31) -> float:
    """Read-only bandwidth (GB/s): a Triton kernel summing int32 words over `nbytes`, the best of three launches
    (on the H200: 4,496 GB/s read against 4,269 copied; torch's amax over the same buffer 3,485). A decode
    step mostly reads, so this is the tighter ceiling; `bench decode` reports its floor at both."""
    from moelora_bench._read_kernel import read_words

    buf = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    best = 0.0
    for block, iters, warps in ((4096, 4, 8), (16384, 2, 16), (2048, 8, 4)):
        ms = time_ms(lambda: read_words(buf, block, iters, warps), rep=50)
        best = max(best, nbytes / (ms * 1e-3) / 1e9)
    return best


_FILE_PATHS: dict[tuple[str, str, str], str] = {}  # (kind, out_dir, suffix) -> the file this process writes


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _claim_new_path(stem: str) -> str:
    """`<stem>.json`, or where a file of that name exists `<stem>-2.json`, `<stem>-3.json`, ...: the first name no
    file has, created empty at once (O_EXCL) so that two processes starting together never take the same one."""
    n = 1
    while True:
        path = f"{stem}.json" if n == 1 else f"{stem}-{n}.json"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        return path


def write_result(kind: str, payload: dict, out_dir: str = "bench/results", suffix: str = "",
                 new_file: bool = False) -> str:
    """Write `payload` with date, device, commit, versions and the MOELORA_* variables set in the environment to
    <out_dir>/<kind>-<date>-<device><suffix>.json and return the path.

    A result never overwrites an earlier run's: this process's first write of (kind, out_dir, suffix), or any write
    with `new_file=True` (a run that writes its result once, such as `bench serve`, whose next run may be in the same
    process), takes a name no file has yet, adding -2, -3, ... before .json when an earlier run of the same day holds
    the plain name. Later writes of the same (kind, out_dir, suffix) rewrite the file the first one named: a run
    rewriting its file after each row keeps one file, across midnight too (the date is that of the first write)."""
    os.makedirs(out_dir, exist_ok=True)
    now = _utcnow()
    key = (kind, os.path.abspath(out_dir), suffix)
    path = None if new_file else _FILE_PATHS.get(key)
    if path is None:
        dev = device_name().replace(" ", "-")
        path = _FILE_PATHS[key] = _claim_new_path(os.path.join(out_dir, f"{kind}-{now:%Y-%m-%d}-{dev}{suffix}"))
    return write_json(path, kind, payload, now)


def write_json(path: str, kind: str, payload: dict, now: datetime.datetime | None = None) -> str:
    """Write `payload` to `path` after what every result file carries: kind, date (`now`, default the present),
    device, commit (git's, or $MOELORA_COMMIT), torch and Triton versions, and the MOELORA_* variables set in the
    environment (operational: docs/configuration.md; the kernels' choices are the rows' kernel_config)."""
    payload = {"kind": kind, "date": (now or _utcnow()).isoformat(timespec="seconds"), "device": device_name(),
               "commit": git_commit(), "torch": torch.__version__,
               "env_switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOELORA_")}, **payload}
    try:
        import triton

        payload["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path
