#!/usr/bin/env bash
# Written in session 24 after its device time ran out, for the next session's first call: (1) the GPU tests that
# moved onto tests/helpers.attention_lora_decode_case (not run on a GPU since); (2) one A/B process, traced: the
# deferred dense LoRA chain on a stream of its own at the main stream's priority (MOELORA_DENSE_DEFER_PRIORITY=normal)
# against the shared high-priority side stream; (3) batch 256 with session 24's defaults (not measured there).
# Files: tests.log, bench.log, ab/, traces/, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    "tests/test_fp8_gpu.py::test_norm_and_attention_write_the_dense_lora_shrinks_in_a_decode_step" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" --ab "normal:MOELORA_DENSE_DEFER_PRIORITY=normal" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^normal" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
cd "$OUT/traces" 2>/dev/null && for f in *a4*normal*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -26; done
cd - > /dev/null
timeout 220 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 256 --adapter-counts 0,4,8 \
    --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
