#!/usr/bin/env bash
# Session 26, call 4 (call 3 was lost: the machine was taken back mid-call, ~400 s of device time left): call 3
# cut down: the GPU tests first (shared-A on by default; the shared-A GPU test also checks SHARED_H and SLICE_FIRST
# bit-equal end to end), SIGINT at the limit; then the slice-first A/B at 0 / 4 adapters only. Files: tests.log, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "tests/test_kernels_lora_fused.py::test_gpu_shared_a_switch_reads_one_copy_and_changes_nothing" \
    tests/test_parity.py::test_mixed_batch_on_gpu_with_kernels tests/test_cuda_graphs.py \
    tests/test_graphs_overlap.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --expert-lora-layout shared-a --out "$OUT/ab" --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/ab.log" 2>&1
echo "slice first (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "tok/s|Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
true
