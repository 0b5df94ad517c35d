"""`moelora bench decode --preset deepseek-v2-lite`: the preset reads as DeepSeek-V2-Lite, the tiny preset runs
on the CPU, and the byte floor counts the MLA weights and the latent cache, by hand."""

import argparse
import functools
import json
import os
import re

import pytest
import torch

from moelora_bench import decode
from moelora_bench.presets import DEEPSEEK_V2_LITE, DEEPSEEK_V2_LITE_TINY, floor_bytes_from_tensors
from moelora.config import ModelConfig
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _folder(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_lite_preset_reads_as_deepseek_v2_lite(tmp_path):
    cfg = ModelConfig.from_pretrained(_folder(tmp_path, DEEPSEEK_V2_LITE))
    m = cfg.mla
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (512, None, 128, 64, 128)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_experts) == (27, 2048, 16, 64)
    assert cfg.num_experts_per_tok == 6 and cfg.shared_expert_intermediate_size == 2 * 1408
    assert tuple(cfg.moe_layers[:2]) == (False, True) and cfg.rope_type == "yarn"


def test_floor_counts_mla_weights_and_latent_cache(tmp_path):
    c = DEEPSEEK_V2_LITE_TINY
    eng = LLMEngine(EngineArgs(model=_folder(tmp_path, c), max_loras=1, max_lora_rank=8, load_format="dummy",
                               max_model_len=128))
    eng.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    got, touched = floor_bytes_from_tensors(eng, [eng.requests["r"]], ctx_len=10)
    hid, H, C, R, Dn, Dv = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"], \
        c["qk_nope_head_dim"], c["v_head_dim"]
    attn = H * (Dn + R) * hid + (C + R) * hid + H * (Dn + Dv) * C + hid * H * Dv + C  # q, kv_a, kv_b, o, kv_a norm
    norms = 2 * hid
    dense = 3 * hid * c["intermediate_size"]
    I, E = c["moe_intermediate_size"], c["n_routed_experts"]
    moe = E * hid + touched[0] * 3 * hid * I + 3 * hid * I * c["n_shared_experts"]
    latent = 10 * 2 * (C + R)  # ctx_len tokens, 2 layers, one latent + rope row each
    expect = (2 * (attn + norms) + dense + moe + latent + c["vocab_size"] * hid) * 4  # fp32
    assert touched == [c["num_experts_per_tok"]] and got == expect


def test_bench_decode_tiny_deepseek_preset(tmp_path, capsys):
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    p.add_argument("--out")
    args = p.parse_args(["--preset", "deepseek-v2-lite", "--tiny", "--batches", "2", "--adapter-counts", "0,2",
                         "--workloads", "ctx1024", "--decode-steps", "1", "--out", str(tmp_path)])
    assert decode.run(args) == 0
    res = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    rows = res["rows"]
    assert [r["adapters"] for r in rows] == [0, 2] and all(r["model"] == "tiny DeepSeek-V2-Lite" for r in rows)
    assert rows[1]["floor_bytes"] > rows[0]["floor_bytes"]  # the adapters' factors count
    assert torch.tensor([r["tokens_per_s"] for r in rows]).gt(0).all()
    assert all(0 < r["runner_ms"] <= r["step_ms"] and r["host_ms"] >= 0 for r in rows)  # runner time within the step


def test_bench_decode_tiny_tensor_parallel(tmp_path):
    """--tp 2: a worker process beside this one (gloo on the CPU); the adapters reach every rank from disk, the
    rows say tp2 and carry the busiest rank's byte floor, the workers are stopped at the end."""
    import multiprocessing

    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    p.add_argument("--out")
    args = p.parse_args(["--tiny", "--device", "cpu", "--tp", "2", "--batches", "2", "--adapter-counts", "0,2",
                         "--workloads", "ctx1024", "--decode-steps", "1", "--out", str(tmp_path)])
    assert decode.run(args) == 0
    res = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    assert res["tensor_parallel_size"] == 2 and "floor_note" in res
    rows = res["rows"]
    assert [r["adapters"] for r in rows] == [0, 2] and all(r["model"].endswith("tp2 ep1") for r in rows)
    assert all(r["floor_bytes"] > 0 for r in rows) and rows[1]["floor_bytes"] > rows[0]["floor_bytes"]
    assert all(r["floor_ms"] is None for r in rows) and all(r["tokens_per_s"] > 0 for r in rows)  # no GPU bandwidth
    assert not [c for c in multiprocessing.active_children() if c.is_alive()]  # workers stopped


