#!/usr/bin/env bash
# Session 36, call C (the last of the session's device time): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the routed LoRA epilogue at Qwen3 shapes (FP8 with its bf16 reference now by the delta path, which
#     made call B's 4 FP8 cases fail on the shrink count; bf16); the grouped prefill path with the epilogue off; the
#     dense LoRA kernels (the expand at the forced prefill tiles, new); the fused-MoE kernels (the bf16 expert GEMM).
#  2. bf16 prefill profiled, one process, 0 / 4 adapters: the default (epilogue mode 1), epi3, off (the delta path).
#  3. bf16 prefill, 0 / 4 adapters: the dense expand's prefill tile (MOELORA_LORA_EXPAND_PREFILL_TILE) at
#     128x128x8, 128x64x4, 64x128x4 against the default (64 x 64, 4 warps).
# Files: tests.log, tests2.log, prof.log/json, tile.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/test_prefill_lora_epilogue.py \
    tests/test_kernels_moe_lora_grouped.py tests/test_kernels_lora.py \
    -k "gpu or fused_moe_pairs_grouped_prefill or prefill_tile or shrink_expand" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  |w8a8_epi" "$OUT/tests.log" | cut -c1-300 | tail -16
timeout -s INT 80 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_fused_moe.py \
    -k "gpu or expert_gemm" > "$OUT/tests2.log" 2>&1
echo "fused-MoE GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests2.log" | cut -c1-250 | tail -6
timeout -s INT 130 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --lines 16 \
    --variants "epi3:MOELORA_PREFILL_LORA_EPILOGUE=3;off:MOELORA_PREFILL_LORA_EPILOGUE=0" \
    --json "$OUT/prof.json" > "$OUT/prof.log" 2>&1
echo "bf16 prefill profiled (rc $?):"; grep -v "^WARN" "$OUT/prof.log" | grep -A14 "LoRA tax"; grep -A7 "^variant " "$OUT/prof.log"
V="t128x8:MOELORA_LORA_EXPAND_PREFILL_TILE=128x128x8;t128n64:MOELORA_LORA_EXPAND_PREFILL_TILE=128x64x4"
V="$V;t64n128:MOELORA_LORA_EXPAND_PREFILL_TILE=64x128x4"
timeout -s INT 110 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --no-profile --variants "$V" \
    --json "$OUT/tile.json" > "$OUT/tile.log" 2>&1
echo "bf16 prefill, expand tiles (rc $?):"; grep -A9 "^variant " "$OUT/tile.log"; grep -E "Error|Traceback" "$OUT/tile.log" | tail -3
true
