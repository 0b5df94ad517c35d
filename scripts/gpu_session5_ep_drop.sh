#!/usr/bin/env bash
# Last call of session 5 on nvidia-h200-x2 (issue 10): the EP pair dropping (non-local pairs on expert -1, left
# out of every Triton kernel) — its kernel tests on GPU 0 beside the fp32 EP=2 parity tests on both GPUs, then
# bench decode --ep 2 at batch 64 and 256 with 0 and 4 adapters (compare with decode-ep2-...json, masking).
# Files: tests.log, bench.log, ep2-drop/decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
CUDA_VISIBLE_DEVICES=0 timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_ep_dropped_pairs.py \
    > "$OUT/kernel_tests.log" 2>&1 &
timeout ${T_PAR:-75} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py -k "fp32 and ep2" \
    > "$OUT/tests.log" 2>&1
wait
cat "$OUT/kernel_tests.log" >> "$OUT/tests.log"; rm "$OUT/kernel_tests.log"
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300
timeout ${T_EP2:-120} python3 -m moelora bench decode --workloads vllm --batches 64,256 --adapter-counts 0,4 --ep 2 \
    --out "$OUT/ep2-drop" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error" | cut -c1-250
true
