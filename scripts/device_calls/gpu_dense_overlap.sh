#!/usr/bin/env bash
# Device call on one H200 (issue 7's adapter targets): the dense LoRA chains (qkv, o; ~15 us each per layer,
# 3 launches) on the side stream beside their base GEMM (MOELORA_DENSE_LORA_OVERLAP=1; off by default).
# Its GPU tests (layer, eager and in a graph, bit for bit) and the FP8 fast-path tests (RUN_TESTS=0 skips them),
# then bench decode for each of DTYPES (default "bfloat16 fp8") at batch 64 with 0/4/8 rank-16 adapters, off
# then on (~50 s each). If on is faster, make it the default (kernels/_triton.py).
# Files: overlap_tests.log, bench-<dtypes>.log, <dtype>-off/ <dtype>-on/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  MOELORA_DENSE_LORA_OVERLAP=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      tests/test_dense_lora_overlap.py \
      tests/test_graphs_overlap.py::test_overlap_equals_serial "tests/test_fp8_gpu.py" -k "overlap or fast_path" \
      > "$OUT/overlap_tests.log" 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/overlap_tests.log" | cut -c1-300 | tail -6
fi
DTYPES=${DTYPES:-bfloat16 fp8}
LOG="$OUT/bench-${DTYPES// /-}.log"
for dt in $DTYPES; do for on in 0 1; do
  MOELORA_DENSE_LORA_OVERLAP=$on timeout 100 python3 -m moelora bench decode --dtype $dt --workloads vllm \
      --batches 64 --adapter-counts 0,4,8 --out "$OUT/${dt/bfloat16/bf16}-$([ $on = 1 ] && echo on || echo off)" \
      >> "$LOG" 2>&1
done; done
grep -v "^WARN" "$LOG" | grep -E "tok/s|Error" | cut -c1-200
