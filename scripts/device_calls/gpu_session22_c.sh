#!/usr/bin/env bash
# Session 22, call 3: where the dense FP8 GEMM's LoRA time goes, per call (scripts/bench_fp8_lora_gemm_parts.py):
# the GEMM alone, with the expand in modes 0 / 2 / 3 (h ready, no PDL), modes 2 / 3 with every rank 0, the shrink
# alone, and the whole call. Files: parts.log, parts.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 scripts/bench_fp8_lora_gemm_parts.py --tokens 64 --adapters 4,8 --json "$OUT/parts.json" \
    > "$OUT/parts.log" 2>&1
echo "parts (rc $?):"; grep -v "^WARN" "$OUT/parts.log" | cut -c1-260 | tail -30
true
