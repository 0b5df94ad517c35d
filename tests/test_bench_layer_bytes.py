"""The per-kernel layer table of `bench decode --profile-steps`: each kernel of one decoder layer with the floor
bytes of the role it reads (floor.py's roles, placed by trace.roles) and its share of the read bandwidth."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moelora_bench.floor import floor_bytes, mean_layer_roles
from moelora_bench.trace import format_kernel_bytes, one_layer, roles


def _events(layer_kernels: list[tuple[str, float, int]], layers: int = 3) -> tuple[list[str], list[list]]:
    """A compact trace (trace.load_trace's form) of `layers` identical layers of (name, duration µs, stream),
    each kernel starting when the one before it ends plus 1 µs."""
    names: list[str] = []
    rows, t = [], 0.0
    for _ in range(layers):
        for name, dur, stream in layer_kernels:
            if name not in names:
                names.append(name)
            rows.append([names.index(name), stream, t, dur])
            t += dur + 1.0
    return names, rows


FP8_LORA_LAYER = [("_paged_attn_split_kernel", 10, 7), ("_shrink_kernel", 5, 7),
                  ("_fp8_gemm_kernel", 10, 7), ("_lora_delta_kernel", 5, 7), ("_rms_norm_kernel", 2, 7),
                  ("_router_topk_kernel", 7, 7), ("_moe_align_kernel", 4, 7), ("_moe_lora_fused_kernel", 20, 8),
                  ("_fp8_gemm_kernel", 100, 7), ("_silu_and_mul_kernel", 2, 7), ("_moe_lora_fused_kernel", 15, 8),
                  ("_fp8_gemm_kernel", 50, 7), ("_rms_norm_kernel", 5, 7), ("_shrink_kernel", 5, 7),
                  ("_fp8_gemm_kernel", 8, 7), ("_lora_delta_kernel", 4, 7), ("_qk_norm_rope_kernel", 4, 7)]


def test_roles_place_the_gemms_by_order_and_the_readers_by_run():
    names = [n for n, _, _ in FP8_LORA_LAYER]
    assert roles(names) == ["kv", "o_lora_a", "o_proj", "o_lora_b", None, "router", None, "gate_up_lora",
                            "gate_up", None, "down_lora", "down", None, "qkv_lora_a", "qkv", "qkv_lora_b", None]
    # bf16 without the fused router: cuBLAS GEMMs for o, the router and q/k/v, ours for the experts
    bf16 = ["_paged_attn_split_kernel", "nvjet_tst_64x8_64x16", "_rms_norm_kernel", "sm90_xmma_gemm_bf16bf16",
            "_route_topk_kernel", "_moe_align_kernel", "_expert_gemm_kernel", "_silu_and_mul_kernel",
            "_expert_gemm_kernel", "_rms_norm_kernel", "nvjet_tst_64x8_64x16", "_qk_norm_rope_kernel"]
    assert [r for r in roles(bf16) if r] == ["kv", "o_proj", "router", "gate_up", "down", "qkv"]
    assert roles(["_fp8_gemm_kernel"] * 3) == [None] * 3  # a count the rules do not know: nothing placed


def test_layer_table_gives_each_kernel_its_bytes_and_share_of_the_read_bandwidth():
    layer = one_layer(*_events(FP8_LORA_LAYER))
    assert layer["marker"] == "_paged_attn_split_kernel" and layer["layers"] >= 2
    ks = layer["kernels"]
    assert [k["name"] for k in ks] == [n for n, _, _ in FP8_LORA_LAYER]  # both streams, in start order
    assert [k["stream"] for k in ks if k["name"] == "_moe_lora_fused_kernel"] == ["side", "side"]
    role_bytes = {"kv": 20e6, "o_proj": 8e6, "gate_up": 400e6, "down": 200e6, "qkv": 10e6, "router": 0.5e6,
                  "o_lora_a": 1e6, "o_lora_b": 1e6, "qkv_lora_a": 1e6, "qkv_lora_b": 1e6, "gate_up_lora": 2e6,
                  "down_lora": 1e6, "lm_head": 0.0}
    out = format_kernel_bytes(layer, role_bytes, read_gbs=5000.0)
    gate_up = next(line for line in out.splitlines() if "(gate_up, main)" in line)
    assert gate_up.split()[3:7] == ["400.00", "4000", "80%", "_fp8_gemm_kernel"]  # 400 MB in 100 µs of 5 TB/s
    # the layer's span against its floor: 645.5 MB at 5 TB/s is 129.1 µs
    span = layer["span_us"]
    assert f"645.50 MB = 129.1 us at 5000 GB/s: span {span / 129.1:.2f}x the floor" in out
    # main-stream kernels that read nothing of the floor: 2 norms, align, silu, rope
    assert "read no floor bytes 17.0 us" in out
    no_lora = [k for k in FP8_LORA_LAYER if "lora" not in k[0] and "shrink" not in k[0]]
    out = format_kernel_bytes(one_layer(*_events(no_lora)), role_bytes, read_gbs=5000.0)
    assert "not placed on a kernel: o_lora_a 1.00 MB" in out and "down_lora 1.00 MB" in out
    assert one_layer(*_events([("_rms_norm_kernel", 2, 7)])) is None  # no attention kernel to split layers at


def test_the_layers_roles_add_up_to_the_floor():
    """mean_layer_roles over the layers plus the lm_head is floor_bytes (one rank); an adapter's roles appear."""
    H, E, I, V, hd, r = 64, 8, 32, 100, 16, 4
    cfg = SimpleNamespace(mla=None, hidden_size=H, num_experts=E, q_size=4 * hd, kv_size=2 * hd, num_key_value_heads=2,
                          moe_intermediate_size=I, vocab_size=V, num_hidden_layers=2)
    layers = [SimpleNamespace(mlp=SimpleNamespace(last_topk_ids=torch.tensor([[0, 1], [1, 5]]))),
              SimpleNamespace(mlp=SimpleNamespace(last_topk_ids=torch.tensor([[2, 3], [4, 5]])))]
    eng = SimpleNamespace(config=cfg, model=SimpleNamespace(dtype=torch.float32, model=SimpleNamespace(layers=layers)),
                          args=SimpleNamespace(quantization=None, tensor_parallel_size=1, expert_parallel_size=1,
                                               max_lora_rank=r),
                          pool=SimpleNamespace(slot_of=lambda name: 0))
    reqs = [SimpleNamespace(adapter="a"), SimpleNamespace(adapter=None)]
    total, touched = floor_bytes(eng, reqs, ctx_len=10)
    assert touched == [3, 4]
    mean = mean_layer_roles(eng, reqs, ctx_len=10)
    assert abs(2 * sum(mean.values()) + V * H * 4 - total) < 1e-6 * total
    assert mean["gate_up"] == 4 * 2 * H * I * 3.5 and mean["down_lora"] == 4 * 2 * r * (I + H)  # 2 pairs a layer
    assert mean["kv"] == 4 * 2 * 10 * 2 * 2 * hd and mean["qkv_lora_a"] == 4 * r * 3 * H


def test_two_trees_compared_kernel_by_kernel(tmp_path, capsys):
    """scripts/results_jsonl.py --compare (gpu_bench.sh TREES): tokens/s per tree and, for a profiled case, one
    layer's kernels side by side, matched by stream, name and run; a kernel one tree lacks shows "-"."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "results_jsonl.py"
    spec = importlib.util.spec_from_file_location("results_jsonl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for tree, tps, span, ks in (("old", 100.0, 30.0, [("attn", 10.0), ("reduce", 3.0), ("gemm", 5.0), ("gemm", 7.0)]),
                                ("new", 110.0, 27.0, [("attn", 10.5), ("gemm", 5.0), ("gemm", 6.0)])):
        (tmp_path / tree).mkdir()
        layer = {"layers": 47, "span_us": span, "kernels": [{"name": n, "stream": "main", "dur_us": d} for n, d in ks]}
        row = {"batch": 64, "adapters": 0, "workload": "vllm", "tokens_per_s": tps, "profile": {"layer": layer}}
        (tmp_path / tree / "decode-1.json").write_text(json.dumps({"dtype": "fp8", "rows": [row]}))
    mod.compare(str(tmp_path), ["old=.old", "new=."])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["fp8", "vllm", "64", "0", "100.0", "110.0", "1.100"]
    assert "span old 30.0, new 27.0" in lines[2]
    assert [ln.split() for ln in lines[3:]] == [["attn", "main", "10.0", "10.5"], ["reduce", "main", "3.0", "-"],
                                                ["gemm", "main", "5.0", "5.0"], ["gemm", "main", "7.0", "6.0"]]
