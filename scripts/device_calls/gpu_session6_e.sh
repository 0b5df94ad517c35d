#!/usr/bin/env bash
# Session 6, after call d (~2 minutes): the grouped LoRA kernel (MOELORA_GROUPED_LORA=1) gave other bits in add
# mode than in store mode + consumer add (Triton folds `y + dot` into the dot's accumulator); a select now sits
# between. Again test_overlap_equals_serial[8] with it on, and the grouped kernel's GPU tests. Files: e.log.
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
MOELORA_GROUPED_LORA=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_graphs_overlap.py \
    -k "overlap_equals_serial and 8 and not 128" > "$OUT/e.log" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_grouped.py -k gpu_grouped \
    >> "$OUT/e.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/e.log" | cut -c1-300 | head -20
true
