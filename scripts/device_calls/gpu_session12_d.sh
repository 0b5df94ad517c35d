#!/usr/bin/env bash
# Session 12, call 4 (one H200): the one-pass sampler end to end, same run: bench decode fp8, no adapter, 128/128
# and ctx1024 at batch 64 and 256, with the defaults (fused sampler) and with MOELORA_FUSED_SAMPLER=0 (torch path).
# (The per-pair LoRA kernel is back to its session-11 code: the unroll variant measured slower in call 3.)
# Files: bench.log, fused/ torch/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 140 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0 \
    --out "$OUT/fused" > "$OUT/bench.log" 2>&1
MOELORA_FUSED_SAMPLER=0 timeout 140 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 \
    --batches 64,256 --adapter-counts 0 --out "$OUT/torch" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
