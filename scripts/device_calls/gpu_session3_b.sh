#!/usr/bin/env bash
# Session 3, device call B (fused routed-expert LoRA now on by default, fp32 shrink references):
#  1. the GPU tests — the kernel files in 8 pytest-xdist workers, beside them (same GPU) the engine-level
#     GPU tests in one process; then the memory-plan test alone (it reads the GPU's global free memory);
#  2. bench decode bf16, Qwen3-30B-A3B 48 layers, the full grid of the GPU-engine issue (both workloads,
#     batch 1/16/64/128 x 0/1/4/8 rank-16 adapters) in one engine.
# Files: kernel_tests.log, engine_tests.log, bench.log, bf16/decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout ${T_ENG:-230} python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/test_graphs_overlap.py \
    tests/test_cuda_graphs.py tests/test_parity.py tests/test_deepseek_gpu.py -m gpu \
    --deselect tests/test_graphs_overlap.py::test_memory_plan_within_budget > "$OUT/engine_tests.log" 2>&1 &
ENG=$!
timeout ${T_KER:-230} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 --dist loadfile \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora.py \
    tests/test_kernels_fused_moe.py tests/test_kernels_norm.py tests/test_kernels_attention.py \
    tests/test_kernels_mla_triton.py tests/test_fp8_gpu.py tests/test_fp8.py tests/test_nvfp4.py \
    > "$OUT/kernel_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/kernel_tests.log" | cut -c1-500 | tail -15
wait $ENG
grep -E "worst|passed|failed|^FAILED|^ERROR" "$OUT/engine_tests.log" | cut -c1-600 | tail -12
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_graphs_overlap.py::test_memory_plan_within_budget 2>&1 | tail -3 | tee -a "$OUT/engine_tests.log"
timeout ${T_BF16:-290} python3 -m moelora bench decode --out "$OUT/bf16" --workloads vllm,ctx1024 \
    --batches 1,16,64,128 --adapter-counts 0,1,4,8 2>&1 | tee "$OUT/bench.log" | grep -v "^WARN" | tail -40
