#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 10): the 2-GPU parity tests (TP=2 and EP=2 against one GPU, fp32 and
# bf16; bf16 runs with CUDA graphs and the side-stream overlap on every rank; shutdown within 30 s), then bench
# decode at Qwen3-30B-A3B dimensions for tp=2 and ep=2 (and tp=1 unless T_TP1=0) at batch 64 and 256 with 0 and
# 4 rank-16 adapters. Every process prints its stacks every MOELORA_DUMP_STACKS_S seconds (a stuck run shows
# where). Session 4 measured: tp2/ep2 start-up ~40 s, then ~40 s writing and loading the adapters on each rank.
# Files: parallel_tests.log, bench.log, tp1/ tp2/ ep2/ decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MOELORA_DUMP_STACKS_S=200 timeout ${T_TESTS:-250} python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short \
    tests/test_parallel_gpu.py > "$OUT/parallel_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/parallel_tests.log" | cut -c1-400 | tail -10
B="python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4"
export MOELORA_DUMP_STACKS_S=170
[ "${T_TP1:-0}" != 0 ] && CUDA_VISIBLE_DEVICES=0 timeout ${T_TP1} $B --out "$OUT/tp1" >> "$OUT/bench.log" 2>&1
timeout ${T_TP2:-160} $B --tp 2 --out "$OUT/tp2" >> "$OUT/bench.log" 2>&1
timeout ${T_EP2:-160} $B --ep 2 --out "$OUT/ep2" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|loaded|Error" | cut -c1-250
