#!/usr/bin/env bash
# Session 9, call 6 (one H200), code of 5507d13: where the adapter tax goes now — bench decode fp8 128/128 with
# --profile-steps 3 at batch 64 (0/4 adapters) and 256 (0/4; the grouped kernel). Files: bench.log, prof/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4 \
    --profile-steps 3 --out "$OUT/prof" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -v -i "warn" | cut -c1-170 | tail -70
true
