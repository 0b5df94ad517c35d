#!/usr/bin/env bash
# Session 21, call 2: every GPU test at HEAD (session 20 changed Attention.forward's decode branch, a default path;
# call 1 ran the attention, norm and FP8 LoRA tests it touched). Files: tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 500 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=12 -m gpu tests/test_cuda_graphs.py tests/test_deepseek_gpu.py tests/test_dense_lora_overlap.py tests/test_fp8_gpu.py tests/test_graphs_overlap.py tests/test_kernels_attention.py tests/test_kernels_fused_moe.py tests/test_kernels_lora.py tests/test_kernels_lora_fused.py tests/test_kernels_moe_lora_grouped.py tests/test_lora_graph_variants.py tests/test_no_sync_gpu.py tests/test_parallel_gpu.py tests/test_parity.py tests/test_sample_triton.py tests/test_streams.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  |^SKIPPED" "$OUT/tests.log" | cut -c1-240 | tail -30
true
