#!/usr/bin/env bash
# Session 22, call 4: set_fp8_lora_split mode 4 (the LoRA program first in the grid, its tile handed over by a
# flag). (1) GPU tests of modes 0 / 2 / 3 / 4 (against the expand kernel, PDL bit-equal, mode 4 bit-equal to 2);
# (2) the per-call parts (scripts/bench_fp8_lora_gemm_parts.py); (3) the A/B default (mode 2) against mode 4 at fp8
# 128/128 batch 64, 0 / 4 / 8 adapters, profiled with traces, and one layer's kernels for 4 adapters.
# Files: tests.log, parts.log, parts.json, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue_equals_the_expand_kernel or launched_with_pdl_equals or program_first" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 120 python3 scripts/bench_fp8_lora_gemm_parts.py --tokens 64 --adapters 4,8 --json "$OUT/parts.json" \
    > "$OUT/parts.log" 2>&1
echo "parts (rc $?):"; grep -v "^WARN\|^compiled" "$OUT/parts.log" | cut -c1-260 | tail -8
timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --ab "split4:MOELORA_FP8_LORA_SPLIT=4" --out "$OUT/ab" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^split4" | cut -c1-190
cd "$OUT/traces" 2>/dev/null && for f in trace-vllm-b64-a4-all-fused-split40.json.gz; do
  [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -20
done
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
true
