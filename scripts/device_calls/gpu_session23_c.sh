#!/usr/bin/env bash
# Session 23, call 3: set_lora_shrink_stacked (the dense decode shrink with the slot groups side by side: one
# program per (row block, slice, split) instead of one per (group, row block, slice, split)). (1) its GPU tests (the
# kernel at a 4096-wide qkv shape; the FP8 GEMM with PDL after it, bit-equal to the plain launch, in graphs);
# (2) A/B at fp8 128/128 batch 64, 0 / 4 / 8 adapters (rank 16, all targets), profiled, one layer for 4 adapters.
# Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora.py tests/test_fp8_gpu.py \
    -k "stacked or launched_with_pdl_equals" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 240 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" --ab "stacked:MOELORA_LORA_SHRINK_STACKED=1" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^stacked" | grep -v "^ \+[+-][0-9.]* us  ([0-9.]* -> [0-9.]*)  \(_paged\|_route\|nvjet\|_moe_align\|Memcpy\)" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
for f in "$OUT"/traces/*stacked0.json.gz; do [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -22; done
true
