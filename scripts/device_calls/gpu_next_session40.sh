#!/usr/bin/env bash
# For session 40 (written in session 39, not run; session 39's run did its PART=2, the batch-256 grid). Kind
# nvidia-h200-x2 (~5 min): tests/test_parallel_gpu.py, the 2-GPU tensor / expert parallel tests, not run since
# session 36's changes (x2 was not lent in sessions 37-39). Run it as MOELORA_COMMIT=<sha> bash <this script>.
# Files: tests-parallel.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 540 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
    > "$OUT/tests-parallel.log" 2>&1
echo "2-GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests-parallel.log" | cut -c1-250 | tail -12
true
