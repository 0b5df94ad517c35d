#!/usr/bin/env bash
# Session 9, call 1 (one H200). The grouped routed-expert LoRA kernel, rewritten (store mode without a fill,
# tensor-core expand with hv split hi/lo instead of session 7's fp32 FMA dot; zero programs for base rows):
# 1. its GPU tests; 2. the sweep against the per-pair kernel (store mode, 64/256 tokens, 4/8 adapters);
# 3. if it wins any 256-token case: bench decode fp8 128/128 b64/256 with it off (0/4/8 adapters) and on (4/8).
# Files: tests.log, sweep.log, sweep.json, best.txt, bench.log, off/ on/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_moe_lora_grouped.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 240 python3 scripts/sweep_moe_lora_grouped.py --tokens 64,256 --adapters 4,8 --json "$OUT/sweep.json" \
    --best-out "$OUT/best.txt" > "$OUT/sweep.log" 2>&1
grep -v "^WARN\|warn" "$OUT/sweep.log" | tail -12
WIN=$(python3 -c "
import json; r=json.load(open('$OUT/sweep.json'))['rows']
print(int(any(x['grouped_best_us'] + x['align_us'] / 2 < x['per_pair_us'] for x in r if x['tokens'] == 256)))" 2>/dev/null || echo 0)
echo "grouped wins a 256-token case: $WIN; config $(cat "$OUT/best.txt" 2>/dev/null)"
if [ "$WIN" = 1 ]; then
  timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --out "$OUT/off" > "$OUT/bench.log" 2>&1
  MOELORA_GROUPED_LORA=1 MOELORA_GROUPED_CONFIG=$(cat "$OUT/best.txt") timeout 100 python3 -m moelora bench decode \
      --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 4,8 --out "$OUT/on" >> "$OUT/bench.log" 2>&1
  grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
fi
true
