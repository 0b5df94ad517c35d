#!/usr/bin/env bash
# Session 22, call 1: where one layer's time goes with and without LoRA. (1) The producer-shrink A/B (default, norm,
# norm + attention) at fp8 128/128 batch 64, 0 / 4 / 8 adapters, 3 profiled steps each with their kernel traces;
# (2) attention-only and experts-only adapters (4), profiled and traced; (3) one layer's kernels in order
# (python -m moelora.bench.trace) for the key cases. Files: bench.log, targets.log, ab/, targets/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
N=MOELORA_LORA_NORM_SHRINK=1; A=MOELORA_LORA_ATTN_SHRINK=1
timeout 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --ab "norm:$N;both:$N,$A" --out "$OUT/ab" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^norm|^both" | cut -c1-190
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --lora-targets attention,experts --profile-steps 3 --profile-trace "$OUT/traces/targets" --out "$OUT/targets" \
    > "$OUT/targets.log" 2>&1
echo "targets (rc $?):"; grep -v "^WARN" "$OUT/targets.log" | grep -E "tok/s|Error|Traceback|^ +[+-][0-9]" | cut -c1-190
cd "$OUT/traces" 2>/dev/null && for f in trace-vllm-b64-a0-none-default0.json.gz trace-vllm-b64-a4-all-default0.json.gz \
    trace-vllm-b64-a4-all-both0.json.gz targets/trace-vllm-b64-a4-attention.json.gz; do
  [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -40
done
true
