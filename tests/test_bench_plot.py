"""`moelora bench plot` on files that are not `bench report` results: a one-line error naming the file and what it
is, exit status 1, no traceback, no PNG written."""

from __future__ import annotations

import json
import os

import pytest

from moelora_bench.plot import NotAReportError, plot_files, read_report
from moelora.cli import main


def _write(path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


SERVE = {"kind": "serve", "date": "2026-12-05T10:00:00+00:00", "device": "cpu", "requests": 20, "ok": 20,
         "per_model": {}, "metrics": {}}


@pytest.mark.parametrize("name, content, words", [
    ("serve-2026-12-05-cpu.json", SERVE, ["`bench serve` result", "not a `bench report` result"]),
    ("decode-2026-12-05-cpu.json", {"kind": "decode", "rows": []}, ["`bench decode` result"]),
    ("other.json", {"a": 1}, ["without a report's decode / prefill rows", "keys: a"]),
    ("list.json", [1, 2], ["JSON list"]),
    ("notes.txt", "not json at all", ["is not JSON"]),
])
def test_plot_refuses_what_is_not_a_report(tmp_path, capsys, name, content, words):
    path = _write(tmp_path / name, content)
    out = tmp_path / "png"
    assert main(["bench", "plot", path, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err
    assert err.startswith("moelora bench: error: ") and path in err
    assert "expects the JSON that `moelora bench report` writes" in err
    assert all(w in err for w in words), err
    assert not out.exists()  # nothing written, not even the folder


def test_plot_missing_file_and_mixed_files(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    assert main(["bench", "plot", missing]) == 1
    assert "cannot read" in capsys.readouterr().err
    report = _write(tmp_path / "report.json", {"kind": "report", "decode": [], "prefill": [], "notes": []})
    serve = _write(tmp_path / "serve.json", SERVE)
    with pytest.raises(NotAReportError, match="serve.json is a `bench serve` result"):
        plot_files([report, serve], str(tmp_path / "png"))
    assert not (tmp_path / "png").exists()
    assert read_report(report)["kind"] == "report"
    # a hand-made report without "kind" still plots
    assert read_report(_write(tmp_path / "hand.json", {"decode": [], "prefill": []}))["decode"] == []
    assert isinstance(NotAReportError("x"), ValueError)


def test_plot_cli_exit_status_without_traceback(tmp_path):
    """The installed command: exit status 1 and the one line on stderr."""
    import subprocess
    import sys

    path = _write(tmp_path / "serve-2026-12-05-cpu.json", SERVE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "moelora", "bench", "plot", path], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "`bench serve` result" in proc.stderr
    assert not any(p.endswith(".png") for p in os.listdir(tmp_path))
