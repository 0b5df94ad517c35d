#!/usr/bin/env bash
# Session 4, device call B on nvidia-h200-x2 (issue 10): bench decode at Qwen3-30B-A3B dimensions (bf16, graphs,
# overlap) for tp=1, tp=2 and ep=2 at batch 64 and 256 with 0 and 4 rank-16 adapters.
# Files: bench.log, tp1/ tp2/ ep2/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
B="python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4"
CUDA_VISIBLE_DEVICES=0 timeout 130 $B --out "$OUT/tp1" 2>&1 | tee "$OUT/bench.log" | grep -v "^WARN" | tail -6
timeout 170 $B --tp 2 --out "$OUT/tp2" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -6
timeout 170 $B --ep 2 --out "$OUT/ep2" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -6
