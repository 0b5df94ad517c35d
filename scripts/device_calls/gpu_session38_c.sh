#!/usr/bin/env bash
# Session 38, call C (<= 10 min on a fresh machine; at most 8 files come back, so every step's output goes to
# c.log). (1) Call B's one failure, test_fp8_experts_fast_path_equal_their_grouped_path_qwen3_shapes[300] (its
# log did not come back): the test at 300 tokens with the prefill LoRA epilogue at its default (mode 3), off (0,
# the grouped kernel's delta path) and mode 1, the assertion's message printed. (2) The batch-64 grid at the
# session's defaults (the down LoRA issued before the activation, on since call A): fp8, 128/128 and ctx 1,024,
# 0 / 4 / 8 adapters, both expert LoRA layouts, one process each. (3) bf16, where the switch applies too: one A/B
# process, one round, 128/128 batch 64, 0 / 4 adapters, the switch off against on.
# Files: c.log, grid_*/ (4 JSON), ab-bf16/ (1 JSON).
source "$(dirname "$0")/../gpu_prelude.sh"
LOG="$OUT/c.log"
T=tests/test_fp8_gpu.py::test_fp8_experts_fast_path_equal_their_grouped_path_qwen3_shapes
for mode in default 0 1; do
  echo "=== (1) $T[300], MOELORA_PREFILL_LORA_EPILOGUE=$mode" >> "$LOG"
  if [ "$mode" = default ]; then e=MOELORA_UNUSED=0; else e=MOELORA_PREFILL_LORA_EPILOGUE=$mode; fi
  env $e timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$T[300]" >> "$LOG" 2>&1
  echo "epilogue $mode (rc $?): $(grep -E "passed|failed" "$LOG" | tail -1)"; grep -E "^E  " "$LOG" | tail -3 | cut -c1-200
done
grid() {  # name layout workload
  echo "=== (2) grid $1" >> "$LOG"
  timeout -s INT 105 python3 -m moelora bench decode --dtype fp8 --workloads "$3" --batches 64 --adapter-counts 0,4,8 \
      --expert-lora-layout "$2" --out "$OUT/grid_$1" > "$OUT/g.tmp" 2>&1
  echo "grid $1 (rc $?):"; grep -v "^WARN" "$OUT/g.tmp" | tee -a "$LOG" | grep -E "tok/s|Error|Traceback" | cut -c1-190
}
grid separate-vllm separate vllm
grid separate-ctx separate ctx1024
grid shared-vllm shared-a vllm
grid shared-ctx shared-a ctx1024
rm -f "$OUT/g.tmp"
echo "=== (3) bf16 A/B" >> "$LOG"
timeout -s INT 100 python3 -m moelora bench decode --dtype bf16 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 1 --out "$OUT/ab-bf16" --ab "off:MOELORA_MOE_LORA_EARLY_DOWN=0" > "$OUT/g.tmp" 2>&1
echo "bf16 A/B (rc $?):"; grep -v "^WARN" "$OUT/g.tmp" | tee -a "$LOG" | grep -E "Error|Traceback|^A/B|^variant|^default|^off" | cut -c1-190
rm -f "$OUT/g.tmp"
true
