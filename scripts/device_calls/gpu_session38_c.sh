#!/usr/bin/env bash
# Session 38, call C (~7 min on a fresh machine): the batch-64 grid at the session's defaults (the down LoRA issued
# before the activation, on since call A): fp8, 128/128 and ctx 1,024, 0 / 4 / 8 adapters, both expert LoRA
# layouts (an A each; gate and up sharing A), one process each; then bf16 (the switch applies there too, untimed
# so far): one A/B process, one round, 128/128 batch 64, 0 / 4 adapters, the switch off against on.
# Files: grid_*.log, grid_*/, ab-bf16.log, ab-bf16/.
source "$(dirname "$0")/../gpu_prelude.sh"
grid() {  # name layout workload batches
    timeout -s INT 115 python3 -m moelora bench decode --dtype fp8 --workloads "$3" \
        --batches "$4" --adapter-counts 0,4,8 --expert-lora-layout "$2" --out "$OUT/grid_$1" > "$OUT/grid_$1.log" 2>&1
    echo "grid $1 (rc $?):"; grep -v "^WARN" "$OUT/grid_$1.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
}
grid separate-vllm separate vllm 64
grid separate-ctx separate ctx1024 64
grid shared-vllm shared-a vllm 64
grid shared-ctx shared-a ctx1024 64
timeout -s INT 120 python3 -m moelora bench decode --dtype bf16 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 1 --out "$OUT/ab-bf16" --ab "off:MOELORA_MOE_LORA_EARLY_DOWN=0" > "$OUT/ab-bf16.log" 2>&1
echo "bf16 A/B (rc $?):"; grep -v "^WARN" "$OUT/ab-bf16.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^off" | cut -c1-190
true
