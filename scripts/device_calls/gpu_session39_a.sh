#!/usr/bin/env bash
# Session 39, call A (~9 min on a fresh machine): base weights prefetched into L2 beside the latency-bound kernels
# (MOELORA_WEIGHT_L2_PREFETCH, kernels/l2_prefetch.py). At batch 64 the no-adapter FP8 layer is 212 µs against a
# ~155 µs byte floor; its expert GEMMs already stream near the copy bandwidth, but ~60 µs of small kernels leave
# HBM idle. (1) scripts/bench_l2_prefetch.py: the read bandwidth (copy / torch amax / Triton read), and the
# gate_up GEMM after a spin with and without prefetching the first rows of every expert (both forms, 64-384 rows),
# the dense qkv / o_proj GEMMs likewise; (2) one A/B process, 2 rounds, fp8 128/128 batch 64, 0 and 4 adapters
# (--ab-base: the variants without adapters too); (3) the GPU tests of the prefetch (bit-equal decode steps).
# Files: bench.log, bench.json, ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 110 python3 scripts/bench_l2_prefetch.py --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench_l2_prefetch (rc $?):"; grep -v "^WARN\|Warning\|warn(" "$OUT/bench.log" | cut -c1-230
timeout -s INT 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "ex128:MOELORA_WEIGHT_L2_PREFETCH=experts;ex128b:MOELORA_WEIGHT_L2_PREFETCH=experts,MOELORA_L2_PREFETCH_FORM=bulk;ex256:MOELORA_WEIGHT_L2_PREFETCH=experts,MOELORA_EXPERT_L2_PREFETCH_ROWS=256;dense:MOELORA_WEIGHT_L2_PREFETCH=dense;both:MOELORA_WEIGHT_L2_PREFETCH=both" \
    > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^ex|^dense|^both" | cut -c1-190
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_l2_prefetch.py \
    > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
