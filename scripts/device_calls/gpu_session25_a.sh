#!/usr/bin/env bash
# Session 25, call 1: (1) the deferral's GPU tests, now also with MOELORA_DENSE_DEFER_EXPAND=consumer (no delta
# kernel: qk_norm_rope and the post-attention norm expand the shrink's h themselves), and the producer-shrink test
# on tests/helpers.attention_lora_decode_case (not run on a GPU since session 24's refactor); (2) one A/B process,
# fp8 128/128 batch 64, 0 / 4 / 8 adapters, traced: the deferred chain at the main priority (normal), the
# consumer-side expand (consumer), both. Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    "tests/test_fp8_gpu.py::test_norm_and_attention_write_the_dense_lora_shrinks_in_a_decode_step" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "normal:MOELORA_DENSE_DEFER_PRIORITY=normal;consumer:MOELORA_DENSE_DEFER_EXPAND=consumer;connormal:MOELORA_DENSE_DEFER_EXPAND=consumer,MOELORA_DENSE_DEFER_PRIORITY=normal" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^normal|^consumer|^connormal" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done
true
