#!/usr/bin/env bash
# One device call for the GPU engine: install, GPU engine tests (graphs, overlap, memory plan, parity), then
# `moelora bench decode` at Qwen3-30B-A3B dimensions. Logs and JSON go to $OUT.
# Usage: bash scripts/gpu_engine.sh [pytest files...]   (env BENCH_ARGS: extra bench decode arguments)
source "$(dirname "$0")/gpu_prelude.sh"
TESTS=${*:-tests/test_graphs_overlap.py tests/test_cuda_graphs.py tests/test_parity.py}
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -s $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|worst|assert" | tail -15
timeout ${BENCH_TIMEOUT:-330} python3 -m moelora bench decode --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | tail -40
