#!/usr/bin/env bash
# Session 14, call 4 (one H200): the single-adapter dense LoRA path now needs >= 1,024 tokens on a GPU and a
# non-FP8 base (call 3's per-call figures). GPU tests that run dense LoRA with one adapter outside graphs or
# compare eager with graphs: the new path test, the dense LoRA kernels, parity with PEFT, graphs (+ overlap),
# dense overlap, streams, no-sync, DeepSeek; and the FP8 test call 3's time limit cut.
# Files: tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_lora.py \
    tests/test_kernels_lora_fused.py tests/test_parity.py tests/test_cuda_graphs.py tests/test_graphs_overlap.py \
    tests/test_dense_lora_overlap.py tests/test_streams.py tests/test_no_sync_gpu.py tests/test_deepseek_gpu.py \
    "tests/test_fp8_gpu.py::test_fp8_experts_fast_path_equal_their_grouped_path_qwen3_shapes" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -20
true
