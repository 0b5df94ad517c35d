#!/usr/bin/env bash
# Device call on nvidia-h200-x2 (issue 10): EP with the non-local pairs left out (MOELORA_EP_DROP_NONLOCAL=1,
# off by default until this call measures it). GPU 0 first: the kernel tests (tests/test_ep_dropped_pairs.py,
# ~15 s); then both GPUs: the bf16 EP=2 on/off test (~60 s), then bench decode --ep 2 at batch 64 and 256 with
# 0 and 4 adapters, off then on (each ~45 s start-up + ~20 s adapter + ~40 s cases). If on is faster and the
# tests pass, make it the default (distributed/sharding.py _EP_DROP). Session 5 measured off:
# b64 3,935 / 3,182 (4 ad), b256 9,658 / 6,990 tok/s (decode-ep2-...json).
# RUN_TESTS=0 skips the tests. Files: tests.log, bench.log, ep2-off/ ep2-on/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_ep_dropped_pairs.py \
      > "$OUT/tests.log" 2>&1
  timeout ${T_PAR:-120} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
      -k "leaving_out_nonlocal" >> "$OUT/tests.log" 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300
fi
for on in 0 1; do
  MOELORA_EP_DROP_NONLOCAL=$on timeout ${T_EP2:-170} python3 -m moelora bench decode --workloads vllm --batches 64,256 \
      --adapter-counts 0,4 --ep 2 --out "$OUT/ep2-$([ $on = 1 ] && echo on || echo off)" >> "$OUT/bench.log" 2>&1
done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error" | cut -c1-250
true
