#!/usr/bin/env bash
# Session 9, call 2 (one H200). The grouped routed-expert LoRA kernel now also groups by the base expert GEMM's
# own alignment (one program per (expert block, slot in it): no alignment launch), the path fused_moe_pairs takes.
# 1. grouped GPU tests (both groupings, graphs); 2. sweep by expert block vs per-pair at 64/128/256 tokens, 4/8
# adapters (store mode); the smallest token count where it wins gives MOELORA_GROUPED_MIN_PAIRS;
# 3. bench decode fp8 128/128 b64/256: grouped off (0/4/8 adapters) and on (4/8), same machine.
# Files: tests.log, sweep.log, sweep.json, best.txt, bench.log, off/ on/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_moe_lora_grouped.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 200 python3 scripts/sweep_moe_lora_grouped.py --tokens 64,128,256 --adapters 4,8 --json "$OUT/sweep.json" \
    --best-out "$OUT/best.txt" > "$OUT/sweep.log" 2>&1
grep -v "^WARN\|warn" "$OUT/sweep.log" | tail -14
MIN=$(python3 -c "
import json, collections
r = json.load(open('$OUT/sweep.json'))['rows']
by = collections.defaultdict(lambda: [0.0, 0.0])
for x in r:
    by[(x['tokens'], x['adapters'])][0] += x['grouped_best_us']; by[(x['tokens'], x['adapters'])][1] += x['per_pair_us']
wins = sorted({t for (t, a) in by if all(by[(t, b)][0] < by[(t, b)][1] for (u, b) in by if u == t)})
print(wins[0] * 8 if wins else 0)" 2>/dev/null || echo 0)
echo "grouped from $MIN pairs; config $(cat "$OUT/best.txt" 2>/dev/null)"
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/off" > "$OUT/bench.log" 2>&1
if [ "$MIN" != 0 ]; then
  MOELORA_GROUPED_LORA=1 MOELORA_GROUPED_MIN_PAIRS=$MIN MOELORA_GROUPED_CONFIG=$(cat "$OUT/best.txt") timeout 110 \
      python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 4,8 \
      --out "$OUT/on" >> "$OUT/bench.log" 2>&1
fi
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
