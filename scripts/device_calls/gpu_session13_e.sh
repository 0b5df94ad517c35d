#!/usr/bin/env bash
# Session 13, call 5 (one H200): where the 4/8-adapter tax goes now that the host's time is hidden. bench decode
# fp8 128/128 batch 64, 0 / 4 / 8 adapters, side-stream overlap on and then off, 3 profiled steps per case with the
# kernels' timeline (idle time, two streams at once, how much of the LoRA kernels' time other kernels ran beside).
# Files: bench.log, profile/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --lora-overlap both --profile-steps 3 --out "$OUT/profile" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|timeline|LoRA tax|^ +[+-][0-9]|Error|Traceback" | cut -c1-330
true
