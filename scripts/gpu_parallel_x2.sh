#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 10): the 2-GPU parity tests (TP=2 and EP=2 against one GPU, fp32 and
# bf16; bf16 runs with CUDA graphs and the side-stream overlap on every rank), then bench decode at
# Qwen3-30B-A3B dimensions for tp=1, tp=2 and ep=2 at batch 64 and 256 with 0 and 4 rank-16 adapters.
# Files: parallel_tests.log, bench.log, tp1/ tp2/ ep2/ decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
    2>&1 | tee "$OUT/parallel_tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-400 | tail -10
B="python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4"
timeout ${T_TP1:-120} $B --out "$OUT/tp1" 2>&1 | tee "$OUT/bench.log" | grep -v "^WARN" | tail -6
timeout ${T_TP2:-150} $B --tp 2 --out "$OUT/tp2" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -6
timeout ${T_EP2:-150} $B --ep 2 --out "$OUT/ep2" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -6
