#!/usr/bin/env bash
# Session 9, call 4 (one H200), same code as call 3 (5507d13) but this script:
# 1. GPU tests of attention (out_fp8 through e4m3_groups), CUDA graphs, parity;
# 2. bench decode fp8: b128 4/8 adapters with the grouped kernel from 1,024 pairs (call 3: per-pair 6,995 / 6,813);
#    ctx1024 b64 0/4/8; rank 64 b64 0/4/8; 32 adapters b64 (0/32).
# Files: tests.log, bench.log, g128/ ctx/ r64/ a32/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 45 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_attention.py \
    tests/test_cuda_graphs.py tests/test_parity.py -k "gpu or quantizes or padding or graph" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
MOELORA_GROUPED_MIN_PAIRS=1024 timeout 70 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 128 \
    --adapter-counts 4,8 --out "$OUT/g128" > "$OUT/bench.log" 2>&1
timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ctx" >> "$OUT/bench.log" 2>&1
timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --lora-rank 64 --out "$OUT/r64" >> "$OUT/bench.log" 2>&1
timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,32 \
    --out "$OUT/a32" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|rank|Error|error" | cut -c1-160
true
