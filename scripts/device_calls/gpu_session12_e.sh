#!/usr/bin/env bash
# Session 12, call 5 (one H200): the final code's GPU tests for what changed: the sampler (auto mode from
# FUSED_SAMPLER_MIN_ROWS rows) and the per-pair LoRA kernel back at its session-11 code (Qwen3 shapes, graph
# replay and overlap). File: tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_sample_triton.py \
    tests/test_kernels_lora_fused.py -k "sample or fast_path or auto_mode or moe_fused_qwen3 or graph_replay" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
