#!/usr/bin/env bash
# Session 32, call 2 (~8 min): the one-launch deferred chain (set_dense_defer_one_launch, kernels/lora_chain_triton.py).
# (1) GPU tests: the kernel compiled (bf16, Qwen3-30B-A3B's qkv shape) against its reference and the two-launch
# chain; every deferred-dense GPU test (decode steps with it on at batch 48 / 160, fp8 and bf16, graph replayed
# twice); the delta kernel's and the FP8 GEMM's mode-3 LoRA epilogue tests (their shared helper was split in two).
# (2) scripts/bench_defer_chain.py: the chain beside its GEMM, one launch at column tiles 128 (default) / 64 / 256.
# (3) one A/B process, two rounds, an A each (the layout short of 90%), fp8 128/128 batch 64, 0 / 4 adapters (the 90% target).
# Files: tests.log, chain.log, chain.json, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
V="default:;one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1;one64:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_BLOCK_N=64"
V="$V;one256:MOELORA_DENSE_DEFER_ONE_LAUNCH=1,MOELORA_LORA_CHAIN_BLOCK_N=256"
timeout -s INT 70 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --variants "$V" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "dense chain beside its GEMM, µs a call (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | tail -6
timeout -s INT 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_lora_chain.py \
    tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "chain + deferred tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py \
    -k "expand_in_the_gemm_epilogue or launched_with_pdl" >> "$OUT/tests.log" 2>&1
echo "fp8 LoRA tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -4
true
