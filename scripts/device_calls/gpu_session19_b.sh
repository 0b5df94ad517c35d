#!/usr/bin/env bash
# Session 19, call 2 (issue 7), with the graph variants and the activation-dtype routed deltas on by default (and the
# serial path computing the same deltas): (1) GPU tests — the new code first (graph variants, fused-MoE overlap and
# LoRA tests), then the graph / overlap engine tests, then the test_fp8_gpu.py tests call 1 did not reach;
# (2) the dense shrink's split-K x K tile per call (scripts/bench_fp8_lora_epilogue.py --shrink-configs);
# (3) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters, the new defaults.
# Files: tests_{a,b,c}.log, shrink.log/json, bench.log, defaults/.
source "$(dirname "$0")/../gpu_prelude.sh"
t() {  # name timeout pytest-args...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu "$@" > "$OUT/tests_$name.log" 2>&1
    echo "tests $name (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests_$name.log" | cut -c1-300 | tail -6
    echo "  dots: $(grep -o '\.' "$OUT/tests_$name.log" | wc -l)"
}
t a 100 tests/test_lora_graph_variants.py tests/test_kernels_lora_fused.py::test_gpu_fused_moe_pairs_graph_replay_and_overlap \
    tests/test_kernels_fused_moe.py -k "lora or graph_variants or overlap"
t b 120 tests/test_graphs_overlap.py tests/test_cuda_graphs.py
t c 100 tests/test_fp8_gpu.py -k "demo or nvfp4_checkpoint_with_lora or nvfp4_moe_layer_with_lora or fast_path_equal"
timeout 70 python3 scripts/bench_fp8_lora_epilogue.py --tokens 64,256 --adapters 4,8 \
    --shrink-configs 0x0,16x64,32x64,16x128,8x128 --json "$OUT/shrink.json" > "$OUT/shrink.log" 2>&1
echo "shrink (rc $?):"; grep -v "^WARN" "$OUT/shrink.log" | tail -42 | cut -c1-150
timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/defaults" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
