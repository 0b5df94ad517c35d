"""`moelora bench report` end to end on a tiny model on the CPU (transformers + PEFT baseline included), the
PNGs of `moelora bench plot`, and the floor / share / scaling arithmetic they rest on."""

from __future__ import annotations

import glob
import json
import os

import pytest

from moelora_bench import figures
from moelora_bench.published import KEPT, VLLM_TOKENS_PER_S, kept_value
from moelora.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def report_json(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("report"))
    # the PEFT baseline runs 1 of the tiny model's 2 layers, so the scaling path is exercised
    assert main(["bench", "report", "--tiny", "--out", out, "--hf-layers", "1", "--no-plot", "--device", "cpu",
                 "--tag", "part1"]) == 0
    (path,) = glob.glob(os.path.join(out, "report-*-cpu-part1.json"))
    return path


def test_report_json_has_every_figure(report_json):
    with open(report_json) as f:
        d = json.load(f)
    assert d["kind"] == "report" and d["device"] == "cpu" and d["commit"] and d["date"]
    assert d["ceilings"]["copy_gbs"] > 0 and d["ceilings"]["matmul_tflops"]["bf16"] > 0
    assert d["settings"]["batches"] == [1, 3] and d["settings"]["adapter_counts"] == [0, 1, 2]
    (engine,) = [e for e in d["engines"] if e["dtype"] == "bf16"]
    assert engine["max_loras"] == 2 and engine["rank"] == 4 and engine["slot_bytes"] > 0
    bf16 = [r for r in d["decode"] if r["dtype"] == "bf16"]
    assert sorted((r["batch"], r["adapters"]) for r in bf16) == [(b, n) for b in (1, 3) for n in (0, 1, 2)]
    for r in bf16:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["floor_bytes"] > 0
        assert r["floor_ms"] == pytest.approx(figures.floor_ms(r["floor_bytes"], d["ceilings"]["copy_gbs"]))
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["rank"] == (4 if r["adapters"] else 0) and r["kept"] is not None
    assert all(r["kept"] == 1.0 for r in bf16 if r["adapters"] == 0)
    # fp8: measured where the engine takes it, otherwise skipped with a note saying why
    assert any(r["dtype"] == "fp8" for r in d["decode"]) or any("fp8" in n and "refused" in n for n in d["notes"])
    assert sorted(r["adapters"] for r in d["prefill"] if r["dtype"] == "bf16") == [0, 2]
    assert all(r["tokens_per_s"] > 0 and r["flop_floor_s"] > 0 for r in d["prefill"])
    peft = d["peft"]
    assert peft["layers"] == 1 and peft["full_layers"] == 2
    assert sorted((r["batch"], r["adapters"]) for r in peft["rows"] if not r["mixed_batch"]) == [(1, 0), (1, 2), (3, 0), (3, 2)]
    for r in peft["rows"]:
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_measured"] / 2)
    assert next(r for r in peft["rows"] if (r["batch"], r["adapters"]) == (3, 2))["passes"] in (1, 2)
    assert any("1 of 2 layers" in n for n in d["notes"])


def test_plot_writes_every_png(report_json, tmp_path):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "png")
    assert main(["bench", "plot", report_json, report_json, "--out", out]) == 0  # two files merge
    files = sorted(os.listdir(out))
    assert [p.rsplit("-", 1)[1] for p in files] == ["floor.png", "kept.png", "peft.png", "summary.md", "tokens.png"]
    assert all(os.path.getsize(os.path.join(out, p)) > 10_000 for p in files if p.endswith(".png"))
    with open(os.path.join(out, next(p for p in files if p.endswith(".md")))) as f:
        table = f.read()
    assert "| batch | no adapter | 1 adapter | 2 adapters |" in table and "transformers + PEFT" in table


