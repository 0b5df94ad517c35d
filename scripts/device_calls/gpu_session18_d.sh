#!/usr/bin/env bash
# Session 18, call 4 (one H200): the routed LoRA kernel taking the pairs expert by expert
# (MOELORA_FUSED_LORA_ORDER=expert: the base alignment's sorted order, so the pairs of one (slot, expert) read their
# factors side by side), and B not loaded for slots of rank 0 in the whole-rank-row form (attention-only adapters
# made the routed kernel read every pair's B and zero it: 1,381 µs a step of kernel time for no work, call 3).
# (1) GPU tests of the changed kernels; (2) per call at 64 tokens, 4 / 8 adapters, token vs expert order;
# (3) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters: expert order on (adapters on all targets and on
# attention only), then the default (token order, all targets).
# Files: tests.log, kernels.log, bench_order.log, bench_default.log, order/, default/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_lora_fused.py \
    tests/test_kernels_fused_moe.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 60 python3 scripts/bench_lora_fused.py --tokens 64 --adapters 4,8 --ranks 16 --cases gate_up,down \
    --order > "$OUT/kernels.log" 2>&1; grep -E "gate_up|down|expert|Error" "$OUT/kernels.log" | cut -c1-150
MOELORA_FUSED_LORA_ORDER=expert timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64 --adapter-counts 0,4,8 --lora-targets all,attention --out "$OUT/order" > "$OUT/bench_order.log" 2>&1
echo "order=expert:"; grep -v "^WARN" "$OUT/bench_order.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-200
timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/default" > "$OUT/bench_default.log" 2>&1
echo "default (token order):"; grep -v "^WARN" "$OUT/bench_default.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-200
true
