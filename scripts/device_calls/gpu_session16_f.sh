#!/usr/bin/env bash
# Session 16, call 6 (one H200): where the adapter tax goes now (after session 15's PDL and this session's changes):
# bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters, --profile-steps 3 (the tax by kernel and the timeline).
# Files: bench.log, profile/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --profile-steps 3 --out "$OUT/profile" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback|tax|µs|us " | cut -c1-200 | head -60
true
