#!/usr/bin/env bash
# Session 4, device call A on nvidia-h200-x2 (GPU code changed since the last H200 run):
#  GPU 0: the single-GPU suite — kernel files in 8 pytest-xdist workers, beside them the engine-level GPU tests,
#         then the memory-plan test alone;
#  GPU 1 (at the same time): bench decode FP8 at batch 64/128 x 0/4/8 adapters with the FP8 experts on the
#         Triton fast path off, then on (issue 7);
#  then both GPUs: the 2-GPU parity tests (issue 10).
# Files: kernel_tests.log, engine_tests.log, fp8_bench.log, off/ on/ decode-*.json, parallel_tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8"
( export CUDA_VISIBLE_DEVICES=1
  MOELORA_FUSED_MOE_QUANT=0 timeout 150 $B --out "$OUT/off" > "$OUT/fp8_bench.log" 2>&1
  MOELORA_FUSED_MOE_QUANT=1 timeout 150 $B --out "$OUT/on" >> "$OUT/fp8_bench.log" 2>&1 ) &
FP8=$!
export CUDA_VISIBLE_DEVICES=0
timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/test_graphs_overlap.py \
    tests/test_cuda_graphs.py tests/test_parity.py tests/test_deepseek_gpu.py -m gpu \
    --deselect tests/test_graphs_overlap.py::test_memory_plan_within_budget > "$OUT/engine_tests.log" 2>&1 &
ENG=$!
timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 --dist loadfile \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora.py \
    tests/test_kernels_fused_moe.py tests/test_kernels_norm.py tests/test_kernels_attention.py \
    tests/test_kernels_mla_triton.py tests/test_fp8_gpu.py tests/test_fp8.py tests/test_nvfp4.py \
    > "$OUT/kernel_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/kernel_tests.log" | cut -c1-500 | tail -15
wait $ENG
grep -E "worst|passed|failed|^FAILED|^ERROR" "$OUT/engine_tests.log" | cut -c1-600 | tail -12
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_graphs_overlap.py::test_memory_plan_within_budget 2>&1 | tail -3 | tee -a "$OUT/engine_tests.log"
wait $FP8
grep -v "^WARN" "$OUT/fp8_bench.log" | grep -E "batch|tok/s|kept|Error|error" | cut -c1-200 | tail -24
unset CUDA_VISIBLE_DEVICES
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
    > "$OUT/parallel_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/parallel_tests.log" | cut -c1-400 | tail -10
