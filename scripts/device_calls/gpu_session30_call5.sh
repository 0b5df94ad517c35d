#!/usr/bin/env bash
# Session 30, call 5 (~3 min; the session's last ~390 s of device time): the routed experts' combine handed to the
# next RMSNorm (MOELORA_MOE_COMBINE_TO_NORM=1, off). (1) its GPU test (bit-equal log-probabilities, no combine
# launch) and the CUDA-graph tests with it on; (2) one A/B process, one round, --ab-base, fp8 128/128 batch 64,
# 0 / 4 adapters (an A each). Files: tests.log, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 25 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_combine_to_norm.py > "$OUT/tests.log" 2>&1
echo "combine tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -5
MOELORA_MOE_COMBINE_TO_NORM=1 timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -x \
    tests/test_cuda_graphs.py >> "$OUT/tests.log" 2>&1
echo "graph tests with it on (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -4
timeout -s INT 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-base --out "$OUT/ab" --ab "combine:MOELORA_MOE_COMBINE_TO_NORM=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^combine" | cut -c1-190
true
