#!/usr/bin/env bash
# Session 3, device call C: the fixed near-tie criterion of the 200-step graph-vs-eager test; `bench report
# --quick` (ceilings, bf16 decode sweep, prefill, transformers + PEFT); bench decode FP8 (batch 64/128 x
# 0/4/8/32 rank-16 adapters, vLLM workload) and DeepSeek-V2-Lite (both workloads, batch 1/64 x 0/4/8).
# Files: graph_test.log, report.log, report-*.json, bench.log, fp8/decode-*.json, ds/decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout ${T_GRAPH:-90} python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short \
    tests/test_graphs_overlap.py::test_graph_replay_equals_eager_200_random_steps 2>&1 | tee "$OUT/graph_test.log" \
    | grep -E "worst|passed|failed|Error" | cut -c1-600 | tail -5
timeout -s INT ${T_REP:-230} python3 -m moelora bench report --quick --out "$OUT" --no-plot 2>&1 \
    | tee "$OUT/report.log" | tr '\r' '\n' | grep -v '^bench report:' | tail -45
B="python3 -m moelora bench decode"
timeout ${T_FP8:-150} $B --out "$OUT/fp8" --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8,32 \
    2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -11
timeout ${T_DS:-105} $B --out "$OUT/ds" --preset deepseek-v2-lite --workloads vllm,ctx1024 --batches 1,64 \
    --adapter-counts 0,4,8 --decode-steps 16 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -15
