#!/usr/bin/env bash
# Last call of session 6 on one H200 (~4.5 minutes): call c saw test_overlap_equals_serial fail for all four
# ranks (max_lora_rank 128) with the grouped LoRA kernel on. With it off (the default now), the same test;
# then one rank with it on (MOELORA_GROUPED_LORA=1), to tell a wrong bit from a kernel that does not build.
# Files: overlap.log.
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_graphs_overlap.py \
    -k "overlap_equals_serial" > "$OUT/overlap.log" 2>&1
echo "== grouped on" >> "$OUT/overlap.log"
MOELORA_GROUPED_LORA=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -x \
    tests/test_graphs_overlap.py -k "overlap_equals_serial and 8" >> "$OUT/overlap.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  |== grouped" "$OUT/overlap.log" | cut -c1-400 | head -30
true