def test_floor_and_share_arithmetic():
    assert figures.floor_ms(4.25e9, 4250.0) == pytest.approx(1.0)  # 4.25 GB at 4,250 GB/s: 1 ms
    assert figures.floor_ms(1e9, None) is None
    assert figures.step_over_floor(3.0, 1.5) == pytest.approx(2.0)
    assert figures.step_over_floor(3.0, None) is None
    rows = [{"model": "m", "dtype": "bf16", "engine_rank": 16, "batch": 64, "adapters": 0, "tokens_per_s": 4000.0},
            {"model": "m", "dtype": "bf16", "engine_rank": 16, "batch": 64, "adapters": 4, "tokens_per_s": 3000.0},
            {"model": "m", "dtype": "bf16", "engine_rank": 64, "batch": 64, "adapters": 4, "tokens_per_s": 2000.0},
            {"model": "m", "dtype": "fp8", "engine_rank": 16, "batch": 64, "adapters": 0, "tokens_per_s": 8000.0},
            {"model": "m", "dtype": "fp8", "engine_rank": 16, "batch": 64, "adapters": 1, "tokens_per_s": 6000.0}]
    figures.add_kept(rows)
    assert [r["kept"] for r in rows] == [1.0, 0.75, None, 1.0, 0.75]  # rank-64 engine: no base row of its own
    assert figures.scale_to_layers(120.0, 6, 48) == pytest.approx(15.0)
    assert figures.split_batch(64, 4) == [16, 16, 16, 16]
    assert figures.split_batch(10, 4) == [3, 3, 2, 2]
    assert figures.split_batch(1, 8) == [1]
    # 3.3e9 active weights x 2 FLOPs x 16k tokens at 790 TFLOP/s, no attention term
    assert figures.prefill_flop_floor_s(3.3e9, 16384, 0.0, 790.0) == pytest.approx(2 * 3.3e9 * 16384 / 790e12)
    assert figures.prefill_flop_floor_s(3.3e9, 16384, 0.0, None) is None


def test_published_figures_are_well_formed():
    assert all(e["source"] and 0 < kept_value(e)[1] <= kept_value(e)[2] <= 1 for e in KEPT)
    assert kept_value({"kept": (0.54, 0.70)}) == pytest.approx((0.62, 0.54, 0.70))
    vllm = {(r["dtype"], r["batch"], r["adapters"]): r["tokens_per_s"] for r in VLLM_TOKENS_PER_S}
    for e in KEPT:  # vLLM's kept shares agree with its own tokens/s where both are single numbers
        base = vllm.get((e["dtype"], e["batch"], 0))
        if e["system"].startswith("vLLM") and base and not isinstance(e["kept"], tuple):
            assert vllm[(e["dtype"], e["batch"], e["adapters"])] / base == pytest.approx(e["kept"], abs=0.01)


def test_bench_subcommands_parse():
    p = build_parser()
    assert p.parse_args(["bench", "kernels", "--quick"]).quick
    assert p.parse_args(["bench", "decode", "--tiny"]).out == "bench/results"
    assert p.parse_args(["bench", "serve", "--url", "http://x"]).url == "http://x"
    a = p.parse_args(["bench", "report", "--quick", "--models", "qwen3-30b-a3b", "--dtypes", "bf16"])
    assert a.quick and a.what == "report" and a.models == "qwen3-30b-a3b"
    assert p.parse_args(["bench", "plot", "a.json", "b.json"]).files == ["a.json", "b.json"]


def test_prefill_warm_up_runs_the_timed_shapes(monkeypatch):
    """The untimed warm-up of a prefill case runs as many prompts of the same length as the timed run, so the
    chunked steps (and the Triton kernels compiled for them) are the same; a 1-prompt warm-up left Triton
    compilation inside the first timed case on the H200."""
    from moelora_bench import report

    calls = []

    def fake_prefill_case(engine, prompts, prompt_len, n_adapters, seed):
        calls.append((prompts, prompt_len, n_adapters))
        return {"prompts": prompts, "prompt_len": prompt_len, "adapters": n_adapters, "seconds": 1.0,
                "tokens_per_s": prompts * prompt_len}

    monkeypatch.setattr(report, "prefill_case", fake_prefill_case)
    g = {"prefill_prompts": 8, "prefill_len": 2048}
    sizes = {"attn_flops_per_ctx": 1.0, "active_params": 1e9}
    row = report._prefill_row(None, g, 4, 16, sizes, 100.0, {"model": "m"})
    assert calls == [(8, 2048, 4), (8, 2048, 4)]
    assert row["tokens_per_s"] == 8 * 2048 and row["rank"] == 16


