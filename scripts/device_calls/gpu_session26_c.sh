#!/usr/bin/env bash
# Session 26, call 3 (the last of its device time): (1) one A/B process, fp8 128/128 batch 64, shared-A adapters:
# the fused kernel's grid slice first (MOELORA_FUSED_LORA_SLICE_FIRST=1: gate and up programs of a pair side by
# side, so the up program's read of the shared A finds it in L2) against the default; (2) the GPU tests touched by
# shared-A on by default: the fused kernel's, PEFT parity on the GPU, FP8, CUDA graphs, overlap (SIGINT at the
# limit so pytest still prints its summary). Files: ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --out "$OUT/ab" --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/ab.log" 2>&1
echo "slice first (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
timeout -s INT 330 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "tests/test_kernels_lora_fused.py::test_gpu_shared_a_switch_reads_one_copy_and_changes_nothing" \
    tests/test_parity.py::test_mixed_batch_on_gpu_with_kernels \
    tests/test_fp8_gpu.py tests/test_cuda_graphs.py tests/test_graphs_overlap.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
true
