#!/usr/bin/env bash
# For session 39 (written in session 38, not run). PART=1 (kind nvidia-h200-x2, ~5 min): tests/test_parallel_gpu.py,
# the 2-GPU tensor / expert parallel tests, not run since session 36's changes (session 38 ran every one-GPU file).
# PART=2 (one H200, ~6 min): the batch-256 rows of the README's grid at the present defaults (sessions 25 and 29's
# there): fp8, 128/128 and ctx 1,024, 0 / 4 / 8 adapters, both expert LoRA layouts, one process each.
# Files: PART=1 tests-parallel.log; PART=2 c.log and grid_*/ (4 JSON).
source "$(dirname "$0")/../gpu_prelude.sh"
case "${PART:-1}" in
  1) timeout -s INT 540 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
         > "$OUT/tests-parallel.log" 2>&1
     echo "2-GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests-parallel.log" | cut -c1-250 | tail -12 ;;
  2) for spec in separate-vllm:separate:vllm separate-ctx:separate:ctx1024 shared-vllm:shared-a:vllm \
                 shared-ctx:shared-a:ctx1024; do
       IFS=: read -r name layout workload <<< "$spec"
       echo "=== grid $name" >> "$OUT/c.log"
       timeout -s INT 130 python3 -m moelora bench decode --dtype fp8 --workloads "$workload" --batches 256 \
           --adapter-counts 0,4,8 --expert-lora-layout "$layout" --out "$OUT/grid_$name" >> "$OUT/c.log" 2>&1
       echo "grid $name (rc $?)"
     done
     grep -v "^WARN" "$OUT/c.log" | grep -E "^===|tok/s|Error|Traceback" | cut -c1-190 ;;
  *) echo "PART must be 1 or 2"; exit 2 ;;
esac
true
