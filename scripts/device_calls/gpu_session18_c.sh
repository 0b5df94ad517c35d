#!/usr/bin/env bash
# Session 18, call 3 (one H200): where the LoRA tax of a batch-64 fp8 decode step goes with the new defaults (the
# routed kernel pipelined, whole-rank-row reads). (1) the dense FP8 LoRALinear per call at 64 tokens, 4 / 8 adapters
# (qkv, o_proj: base, the default epilogue, the expand after the K steps, no PDL, a separate expand); (2) bench decode
# fp8 128/128 batch 64, 0 / 4 / 8 adapters, adapters on all targets, on attention only and on the experts only
# (--lora-targets), each case profiled for 2 steps (the tax per kernel against the no-adapter case).
# Files: epilogue.log, epilogue.json, bench.log, targets/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 60 python3 scripts/bench_fp8_lora_epilogue.py --tokens 64 --adapters 4,8 --json "$OUT/epilogue.json" \
    > "$OUT/epilogue.log" 2>&1; grep -v "^WARN" "$OUT/epilogue.log" | tail -12 | cut -c1-190
timeout 240 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --lora-targets all,attention,experts --profile-steps 2 --out "$OUT/targets" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-200
true
