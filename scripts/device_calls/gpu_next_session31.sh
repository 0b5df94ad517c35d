#!/usr/bin/env bash
# Written at the end of session 30 for session 31's first device call (~9 min; a fresh start costs ~2-3 min more):
# the routed experts' combine handed to the next RMSNorm (MOELORA_MOE_COMBINE_TO_NORM=1, off: +0.5% in session 30's
# one-round A/B, its model-level GPU test not yet run). (1) tests/test_combine_to_norm.py (the GPU test: log-probs
# bit-equal on and off, no combine launch); (2) with the switch on: tests/test_fp8_gpu.py, tests/test_cuda_graphs.py,
# tests/test_parity.py -k "on_gpu or decode_steps or graph"; (3) one A/B process, two rounds, --ab-base, fp8
# 128/128 batch 64, 0 / 4 / 8 adapters (an A each). If all pass and it gains, make it the default
# (fused_moe_triton._COMBINE_TO_NORM) and say so in README / structure.md. Files: tests.log, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_combine_to_norm.py > "$OUT/tests.log" 2>&1
echo "combine tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -5
MOELORA_MOE_COMBINE_TO_NORM=1 timeout -s INT 260 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_fp8_gpu.py tests/test_cuda_graphs.py >> "$OUT/tests.log" 2>&1
echo "fp8 + graph tests with it on (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
MOELORA_MOE_COMBINE_TO_NORM=1 timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_parity.py -k "on_gpu or decode_steps or graph" >> "$OUT/tests.log" 2>&1
echo "parity with it on (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -3
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "combine:MOELORA_MOE_COMBINE_TO_NORM=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^combine" | cut -c1-190
true
