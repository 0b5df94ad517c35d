#!/usr/bin/env bash
# Session 13, call 6 (one H200): call 5's timeline showed the side stream's routed-expert LoRA kernel beside other
# kernels for only 450 of its 2,036 us a step (batch 64, 4 adapters, high priority). (1) The same profile with
# MOELORA_SIDE_STREAM_PRIORITY=normal; (2) registers / shared memory / warps of every compiled kernel at decode
# sizes (scripts/kernel_resources.py): can the LoRA kernel and the FP8 expert GEMM share an SM at all?
# Files: bench.log, normal/, resources.log, resources.json.
source "$(dirname "$0")/../gpu_prelude.sh"
MOELORA_SIDE_STREAM_PRIORITY=normal timeout 95 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64 --adapter-counts 0,4 --profile-steps 3 --out "$OUT/normal" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|timeline|Error|Traceback" | cut -c1-240
timeout 60 python3 scripts/kernel_resources.py --out "$OUT/resources.json" > "$OUT/resources.log" 2>&1
grep -E "regs|Error|Traceback" "$OUT/resources.log" | grep -E "fp8_gemm|moe_lora_fused|shrink|Error|Traceback" | cut -c1-200
true
