#!/usr/bin/env bash
# Session 22, call 2: set_fp8_lora_split mode 3 (the dense expand's metadata loads before the K steps, one dot
# after them, no split-K partial). (1) Its GPU tests: against the expand kernel and the other modes' form, PDL
# bit-equal to the plain launch over graph replays; (2) the A/B against the default (mode 2) at fp8 128/128 batch
# 64, 0 / 4 / 8 adapters, profiled with traces; (3) one layer's kernels for 4 adapters under each.
# Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue_equals_the_expand_kernel or launched_with_pdl_equals" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 240 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --ab "split3:MOELORA_FP8_LORA_SPLIT=3" --out "$OUT/ab" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^split3" | cut -c1-190
cd "$OUT/traces" 2>/dev/null && for f in trace-vllm-b64-a4-all-fused-default0.json.gz trace-vllm-b64-a4-all-fused-split30.json.gz; do
  [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -24
done
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*  # keep the files returned within the count limit
true
