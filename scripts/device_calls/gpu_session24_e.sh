#!/usr/bin/env bash
# Session 24, call 4: call 3's four failures (set_fp8_lora_split mode 4 at 3 / 256 rows, run after the deferral's
# tests) alone, then after the deferral's decode-step test (order dependence?); the graph tests call 3 did not reach;
# then the batch-64 grid with the session's defaults (both workloads, 0 / 4 / 8 adapters). Files: t1-3.log, bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
P="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
F=tests/test_fp8_gpu.py
timeout 60 $P "$F::test_fp8_lora_expand_in_the_gemm_epilogue_equals_the_expand_kernel[3-4]" \
    "$F::test_fp8_lora_expand_in_the_gemm_epilogue_equals_the_expand_kernel[256-4]" \
    "$F::test_fp8_lora_program_first_is_bit_equal_to_the_lora_partial" > "$OUT/t1.log" 2>&1
echo "alone (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/t1.log" | cut -c1-250 | head -12
timeout 90 $P "tests/test_dense_lora_defer.py::test_deferred_dense_lora_in_a_decode_step" \
    "$F::test_fp8_lora_program_first_is_bit_equal_to_the_lora_partial" > "$OUT/t2.log" 2>&1
echo "after the decode step (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/t2.log" | cut -c1-250 | head -12
timeout 100 $P tests/test_graphs_overlap.py tests/test_lora_graph_variants.py > "$OUT/t3.log" 2>&1
echo "graphs (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/t3.log" | cut -c1-250 | tail -8
timeout 260 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
