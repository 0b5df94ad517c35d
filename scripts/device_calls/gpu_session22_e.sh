#!/usr/bin/env bash
# Session 22, call 5: with set_fp8_lora_split mode 4 the default, (1) the GPU tests of the paths it changes — the
# engine with graphs and the overlap, graph variants, the FP8 demo model and graph tests (the FP8 LoRA GEMM tests of
# every mode ran in call 4); (2) fp8 128/128 at batch 64 (BATCHES=64,256 for more), 0 / 4 / 8 adapters (rank 16,
# all targets). Files: tests.log, bench.log, vllm/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short -m gpu tests/test_graphs_overlap.py \
    tests/test_cuda_graphs.py tests/test_lora_graph_variants.py tests/test_fp8_gpu.py -k "demo or graph" \
    > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -cE "PASSED" "$OUT/tests.log"; grep -E "passed|failed|FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches ${BATCHES:-64} --adapter-counts 0,4,8 \
    --out "$OUT/vllm" > "$OUT/bench.log" 2>&1
echo "128/128 (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
