#!/usr/bin/env bash
# Session 31, call 2 (~8 min): combine-to-norm is now the default. (1) the GPU tests of the engine paths it touches
# that call 1 did not run with it on (deferred dense LoRA, graphs + overlap, no-sync, graph variants, DeepSeek with
# shared experts (not deferred), dense overlap, NVFP4, the whole GPU part of test_parity); (2) the grid at the new
# defaults: fp8, 128/128 and ctx 1,024, 0 / 4 / 8 adapters, both expert LoRA layouts, batch 64 (and 256 for 128/128
# shared-A). Files: tests.log, grid_*.log, grid_*/.
source "$(dirname "$0")/gpu_prelude.sh"
timeout -s INT 210 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_dense_lora_defer.py \
    tests/test_graphs_overlap.py tests/test_no_sync_gpu.py tests/test_lora_graph_variants.py tests/test_deepseek_gpu.py \
    tests/test_dense_lora_overlap.py tests/test_nvfp4.py tests/test_parity.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
grid() {  # name layout workload batches
    timeout -s INT 110 python3 -m moelora bench decode --dtype fp8 --workloads "$3" --batches "$4" --adapter-counts 0,4,8 \
        --expert-lora-layout "$2" --out "$OUT/grid_$1" > "$OUT/grid_$1.log" 2>&1
    echo "grid $1 (rc $?):"; grep -v "^WARN" "$OUT/grid_$1.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
}
grid separate-vllm separate vllm 64
grid shared-vllm shared-a vllm 64,256
grid separate-ctx separate ctx1024 64
grid shared-ctx shared-a ctx1024 64
true
