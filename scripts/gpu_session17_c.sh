#!/usr/bin/env bash
# Session 17, call 3 (one H200): the routed per-pair kernel's loops pipelined 3 deep for 4-warp launches (from 64
# tokens) with B read in whole rank rows there (call 2's sweep best); the dense expands keep the whole-rank-row
# reads (MOELORA_LORA_EVEN_R=0 turns them off). (1) the kernels per call, 16 / 64 tokens, 4 / 8 adapters;
# (2) the grid: bench decode fp8 on both workloads, batch 64 and 256, 0 / 4 / 8 adapters; (3) batch 64 128/128 with
# MOELORA_LORA_EVEN_R=0 (the dense A/B).
# Files: kernels.log, bench.log, grid/, bench_dense_off.log, dense_off/.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 50 python3 scripts/bench_lora_fused.py --tokens 16,64 --adapters 4,8 --ranks 16 \
    > "$OUT/kernels.log" 2>&1; grep -E "gate_up|down|qkv|   o |Error" "$OUT/kernels.log" | cut -c1-150
timeout 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
MOELORA_LORA_EVEN_R=0 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/dense_off" > "$OUT/bench_dense_off.log" 2>&1
grep -v "^WARN" "$OUT/bench_dense_off.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
