#!/usr/bin/env bash
# For the call after scripts/device_calls/gpu_next_producer_shrinks.sh (written in session 20): once its A/B has chosen the
# defaults, (1) the GPU tests of the paths those defaults change — the engine with graphs and the overlap (bit-equal
# on/off, random graph steps, long generations), the graph variants, the FP8 LoRA tests and the demo model in FP8;
# (2) the grid with those defaults: fp8 128/128 batch 64 and 256, then ctx 1,024 batch 64 and 256, 0 / 4 / 8
# adapters (rank 16, all targets). Extra switches for every run: EXTRA="MOELORA_X=1 MOELORA_Y=1" (env syntax).
# Files: tests.log, bench_vllm.log, vllm/, bench_ctx.log, ctx/.
source "$(dirname "$0")/../gpu_prelude.sh"
run() { env ${EXTRA:-MOELORA_UNUSED=0} "$@"; }
run timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_graphs_overlap.py \
    tests/test_cuda_graphs.py tests/test_lora_graph_variants.py \
    tests/test_fp8_gpu.py -k "not nvfp4 and (lora or demo or shrink or overlap or producer)" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
run timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/vllm" > "$OUT/bench_vllm.log" 2>&1
echo "128/128 (rc $?):"; grep -v "^WARN" "$OUT/bench_vllm.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
run timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/ctx" > "$OUT/bench_ctx.log" 2>&1
echo "ctx1024 (rc $?):"; grep -v "^WARN" "$OUT/bench_ctx.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
