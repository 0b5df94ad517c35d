#!/usr/bin/env bash
# Session 23, call 5: with set_fp8_lora_split mode 4 the default, the two PDL switches again in one A/B process (fp8
# 128/128 batch 64, 0 / 4 / 8 adapters, rank 16, all targets): MOELORA_FP8_LORA_PDL=0 (the GEMM launched after its
# shrink without PDL; measured in session 15 with mode 2 only) and MOELORA_LORA_SHRINK_PDL=1 (the shrink launched
# with PDL after its producer; session 19, before mode 4). Files: bench.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ab" --ab "nopdl:MOELORA_FP8_LORA_PDL=0;shrinkpdl:MOELORA_LORA_SHRINK_PDL=1" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|Traceback|^A/B|^variant|^default|^nopdl|^shrinkpdl" | cut -c1-190
true
