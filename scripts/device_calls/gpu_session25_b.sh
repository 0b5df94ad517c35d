#!/usr/bin/env bash
# Session 25, call 2: why the plain dense GEMM takes 14 µs beside the deferred chain (8.4-9.5 alone) even when that
# chain is a 6-µs shrink alone (call 1, consumer expand). Suspect: the shrink's CTAs (issued first, high priority,
# split-K 8: up to hundreds of CTAs) take the SMs' registers before the GEMM's are placed. One A/B process, fp8
# 128/128 batch 64, traced: the GEMM issued first (MOELORA_DENSE_DEFER_ORDER=gemm), the shrink with fewer K splits
# (MOELORA_LORA_SHRINK_SPLITS=2 / 4), both. Then the order switch's GPU test. Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "gemm:MOELORA_DENSE_DEFER_ORDER=gemm;split2:MOELORA_LORA_SHRINK_SPLITS=2;split4:MOELORA_LORA_SHRINK_SPLITS=4;gemmsplit2:MOELORA_DENSE_DEFER_ORDER=gemm,MOELORA_LORA_SHRINK_SPLITS=2" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^gemm|^split" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24 | grep -E "us$|fp8_gemm|shrink|delta|norm|side"; done
cd - > /dev/null
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "tests/test_dense_lora_defer.py::test_deferred_chain_issued_after_the_gemm_changes_nothing" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