def test_floor_of_a_sharded_run_is_its_busiest_rank():
    """_floor_bytes by hand on a 1-layer model: tp splits attention, KV, dense LoRA B / o's A, the experts' width
    and lm_head; ep gives each group its own experts, and the floor is the group that reads the most."""
    from types import SimpleNamespace

    H, E, I, V, hd, r = 64, 8, 32, 100, 16, 4
    cfg = SimpleNamespace(mla=None, hidden_size=H, num_experts=E, q_size=4 * hd, kv_size=2 * hd, num_key_value_heads=2,
                          moe_intermediate_size=I, vocab_size=V, num_hidden_layers=1)
    ids = torch.tensor([[0, 1], [1, 5]])  # two requests, top-2: experts 0, 1 (ep group 0) and 5 (group 1)
    layer = SimpleNamespace(mlp=SimpleNamespace(last_topk_ids=ids))
    reqs = [SimpleNamespace(adapter="a"), SimpleNamespace(adapter=None)]

    def floor(tp, ep):
        eng = SimpleNamespace(config=cfg, model=SimpleNamespace(dtype=torch.float32, model=SimpleNamespace(layers=[layer])),
                              args=SimpleNamespace(quantization=None, tensor_parallel_size=tp, expert_parallel_size=ep,
                                                   max_lora_rank=r),
                              pool=SimpleNamespace(slot_of=lambda name: 0))
        return decode._floor_bytes(eng, reqs, ctx_len=10)[0]

    def expect(tp, ep_experts, ep_pairs):
        qs, kvs, i = 4 * hd // tp, (2 * hd // tp if 2 >= tp else hd), I // tp
        attn = H * (qs + 2 * kvs) + qs * H
        dense_lora = r * (3 * H + qs + 2 * kvs + qs + H)  # one adapter slot in use
        experts = ep_experts * 3 * H * i + ep_pairs * r * (2 * H + 2 * i + i + H)
        return 4 * (attn + dense_lora + E * H + experts + -(-V // tp) * H + 2 * 10 * 2 * kvs)

    assert floor(1, 1) == expect(1, 3, 2)  # experts 0, 1, 5 touched; adapter pairs (0, 0), (0, 1)
    assert floor(2, 1) == expect(2, 3, 2)
    assert floor(4, 1) == expect(4, 3, 2)  # 2 KV heads over 4 ranks: one replicated head each
    assert floor(1, 2) == expect(1, 2, 2)  # group 0 (experts 0-3) holds 0, 1 and both pairs; group 1 only 5

    # --lora-targets: attention-only adapters read no expert factors, experts-only ones no dense factors
    def floor_of(which):
        eng = SimpleNamespace(config=cfg, model=SimpleNamespace(dtype=torch.float32, model=SimpleNamespace(layers=[layer])),
                              args=SimpleNamespace(quantization=None, tensor_parallel_size=1, expert_parallel_size=1,
                                                   max_lora_rank=r),
                              pool=SimpleNamespace(slot_of=lambda name: 0))
        return decode._floor_bytes(eng, reqs, ctx_len=10, lora_targets=which)[0]

    dense_lora = 4 * r * (3 * H + 4 * hd + 2 * 2 * hd + 4 * hd + H)
    pair_lora = 4 * 2 * r * (2 * H + 2 * I + I + H)
    assert floor_of("all") == expect(1, 3, 2)
    assert floor_of("attention") == expect(1, 3, 2) - pair_lora
    assert floor_of("experts") == expect(1, 3, 2) - dense_lora

    # --expert-lora-layout shared-a: a slot whose up slice reads the gate's A (LoRAWeights.a_src) counts one A a pair
    gu = SimpleNamespace(a_src_host=[[0, 0], [0, 1]])  # slot 0 shared, slot 1 not
    layer.mlp.experts = SimpleNamespace(gate_up_lora=gu)
    try:
        assert floor_of("all") == expect(1, 3, 2) - 4 * 2 * r * H  # two pairs of slot 0, one A [r, H] each less
        gu.a_src_host = [[0, 0], [1, 0]]  # slot 1 shared: the batch's slot 0 is not
        assert floor_of("all") == expect(1, 3, 2)
    finally:
        del layer.mlp.experts


def _tiny_decode(tmp_path, *extra: str) -> tuple[argparse.Namespace, list[dict]]:
    """bench decode on the tiny model, batch 2, 0 and 1 adapters, the vllm workload, plus `extra` options:
    (the parsed args, the JSON rows)."""
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    p.add_argument("--out")
    args = p.parse_args(["--tiny", "--batches", "2", "--adapter-counts", "0,1", "--workloads", "vllm", *extra,
                         "--out", str(tmp_path)])
    assert decode.run(args) == 0
    return args, json.loads(next(tmp_path.glob("decode-*.json")).read_text())["rows"]


def test_bench_decode_shared_a_layout(tmp_path):
    """--expert-lora-layout shared-a: the random adapters' routed-expert up_proj takes its gate_proj's A (one
    tensor), recorded in the JSON head; the engine then names the gate's copy for the up slice (LoRAWeights.a_src)."""
    from moelora.layers.lora import LoRAWeights

    seen = []
    real = LoRAWeights._share_a

    def spy(self, i, slot):
        real(self, i, slot)
        seen.append(self.a_src_host[1][slot] if self.num_slices == 2 else None)

    LoRAWeights._share_a = spy
    try:
        args, rows = _tiny_decode(tmp_path, "--expert-lora-layout", "shared-a")
    finally:
        LoRAWeights._share_a = real
    head = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    assert head["expert_lora_layout"] == "shared-a" and rows[1]["adapters"] == 1
    assert 0 in seen  # an up slice written after its gate named the gate's A
    from types import SimpleNamespace

    t = SimpleNamespace(num_experts=4, in_features=8, out_features=6)
    names = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    targets = {n: t for n in names} | {"model.layers.0.self_attn.q_proj": SimpleNamespace(num_experts=None,
                                                                                         in_features=8, out_features=8)}
    for shared in (True, False):
        ad = decode.random_adapter("x", targets, 4, 0, "cpu", torch.float32, shared)
        ups = [k for k in ad.modules if k.endswith("experts.up_proj")]
        same = [ad.modules[k].a is ad.modules[k.replace("up_proj", "gate_proj")].a for k in ups]
        assert len(ups) == 2 and same == [shared] * 2


def test_bench_decode_lora_targets(tmp_path, capsys):
    """--lora-targets all,attention,experts: the adapter cases run once per entry, each with adapters that adapt
    only those targets (named ad{i}-{entry}), labelled in the row and the printed line; an unknown entry is
    refused before the model is built."""
    _, rows = _tiny_decode(tmp_path, "--lora-targets", "all,attention,experts")
    assert [(r["adapters"], r["lora_targets"]) for r in rows] == [
        (0, None), (1, "all"), (1, "attention"), (1, "experts")]
    # (each case samples its own tokens, so its routing and touched experts differ: the floor's arithmetic per
    # target set is checked on one routing in test_floor_of_a_sharded_run_is_its_busiest_rank)
    assert all(r["floor_bytes"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "(attention only)" in out and "(experts only)" in out
    with pytest.raises(ValueError, match="unknown entry 'mlp'"):
        _tiny_decode(tmp_path / "bad", "--lora-targets", "all,mlp")


def test_bench_decode_profile_steps(tmp_path, capsys):
    """--profile-steps: each row carries the time per kernel and step (on the CPU: operators), largest first,
    and the largest are printed; without it the rows have no profile."""
    _, rows = _tiny_decode(tmp_path, "--profile-steps", "2")
    for r in rows:
        prof = r["profile"]
        assert prof["steps"] == 2 and prof["total_us"] > 0 and prof["kernels"]
        us = [k["us"] for k in prof["kernels"] if k["name"] != "other"]
        assert us == sorted(us, reverse=True) and sum(k["us"] for k in prof["kernels"]) == pytest.approx(prof["total_us"])
        assert any("mm" in k["name"] or "linear" in k["name"] for k in prof["kernels"])  # the GEMMs are there
    base, lora = rows
    assert "profile_tax" not in base and lora["profile_tax"]["total_us"] == pytest.approx(
        lora["profile"]["total_us"] - base["profile"]["total_us"])
    out = capsys.readouterr().out
    assert "profile (cpu operators, 2 steps)" in out and "LoRA tax by kernel (profiled)" in out


def test_profile_tax_is_the_per_kernel_difference():
    """profile_tax: with-adapter minus no-adapter time per kernel, largest change first; a kernel only one side
    has counts as 0 on the other; the kept rows plus "other" add up to the difference of the totals."""
    from moelora_bench.profile import format_profile_tax, profile_tax

    base = {"total_us": 100.0, "kernels": [{"name": "gemm", "us": 80.0}, {"name": "align", "us": 15.0},
                                           {"name": "other", "us": 5.0}]}
    lora = {"total_us": 130.0, "kernels": [{"name": "gemm", "us": 82.0}, {"name": "lora", "us": 30.0},
                                           {"name": "align", "us": 10.0}, {"name": "other", "us": 8.0}]}
    t = profile_tax(base, lora, top=2)
    assert t["total_us"] == 30.0
    assert [(k["name"], k["us"]) for k in t["kernels"]] == [("lora", 30.0), ("align", -5.0), ("other", 5.0)]
    assert t["kernels"][0]["base_us"] == 0.0 and t["rest_count"] == 1
    assert sum(k["us"] for k in t["kernels"]) == pytest.approx(t["total_us"])
    text = format_profile_tax(t)
    assert "+30 us per step" in text and "-5.0 us  (15.0 -> 10.0)  align" in text


def test_bench_decode_repeat_reports_the_median_run(tmp_path, capsys):
    """--repeat 3: each row is the median run by tokens/s, with all three runs' tokens/s and their spread; the
    printed line says so. --repeat 0 is refused with the option's name."""
    args, rows = _tiny_decode(tmp_path, "--repeat", "3")
    assert len(rows) == 2
    for r in rows:
        tps = r["repeats_tokens_per_s"]
        assert len(tps) == 3 and r["tokens_per_s"] == sorted(tps)[1]
        assert r["repeat_spread"] == pytest.approx((max(tps) - min(tps)) / r["tokens_per_s"])
    assert "median of 3, spread" in capsys.readouterr().out
    args.repeat = 0
    with pytest.raises(ValueError, match="--repeat must be at least 1"):
        decode.run(args)


def test_bench_decode_async_scheduling(tmp_path):
    """--async-scheduling: the rows say so, every request's tokens are counted (the same tokens served as
    without it: 128 a request of the vllm workload), nearly every step was scheduled ahead. The default on the
    CPU and --no-async-scheduling: synchronous."""
    _, sync_rows = _tiny_decode(tmp_path / "sync")
    _, rows = _tiny_decode(tmp_path / "async", "--async-scheduling")
    _, off_rows = _tiny_decode(tmp_path / "off", "--no-async-scheduling")
    assert [r["async_scheduling"] for r in rows] == [True, True]
    assert not any(r["async_scheduling"] for r in sync_rows + off_rows)
    assert all(r["ahead_steps"] >= r["decode_steps"] - 2 for r in rows)
    assert not any(r["ahead_steps"] for r in sync_rows)
    for a, s in zip(rows, sync_rows):
        assert a["decode_steps"] == s["decode_steps"] and a["tokens_per_s"] > 0


def test_kernel_timeline_measures_idle_overlap_and_hidden_lora_time():
    """kernel_timeline on a hand-made trace: a GEMM and an activation on the main stream, two LoRA kernels on a
    side stream (one fully beside the GEMM, one half beside it), a CPU event ignored; two steps' worth."""
    from moelora_bench.profile import format_timeline, kernel_timeline

    def k(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [k("_fp8_gemm_kernel", 0, 100, 7), k("_silu_and_mul_kernel", 125, 5, 7),
              k("_moe_lora_fused_kernel", 20, 30, 8), k("_moe_lora_fused_kernel", 90, 25, 8),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    t = kernel_timeline(events, steps=2)
    assert t["kernels"] == 2  # 4 kernels over 2 steps
    assert t["span_us"] == 65 and t["busy_us"] == 60 and t["idle_us"] == 5  # [0, 130], union 120, gap 115-125
    assert t["stream_busy_us"] == {"7": 52.5, "8": 27.5}
    assert t["concurrent_us"] == 20  # 30 + 10 over 2 steps
    assert t["marked_sum_us"] == 27.5 and t["marked_union_us"] == 27.5 and t["marked_hidden_us"] == 20
    assert "idle 5" in format_timeline(t)
    assert kernel_timeline(events[-1:], 1) == {"kernels": 0}


def test_kernel_trace_layer_table_orders_one_layers_kernels(tmp_path, capsys):
    """write_kernel_trace keeps the kernels (not CPU events) in start order; layer_table splits the main stream at
    the marker kernel into layers and gives per position the median duration, gap before (negative: started before
    the previous one ended) and start in the layer, skipping step boundaries and layers of another kernel sequence,
    and the side stream's kernels by their start in the layer."""
    from moelora_bench.profile import write_kernel_trace
    from moelora_bench.trace import format_layer_table, layer_table, load_trace, main

    def k(name, ts, dur, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    for step0 in (1000.0, 5000.0):  # two steps of three layers; the gap between them is a step boundary
        for layer in range(3):
            t = step0 + 100 * layer
            events += [k("attn", t, 10), k("norm", t + 12 + layer, 3), k("shrink", t + 16 + layer, 5),
                       k("gemm", t + 19 + layer, 40 + layer), k("lora", t + 20, 30, stream=8)]
    events.append(k("odd", 5000.0 + 150, 1))  # makes layer 1 of step 2 a different sequence: dropped
    path = str(tmp_path / "t" / "trace.json.gz")
    write_kernel_trace(events[::-1], path)
    names, ks = load_trace(path)
    assert len(ks) == 31 and [k[2] for k in ks] == sorted(k[2] for k in ks) and ks[0][2] == 0.0
    t = layer_table(names, ks, marker="attn")
    # whole layers (one marker to the next within a step): steps 1 and 2 layers 0 and 1; step 2's layer 1 has
    # another sequence -> 3 layers (indices 0, 1, 0), spans 100
    assert t["layers"] == 3 and t["span_us"] == 100
    assert [r["name"] for r in t["main"]] == ["attn", "norm", "shrink", "gemm"]
    norm, shrink, gemm = t["main"][1:]
    assert norm["gap_us"] == 2 and norm["start_us"] == 12 and norm["dur_us"] == 3  # medians of 2, 3, 2 and 12, 13, 12
    assert shrink["gap_us"] == 1 and gemm["gap_us"] == -2 and gemm["dur_us"] == 40
    assert t["side"] == [{"name": "lora", "start_us": 20, "dur_us": 30}]
    with pytest.raises(ValueError, match="no kernel named 'moe'"):
        layer_table(names, ks, marker="moe")
    assert main([path, "--marker", "attn"]) == 0
    out = capsys.readouterr().out
    assert "3 layers, median span 100.0 us" in out and "-2.0  gemm" in out
    assert "side stream" in format_layer_table(t)


def test_layer_table_follows_the_markers_stream(tmp_path):
    """A graph replay may run the marker (and the layer's main-stream kernels) on another stream from one layer to
    the next, and another stream may be busier: each layer's main stream is the one that ran its marker."""
    from moelora_bench.profile import write_kernel_trace
    from moelora_bench.trace import layer_table, load_trace

    def k(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = []
    for layer in range(6):
        t, main = 1000.0 + 100 * layer, 7 if layer % 2 else 9
        events += [k("attn", t, 10, main), k("norm", t + 12, 3, main), k("lora", t + 16, 80, 8)]  # 8: the busiest
    path = str(tmp_path / "trace.json.gz")
    write_kernel_trace(events, path)
    t = layer_table(*load_trace(path), marker="attn")
    assert t["layers"] == 5 and t["span_us"] == 100
    assert [r["name"] for r in t["main"]] == ["attn", "norm"] and t["main"][1]["gap_us"] == 2
    assert t["side"] == [{"name": "lora", "start_us": 16, "dur_us": 80}]


def test_write_result_keeps_one_file_across_midnight(tmp_path, monkeypatch):
    """A run rewriting its result after every row keeps writing the file its first write named, even when the
    date changes in between (a CI run crossing midnight once split a decode run's rows over two files); another
    output folder starts its own file."""
    import datetime

    from moelora_bench import common

    days = iter([datetime.datetime(2026, 12, 1, 23, 59, 59, tzinfo=datetime.timezone.utc),
                 datetime.datetime(2026, 12, 2, 0, 0, 1, tzinfo=datetime.timezone.utc),
                 datetime.datetime(2026, 12, 2, 0, 0, 2, tzinfo=datetime.timezone.utc)])
    monkeypatch.setattr(common, "_utcnow", lambda: next(days))
    first = common.write_result("decode", {"rows": [1]}, str(tmp_path / "a"))
    second = common.write_result("decode", {"rows": [1, 2]}, str(tmp_path / "a"))
    other = common.write_result("decode", {"rows": []}, str(tmp_path / "b"))
    assert first == second and "2026-12-01" in first and "2026-12-02" in other
    assert [p.name for p in (tmp_path / "a").iterdir()] == [os.path.basename(first)]
    data = json.loads(open(second).read())
    assert data["rows"] == [1, 2] and data["date"].startswith("2026-12-02")


def test_bench_decode_ab_base_runs_the_variants_no_adapter_case(tmp_path, capsys):
    """--ab-base: each variant also runs the no-adapter case (a field of the base step, such as the fused router),
    and the table adds the kept share against the variant's own no-adapter median."""
    _, rows = _tiny_decode(tmp_path, "--ab", "prio:side_stream_priority=normal", "--ab-base")
    assert [(r["variant"], r["adapters"]) for r in rows] == [("default", 0), ("default", 1), ("prio", 0),
                                                             ("prio", 1)]
    out = capsys.readouterr().out
    table = out[out.index("A/B (medians"):].splitlines()
    assert "own: against the variant's own no-adapter median" in table[0] and table[1].rstrip().endswith("own")
    mine = [ln for ln in table if ln.startswith("prio")]
    assert len(mine) == 2 and mine[1].rstrip().endswith("%") and mine[0].rstrip().endswith("-")


def test_bench_decode_ab_configs_in_one_process(tmp_path, capsys, monkeypatch):
    """--ab / --ab-rounds: after the default sweep (the base config: --kernel-config), each variant's config is
    applied to the engine and its model (seen by the cases while they run), the graphs recaptured and the adapter
    cases run again; round 2 repeats the default with its no-adapter case; rows carry variant / kernel_config (the
    fields that differ from the defaults) / round, and a table of medians ends the run."""
    seen = []
    real = decode._repeated_case

    def spy(engine, batch, n, *args, **kwargs):
        assert engine.model.kernel_config is engine.kernel_config  # configure_kernels ran with it
        seen.append((n, engine.kernel_config.diff()))
        return real(engine, batch, n, *args, **kwargs)

    monkeypatch.setattr(decode, "_repeated_case", spy)
    _, rows = _tiny_decode(tmp_path, "--kernel-config", '{"side_stream_priority": "normal"}', "--ab",
                           "det:moe_lora.early=0; both:moe_lora.early=false,side_stream_priority=high", "--ab-rounds", "2")
    assert [(r["variant"], r["ab_round"], r["adapters"]) for r in rows] == [
        ("default", 0, 0), ("default", 0, 1), ("det", 0, 1), ("both", 0, 1),
        ("default", 1, 0), ("default", 1, 1), ("det", 1, 1), ("both", 1, 1)]
    base, det, both = {"side_stream_priority": "normal"}, {"side_stream_priority": "normal", "moe_lora.early": False}, \
        {"moe_lora.early": False}
    assert [d for _, d in seen] == [base, base, det, both, base, base, det, both]
    assert [r["kernel_config"] for r in rows] == [d for _, d in seen]
    out = capsys.readouterr().out
    assert "--- variant both (round 2): {'side_stream_priority': 'high', 'moe_lora.early': False}" in out
    assert "A/B (medians over rounds" in out
    table = out[out.index("A/B (medians"):].splitlines()
    assert any(ln.startswith("det ") and " 2 " in ln and "%" in ln for ln in table), table


def test_parse_ab_takes_dotted_fields_and_refuses_bad_specs_before_the_model_is_built(tmp_path):
    from moelora.kernels.config import KernelConfig, field_names
    from moelora_bench.ab import parse_ab

    base = KernelConfig(side_stream_priority="normal")
    assert parse_ab("", base) == []
    (name, cfg), = parse_ab(" s : moe_lora.early = 0 , side_stream_priority=high ;", base)
    assert name == "s" and cfg == KernelConfig.from_dict({"moe_lora": {"early": False}})
    for field in field_names():  # every on/off field, sections' dotted ones included
        default = functools.reduce(getattr, field.split("."), KernelConfig())
        if isinstance(default, bool):
            (_, cfg), = parse_ab(f"flip:{field}={0 if default else 1}", KernelConfig())
            assert cfg.diff() == {field: not default}, field
    for bad, msg in [("x:nope=1", "--ab variant 'x': kernel config: no field 'nope'"),
                     ("x:moe_lora.early=2", "--ab variant 'x': kernel config moe_lora.early: expected 0/1"),
                     ("x:side_stream_priority=urgent", "'high' or 'normal', got 'urgent'"),
                     ("x:moe_lora.early", "'moe_lora.early' is not key=value"),
                     ("default:moe_lora.early=0", "unique name"), ("x moe_lora.early=0", "name:"),
                     ("x:moe_lora.early=1;x:moe_lora.early=0", "unique name")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_ab(bad, base)
        with pytest.raises(ValueError, match=re.escape(msg)):
            _tiny_decode(tmp_path / "bad", "--ab", bad)
        assert not (tmp_path / "bad").exists()  # refused before anything ran


def test_a_bad_kernel_config_is_one_line_before_the_model_is_built(capsys):
    from test_cli_errors import one_error_line

    line = one_error_line(capsys, ["bench", "decode", "--kernel-config", '{"moe": {"nope": 1}}'])
    assert line.startswith("moelora bench decode: error: argument --kernel-config: kernel config: unknown field "
                           "'moe.nope'"), line
    line = one_error_line(capsys, ["bench", "decode", "--kernel-config", "{early: 1}"])
    assert "argument --kernel-config: --kernel-config is not valid JSON" in line, line


def test_bench_decode_ab_profiles_each_variant_against_the_default(tmp_path, capsys):
    """--ab with --profile-steps: each variant's profiled row also carries its per-kernel difference from the
    default's profiled row of the same case (the second round's too, against the default's first run), printed under
    the variant's name; the default's rows carry none."""
    _, rows = _tiny_decode(tmp_path, "--profile-steps", "1", "--ab", "even:moe_lora.early=0", "--ab-rounds", "2")
    default0 = next(r for r in rows if r["variant"] == "default" and r["adapters"] == 1 and r["ab_round"] == 0)
    assert all("profile_vs_default" not in r for r in rows if r["variant"] == "default")
    variant = [r for r in rows if r["variant"] == "even"]
    assert len(variant) == 2
    for r in variant:
        t = r["profile_vs_default"]
        assert t["total_us"] == pytest.approx(r["profile"]["total_us"] - default0["profile"]["total_us"])
        assert t["kernels"][-1]["name"] == "other" and any(k["name"] != "other" for k in t["kernels"])
    assert capsys.readouterr().out.count("even against the default (profiled)") == 2
