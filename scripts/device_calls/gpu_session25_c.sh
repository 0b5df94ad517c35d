#!/usr/bin/env bash
# Session 25, call 3: (1) one A/B process, fp8 128/128 batch 64, traced: the deferred chain on the main stream before
# its GEMM (MOELORA_DENSE_DEFER_ORDER=serial, a diagnostic: is the GEMM 8.4-9.5 µs again without a kernel beside
# it?) and the shrink with 4 K splits (MOELORA_LORA_SHRINK_SPLITS=4, +0.2% / +0.3% in call 2), 2 rounds;
# (2) the grid with the defaults, both workloads, batch 64 and 256; (3) the order test. Files: bench.log, ab/,
# traces/, grid/, grid.log, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 220 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" --ab-rounds 2 \
    --ab "serial:MOELORA_DENSE_DEFER_ORDER=serial;split4:MOELORA_LORA_SHRINK_SPLITS=4" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^serial|^split" | cut -c1-190
rm -f "$OUT"/traces/*a8* "$OUT"/traces/*1.json.gz
cd "$OUT/traces" 2>/dev/null && for f in *a4*serial* *a0*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done
cd - > /dev/null
timeout 290 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "tests/test_dense_lora_defer.py::test_deferred_chain_issued_after_the_gemm_changes_nothing" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
