#!/usr/bin/env bash
# Session 17, call 1 (one H200): the routed-expert LoRA programs inside the FP8 expert GEMM's launch
# (set_fp8_moe_lora_colaunch / MOELORA_FP8_MOE_LORA_COLAUNCH=1, off by default until measured), and the fused LoRA
# kernel's body moved into a @triton.jit helper (moe_lora_pair_program) shared by both.
# (1) GPU tests: the co-launch test, the fused LoRA kernel's GPU tests (refactor), the FP8 MoE layer;
# (2) per layer call: base / side stream / main stream / co-launch (bench_fp8_moe_colaunch.py), and the standalone
#     fused kernel at 64 tokens (bench_lora_fused.py, against session 16's 23.7 / 16.4 µs store mode);
# (3) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters: default, then MOELORA_FP8_MOE_LORA_COLAUNCH=1.
# (A record of call 1 at commit b6b9e16: the co-launch was removed after it and bench_fp8_moe_colaunch.py became
# bench_fp8_moe_lora_layer.py.)
# Files: tests.log, layer.json, layer.log, fused.log, bench_default.log, bench_colaunch.log, default/, colaunch/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 130 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    tests/test_kernels_lora_fused.py -k "colaunch or lora_programs or moe_layer or gpu_moe_fused or graph_replay_and_overlap" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
timeout 70 python3 scripts/bench_fp8_moe_colaunch.py --tokens 16,64 --adapters 4,8 --out "$OUT/layer.json" \
    > "$OUT/layer.log" 2>&1; grep -v "^WARN\|Warning\|warn" "$OUT/layer.log" | tail -8
timeout 40 python3 scripts/bench_lora_fused.py --tokens 64 --adapters 4 --ranks 16 --cases gate_up,down \
    > "$OUT/fused.log" 2>&1; grep -E "gate_up|down|Error" "$OUT/fused.log" | cut -c1-150 | tail -4
timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/default" > "$OUT/bench_default.log" 2>&1
grep -v "^WARN" "$OUT/bench_default.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
MOELORA_FP8_MOE_LORA_COLAUNCH=1 timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64 --adapter-counts 0,4,8 --out "$OUT/colaunch" > "$OUT/bench_colaunch.log" 2>&1
grep -v "^WARN" "$OUT/bench_colaunch.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
