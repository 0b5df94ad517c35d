#!/usr/bin/env bash
# Session 30, call 3 (~8 min): the one-launch router on by default (MOELORA_FUSED_ROUTER=1, its launch chosen from
# call 2's sweep). (1) GPU tests: the router kernel; graphs (test_cuda_graphs); decode parity on the GPU
# (test_parity -k "on_gpu or decode_steps or graph"); the FP8 GPU tests; (2) bench_router at the new defaults;
# (3) the batch-64 grid, fp8 128/128 and ctx 1,024, shared-A adapters, and 128/128 with an A each, 0 / 4 / 8.
# Files: tests.log, router.log, router.json, grid.log, sep.log, grid/, sep/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/test_kernels_router.py \
    tests/test_cuda_graphs.py tests/test_fp8_gpu.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parity.py \
    -k "on_gpu or decode_steps or graph" >> "$OUT/tests.log" 2>&1
echo "parity (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -4
timeout -s INT 40 python3 scripts/bench_router.py --configs 0x0x0x0x0 --json "$OUT/router.json" > "$OUT/router.log" 2>&1
echo "router (rc $?):"; grep -v "^WARN" "$OUT/router.log" | tail -8
B="python3 -m moelora bench decode --dtype fp8 --batches 64 --adapter-counts 0,4,8"
timeout -s INT 170 $B --workloads vllm,ctx1024 --expert-lora-layout shared-a --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid, shared A (rc $?):"; grep -E "tok/s|Error" "$OUT/grid.log" | cut -c1-180
timeout -s INT 90 $B --workloads vllm --out "$OUT/sep" > "$OUT/sep.log" 2>&1
echo "grid, an A each (rc $?):"; grep -E "tok/s|Error" "$OUT/sep.log" | cut -c1-180
true
