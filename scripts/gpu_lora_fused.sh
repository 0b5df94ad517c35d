#!/usr/bin/env bash
# One device call for the fused decode LoRA kernels: their GPU tests (bf16, Qwen3-30B-A3B shapes, graph replay,
# side-stream store mode), the existing LoRA kernel tests, then the timing table (fused vs current, byte floor).
source "$(dirname "$0")/gpu_prelude.sh"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora_fused.py tests/test_kernels_lora.py \
    tests/test_kernels_moe_lora.py 2>&1 | tee "$OUT/lora_fused_tests.log" | tail -8
# end to end with the switch on: graph replay vs eager, side-stream overlap, parity with PEFT on the GPU kernels
MOELORA_FUSED_LORA=1 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_graphs_overlap.py \
    tests/test_parity.py 2>&1 | tee "$OUT/lora_fused_e2e_tests.log" | tail -8
python3 scripts/compile_check_lora_fused.py 2>&1 | tee "$OUT/compile_check_lora_fused.log" | tail -3
python3 scripts/bench_lora_fused.py 2>&1 | tee "$OUT/bench_lora_fused.log"
python3 scripts/bench_lora_fused.py --tokens 1,16,64 --adapters 4 --ranks 16 --sweep 2>&1 | tee "$OUT/bench_lora_fused_sweep.log"