def test_peft_baseline_takes_transformers_fastest_experts_implementation(monkeypatch):
    """The transformers side is timed in its fastest experts implementation: each candidate is timed, the
    fastest stays set, one that fails is reported as unavailable (not chosen)."""
    from moelora_bench import baseline_hf

    class Model:
        impl = "grouped_mm"

        def set_experts_implementation(self, impl):
            if impl == "broken":
                raise ValueError("not on this device")
            self.impl = impl

    speed = {"grouped_mm": 0.5, "eager": 0.2}
    monkeypatch.setattr(baseline_hf, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm", "eager", "broken"))
    monkeypatch.setattr(baseline_hf, "_decode_s", lambda model, ids, n, kw: speed[model.impl] * n)
    m = Model()
    import torch

    note = baseline_hf._fastest_experts(m, torch.zeros(4, 3), {})
    assert m.impl == "eager" and "'eager'" in note and "broken unavailable (ValueError)" in note


def test_parts_of_a_split_run_merge_in_order(tmp_path):
    """Parts of a split report (any file order) give tables sorted by model, dtype (bf16 before fp8) and rank,
    every part's engines, and the summed run time."""
    from moelora_bench.plot import load
    from moelora_bench.summary import markdown

    def part(name: str, model: str, dtype: str, rank: int, elapsed: float) -> str:
        rows = [{"model": model, "dtype": dtype, "engine_rank": rank, "batch": 1, "adapters": n, "rank": rank * (n > 0),
                 "tokens_per_s": 100.0 - n, "step_ms": 10.0, "floor_ms": 5.0, "step_over_floor": 2.0} for n in (0, 1)]
        d = {"kind": "report", "device": "X", "date": "2026-11-30", "commit": "abc", "elapsed_s": elapsed,
             "ceilings": {"copy_gbs": 1.0, "matmul_tflops": {}}, "decode": rows, "prefill": [], "notes": [],
             "peft": None, "engines": [{"model": model, "dtype": dtype, "rank": rank, "layers": 2, "max_loras": 2,
                                        "graphs": True, "build_s": 1.0}]}
        path = tmp_path / f"report-{name}.json"
        path.write_text(json.dumps(d))
        return str(path)

    files = [part("c", "Qwen3", "fp8", 16, 3.0), part("b", "Qwen3", "bf16", 64, 2.0), part("a", "DeepSeek", "bf16", 16, 1.0),
             part("d", "Qwen3", "bf16", 16, 4.0)]
    d = load(files)
    assert d["parts"] == 4 and d["elapsed_s"] == pytest.approx(10.0) and len(d["engines"]) == 4
    table = markdown(d)
    order = [table.index(f"— {m}, {dt}, rank {r} (") for m, dt, r in
             (("DeepSeek", "bf16", 16), ("Qwen3", "bf16", 16), ("Qwen3", "bf16", 64), ("Qwen3", "fp8", 16))]
    assert order == sorted(order)
    assert "Run time 10 s (the sum of 4 parts" in table
    assert table.index("engine DeepSeek bf16 rank 16") < table.index("engine Qwen3 fp8 rank 16")


def test_write_result_never_overwrites_an_earlier_run(tmp_path, monkeypatch):
    """A run rewriting its report after every case keeps one file; a later run of the same day (a new process:
    another first write) takes <name>-2.json, -3 ..., leaving the earlier ones as they were. The same for every
    kind; `new_file=True` (bench serve) takes a new name at every write."""
    from moelora_bench import common
    from moelora_bench.report import Report

    out = str(tmp_path)
    monkeypatch.setattr(common, "_FILE_PATHS", {}, raising=False)
    rep = Report(out, {"run": 1}, tag="part1")
    first = rep.save()
    rep.data["notes"].append("second case")
    assert rep.save() == first and first.endswith("-cpu-part1.json")
    monkeypatch.setattr(common, "_FILE_PATHS", {}, raising=False)  # as in a new process
    second = Report(out, {"run": 2}, tag="part1").save()
    monkeypatch.setattr(common, "_FILE_PATHS", {}, raising=False)
    third = Report(out, {"run": 3}, tag="part1").save()
    assert second == first[: -len(".json")] + "-2.json" and third == first[: -len(".json")] + "-3.json"
    assert [json.load(open(p))["settings"]["run"] for p in (first, second, third)] == [1, 2, 3]
    assert json.load(open(first))["notes"] == ["second case"]

    for kind in ("decode", "kernels"):
        a = common.write_result(kind, {"rows": [1]}, out)
        assert common.write_result(kind, {"rows": [1, 2]}, out) == a  # rows appended: the same file
        monkeypatch.setattr(common, "_FILE_PATHS", {}, raising=False)
        b = common.write_result(kind, {"rows": [3]}, out)
        assert b != a and json.load(open(a))["rows"] == [1, 2] and json.load(open(b))["rows"] == [3]
    s1 = common.write_result("serve", {"n": 1}, out, new_file=True)
    s2 = common.write_result("serve", {"n": 2}, out, new_file=True)
    assert s1 != s2 and [json.load(open(p))["n"] for p in (s1, s2)] == [1, 2]
    assert len(glob.glob(os.path.join(out, "*.json"))) == 3 + 2 + 2 + 2
