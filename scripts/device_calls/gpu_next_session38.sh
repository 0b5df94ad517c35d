#!/usr/bin/env bash
# For session 38 (written in session 37, not run): the whole GPU test suite at HEAD in three calls (PART=1, 2, 3),
# each under the 600 s call limit on a fresh machine. Sessions 10-37 ran the GPU tests of what each change touched;
# no session since 9 has run every file in one go. tests/test_parallel_gpu.py needs 2 GPUs (kind nvidia-h200-x2)
# and is part 4. Files: tests-<part>.log (pytest's summary lines are printed).
source "$(dirname "$0")/../gpu_prelude.sh"
case "${PART:-1}" in
  1) FILES="tests/test_fp8_gpu.py" ;;
  2) FILES="tests/test_kernels_attention.py tests/test_kernels_fused_moe.py tests/test_kernels_lora.py
            tests/test_kernels_lora_fused.py tests/test_kernels_moe_lora_grouped.py tests/test_kernels_router.py
            tests/test_sample_triton.py tests/test_lora_chain.py tests/test_prefill_lora_epilogue.py" ;;
  3) FILES="tests/test_combine_to_norm.py tests/test_cuda_graphs.py tests/test_deepseek_gpu.py
            tests/test_dense_lora_defer.py tests/test_dense_lora_overlap.py tests/test_docs_field_bugs.py
            tests/test_graphs_overlap.py tests/test_long_prefill_gpu.py tests/test_lora_graph_variants.py
            tests/test_no_sync_gpu.py tests/test_parity.py tests/test_streams.py" ;;
  4) FILES="tests/test_parallel_gpu.py" ;;
  *) echo "PART must be 1, 2, 3 or 4"; exit 2 ;;
esac
# shellcheck disable=SC2086
timeout -s INT 540 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $FILES > "$OUT/tests-${PART:-1}.log" 2>&1
echo "GPU tests, part ${PART:-1} (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests-${PART:-1}.log" | cut -c1-250 | tail -12
true
