#!/usr/bin/env bash
# Session 4, device call C on nvidia-h200-x2: the single-GPU kernel tests again (GPU 0; call A's run was cut
# before its failure list), beside them the 2-GPU tests with every process printing its stacks every 100 s
# (call A's bf16 case did not finish); then bench decode tp=2 and ep=2 (dummy weights now drawn on the GPU).
# Files: kernel_tests.log, parallel_tests.log, bench.log, tp2/ ep2/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -rf --tb=line -n 8 --dist loadfile \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora.py \
    tests/test_kernels_fused_moe.py tests/test_kernels_norm.py tests/test_kernels_attention.py \
    tests/test_kernels_mla_triton.py tests/test_fp8_gpu.py tests/test_fp8.py tests/test_nvfp4.py \
    > "$OUT/kernel_tests.log" 2>&1 &
KER=$!
MOELORA_DUMP_STACKS_S=100 timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short \
    tests/test_parallel_gpu.py > "$OUT/parallel_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/parallel_tests.log" | cut -c1-400 | tail -8
wait $KER
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/kernel_tests.log" | cut -c1-300 | tail -12
B="python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4"
MOELORA_DUMP_STACKS_S=110 timeout 125 $B --tp 2 --out "$OUT/tp2" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error" | cut -c1-250
MOELORA_DUMP_STACKS_S=110 timeout 125 $B --ep 2 --out "$OUT/ep2" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error" | cut -c1-250 | tail -6
