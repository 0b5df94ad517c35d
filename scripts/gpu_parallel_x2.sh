#!/usr/bin/env bash
# Device call on nvidia-h200-x2 (issue 10): the 2-GPU parity tests (TP=2 and EP=2 against one GPU, fp32 and
# bf16 on Qwen3-MoE and DeepSeek-V2; bf16 with CUDA graphs and the side-stream overlap on every rank; shutdown
# within 30 s; the memory plan without a KV size), then bench decode at Qwen3-30B-A3B dimensions for tp=2 (and
# ep=2, tp=1 when T_EP2 / T_TP1 are set) at batch 64 and 256 with 0 and 4 rank-16 adapters. Every process
# prints its stacks every MOELORA_DUMP_STACKS_S seconds (a stuck run shows where).
# Session 4 measured: each 2-GPU test ~30 s (10 tests); tp2/ep2 start-up ~40 s, then ~40 s of adapter writing
# and loading on each rank, then ~5-10 s a case. T_TESTS=0 skips the tests.
# Files: parallel_tests.log, bench.log, tp1/ tp2/ ep2/ decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${T_TESTS:-330}" != 0 ]; then
  MOELORA_DUMP_STACKS_S=200 timeout ${T_TESTS:-330} python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short \
      tests/test_parallel_gpu.py > "$OUT/parallel_tests.log" 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/parallel_tests.log" | cut -c1-400 | tail -10
fi
B="python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4"
export MOELORA_DUMP_STACKS_S=170
[ "${T_TP1:-0}" != 0 ] && CUDA_VISIBLE_DEVICES=0 timeout ${T_TP1} $B --out "$OUT/tp1" >> "$OUT/bench.log" 2>&1
[ "${T_TP2:-160}" != 0 ] && timeout ${T_TP2:-160} $B --tp 2 --out "$OUT/tp2" >> "$OUT/bench.log" 2>&1
[ "${T_EP2:-0}" != 0 ] && timeout ${T_EP2} $B --ep 2 --out "$OUT/ep2" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|loaded|Error" | cut -c1-250
true
