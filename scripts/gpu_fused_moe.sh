#!/usr/bin/env bash
# One device call for the fused-MoE base path: its GPU tests (bf16, Qwen3-30B-A3B shapes, graph replay),
# the MoE LoRA kernel tests and pipeline parity (now on the Triton base path), then the layer bench.
source "$(dirname "$0")/gpu_prelude.sh"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused_moe.py tests/test_kernels_moe_lora.py \
    tests/test_graphs_overlap.py tests/test_cuda_graphs.py 2>&1 | tee "$OUT/fused_moe_tests.log" | tail -8
python3 scripts/bench_fused_moe.py --profile 2>&1 | tee "$OUT/bench_fused_moe.log"
python3 scripts/bench_fused_moe.py --lora --tokens 1,64,256 2>&1 | tee "$OUT/bench_fused_moe_lora.log"
