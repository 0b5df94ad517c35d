#!/usr/bin/env bash
# One device call: paged-attention GPU tests (split-KV decode, tiled prefill, CUDA-graph replay at
# Qwen3-30B-A3B dims) and the legacy-vs-new timing (decode in CUDA graphs, prefill eager).
source "$(dirname "$0")/gpu_prelude.sh"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | tee "$OUT/attn_tests.log" | tail -8
python3 scripts/bench_attention.py --batches 1 16 64 128 --contexts 128 1024 4096 --prefill 512 2048 \
    2>&1 | tee "$OUT/bench_attention.log"
python3 scripts/bench_attention.py --batches 1 64 --contexts 1024 --max-model-len 40960 \
    2>&1 | tee "$OUT/bench_attention_width.log" | tail -3
