#!/usr/bin/env bash
# Session 38, call D (~4 min on a fresh machine, the session's last device seconds): the fixed
# test_fp8_experts_fast_path_equal_their_grouped_path_qwen3_shapes (all three sizes) with the prefill-epilogue tests,
# and beside them the 93 kernel tests call B's kernel shard did not reach before its limit
# (scripts/device_calls/s38_unrun_ids.txt). Files: tests-d1.log, tests-d2.log.
source "$(dirname "$0")/../gpu_prelude.sh"
IDS=scripts/device_calls/s38_unrun_ids.txt
# shellcheck disable=SC2046
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_fp8_gpu.py::test_fp8_experts_fast_path_equal_their_grouped_path_qwen3_shapes \
    $(grep test_prefill_lora_epilogue "$IDS") > "$OUT/tests-d1.log" 2>&1 &
p1=$!
# shellcheck disable=SC2046
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $(grep -v test_prefill_lora_epilogue "$IDS") \
    > "$OUT/tests-d2.log" 2>&1 &
p2=$!
wait $p1; wait $p2
for f in "$OUT"/tests-d*.log; do
  echo "== $(basename "$f"): $(grep -E "passed|failed|error" "$f" | tail -1 | cut -c1-150)"
  grep -E "^FAILED|^ERROR|^E  " "$f" | cut -c1-220 | head -8
done
true
