#!/usr/bin/env bash
# Session 37, call E (~3 min on a fresh machine): where the decode LoRA tax goes at the present defaults, with
# adapters of an A each (the layout short of 90%; the last traces of it are session 26's, before sessions 27-31's
# kept changes): fp8 128/128 batch 64, 0 / 4 adapters, 3 profiled steps each with their kernel traces
# (bench decode --profile-trace; python -m moelora.bench.trace prints one layer's kernels in order).
# Files: decode.log, decode/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/decode" > "$OUT/decode.log" 2>&1
echo "decode (rc $?):"; grep -v "^WARN" "$OUT/decode.log" | grep -E "Error|Traceback|tok/s|^vllm| 64 " | cut -c1-190 | tail -6
python3 -m moelora.bench.trace "$OUT"/traces/*.json.gz 2>&1 | head -70
true
