#!/usr/bin/env bash
# Session 16, call 7 (one H200, the last ~280 s of device time): the per-pair routed-expert LoRA kernel with its
# shrink loop pipelined through shared memory (MOELORA_FUSED_LORA_STAGES / set_fused_lora_stages; Triton only
# pipelines these non-dot loads when the loop asks for it: no cp.async in the kernel before). (1) GPU tests: the
# launch experiments keep the results, the fused MoE pairs graph replay with the pipelined loop; (2)
# scripts/bench_lora_fused.py at 64 tokens, 4 / 8 adapters, gate_up and down, stages 1-4; (3) bench decode fp8
# 128/128 batch 64 with the best stage count of (2) for 4 adapters, if it is not 1.
# Files: tests.log, sweep.log, bench.log, stages/.
source "$(dirname "$0")/../gpu_prelude.sh"
MOELORA_FUSED_LORA_STAGES=3 timeout 40 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_kernels_lora_fused.py -k "launch_experiments or gpu_fused_moe_pairs" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -6
timeout 60 python3 scripts/bench_lora_fused.py --tokens 64 --adapters 4,8 --ranks 16 --cases gate_up,down \
    --stages 1,2,3,4 > "$OUT/sweep.log" 2>&1
grep -v "^WARN" "$OUT/sweep.log" | cut -c1-200 | tail -10
BEST=$(python3 - "$OUT/sweep.log" <<'PY'
import re, sys
rows = [l for l in open(sys.argv[1]) if "store, stages:" in l][:2]  # 4 adapters: gate_up, down
tot = {}
for l in rows:
    for n, t in re.findall(r"(\d+): ([\d.]+)", l.split("stages:")[1]):
        tot[int(n)] = tot.get(int(n), 0.0) + float(t)
print(min(tot, key=tot.get) if len(rows) == 2 else 1)
PY
)
echo "best stages: $BEST"
if [ "$BEST" != 1 ]; then
    MOELORA_FUSED_LORA_STAGES=$BEST timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
        --batches 64 --adapter-counts 0,4,8 --out "$OUT/stages" > "$OUT/bench.log" 2>&1
    grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
fi
true
