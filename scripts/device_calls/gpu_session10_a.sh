#!/usr/bin/env bash
# Session 10, call 1 (one H200). The two-pass grouped routed-expert LoRA kernels (moe_lora_grouped_split_triton.py:
# shrink split over the input dim, then one output tile per program):
# 1. GPU tests of the grouped kernels (one-launch and two-pass) and of the per-pair fused kernel;
# 2. the sweep: per-pair against the one-launch default and 24 two-pass configs (store mode, 64/256 tokens, 4/8
#    adapters; best.txt = the least total);
# 3. bench decode fp8 128/128: today's defaults (b64/256, 0/4/8 adapters), then the two-pass kernels with best.txt
#    from 512 pairs (b64/256, 4/8 adapters). Files: tests.log, sweep.log, sweep.json, best.txt, bench.log, base/ two/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_moe_lora_grouped.py \
    tests/test_kernels_lora_fused.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 240 python3 scripts/sweep_moe_lora_grouped.py --tokens 64,256 --adapters 4,8 --json "$OUT/sweep.json" \
    --best-out "$OUT/best.txt" > "$OUT/sweep.log" 2>&1
grep -v "^WARN\|warn" "$OUT/sweep.log" | tail -14
CFG=$(cat "$OUT/best.txt" 2>/dev/null || echo "128,128,4,3,512")
echo "two-pass config: $CFG"
timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/base" > "$OUT/bench.log" 2>&1
MOELORA_GROUPED_CONFIG=$CFG MOELORA_GROUPED_MIN_PAIRS=512 timeout 100 python3 -m moelora bench decode \
    --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 4,8 --out "$OUT/two" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
