#!/usr/bin/env bash
# Session 39, call C (~8 min): the README's grid at the present defaults, batch 64 and 256, fp8, 128/128 and
# ctx 1,024, 0 / 4 / 8 adapters, both expert LoRA layouts, one process each, now with the floor at the read
# bandwidth beside the copy one (README's batch-256 rows were from sessions 25 / 29).
# Files: c.log and grid_*/ (4 JSON).
source "$(dirname "$0")/../gpu_prelude.sh"
for spec in separate-vllm:separate:vllm separate-ctx:separate:ctx1024 shared-vllm:shared-a:vllm \
            shared-ctx:shared-a:ctx1024; do
  IFS=: read -r name layout workload <<< "$spec"
  echo "=== grid $name" >> "$OUT/c.log"
  timeout -s INT 135 python3 -m moelora bench decode --dtype fp8 --workloads "$workload" --batches 64,256 \
      --adapter-counts 0,4,8 --expert-lora-layout "$layout" --out "$OUT/grid_$name" >> "$OUT/c.log" 2>&1
  echo "grid $name (rc $?)"
done
grep -v "^WARN" "$OUT/c.log" | grep -E "^===|tok/s|Error|Traceback|read bandwidth" | cut -c1-200
true
