#!/usr/bin/env bash
# Session 3, device call A: the graph-vs-eager tests (routing-aware 200 steps), the LoRA kernel tests in bf16
# on the GPU (fused and unfused), the fused-vs-current LoRA kernel timings, and bench decode with the fused
# LoRA kernels on and off (one engine, graphs recaptured). Files: graph_tests.log, lora_kernel_tests.log,
# bench_lora_fused.log, bench.log, fused/decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout ${T_GRAPH:-200} python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/test_graphs_overlap.py tests/test_cuda_graphs.py 2>&1 | tee "$OUT/graph_tests.log" \
    | grep -E "worst|passed|failed|^FAILED|^ERROR|Error" | cut -c1-600 | tail -12
timeout ${T_LORA:-130} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    tests/test_kernels_lora.py tests/test_kernels_moe_lora.py 2>&1 | tee "$OUT/lora_kernel_tests.log" \
    | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-400 | tail -8
timeout ${T_FB:-80} python3 scripts/bench_lora_fused.py --tokens 1,16,64,128 --adapters 4,8 --ranks 16 2>&1 \
    | tee "$OUT/bench_lora_fused.log" | tail -30
timeout ${T_DEC:-170} python3 -m moelora bench decode --out "$OUT/fused" --workloads vllm --batches 1,64 \
    --adapter-counts 0,4 --fused-lora both 2>&1 | tee "$OUT/bench.log" | grep -v "^WARN" | tail -12
