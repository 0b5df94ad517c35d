#!/usr/bin/env bash
# Session 14, call 6 (one H200): the routed-expert LoRA kernel with a fixed number of programs looping over the
# pairs (MOELORA_FUSED_LORA_PROGRAMS; PERSIST in _moe_lora_fused_kernel), so that it holds one or two CTAs per SM
# beside the FP8 expert GEMM's instead of alternating with them (call 1: 452 of its 2,036 us a step beside other
# kernels). GPU test of the variant, then bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters with the timeline:
# default, 132 programs, 264 programs. Files: tests.log, bench.log, default/ p132/ p264/. (Measured slower: the
# switch was removed after this call; commit 62e298d has it.)
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    -k "persistent or gpu_moe_fused_qwen3" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
run() {  # name, env...
    local name=$1; shift
    env "$@" timeout 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
        --adapter-counts 0,4,8 --profile-steps 3 --out "$OUT/$name" >> "$OUT/bench.log" 2>&1
}
run default MOELORA_NONE=1
run p132 MOELORA_FUSED_LORA_PROGRAMS=132
run p264 MOELORA_FUSED_LORA_PROGRAMS=264
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|_moe_lora_fused|Error|Traceback" | cut -c1-200
grep -v "^WARN" "$OUT/bench.log" | grep -E "timeline" | sed -E 's/busy by stream.*(.lora. kernels)/\1/' | cut -c1-220
true
