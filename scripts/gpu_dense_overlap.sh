#!/usr/bin/env bash
# One device call on nvidia-h200 (issue 7's adapter targets): the dense LoRA chains (qkv, o; ~15 us each per
# layer, 3 launches) on the side stream beside their base GEMM (MOELORA_DENSE_LORA_OVERLAP=1; off by default).
# Its GPU tests (layer, eager and in a graph, bit for bit), then bench decode bf16 and fp8 at batch 64
# with 0/4/8 rank-16 adapters, off then on (~50 s each). If on is faster, make it the default (kernels/_triton.py).
# Files: overlap_tests.log, bench.log, bf16-off/ bf16-on/ fp8-off/ fp8-on/ decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_overlap.py \
    tests/test_graphs_overlap.py::test_overlap_equals_serial > "$OUT/overlap_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/overlap_tests.log" | cut -c1-300 | tail -6
for dt in bfloat16 fp8; do for on in 0 1; do
  MOELORA_DENSE_LORA_OVERLAP=$on timeout 100 python3 -m moelora bench decode --dtype $dt --workloads vllm \
      --batches 64 --adapter-counts 0,4,8 --out "$OUT/${dt/bfloat16/bf16}-$([ $on = 1 ] && echo on || echo off)" \
      >> "$OUT/bench.log" 2>&1
done; done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error" | cut -c1-200
