#!/usr/bin/env bash
# Session 21, call 2: every GPU test at HEAD (session 20 changed Attention.forward's decode branch, a default path;
# call 1 ran the attention, norm and FP8 LoRA tests it touched). Files: tests.log.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 500 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=12 -m gpu tests/ > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  |^SKIPPED" "$OUT/tests.log" | cut -c1-240 | tail -30
true
