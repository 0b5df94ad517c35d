#!/usr/bin/env bash
# Session 13, call 1 (one H200): asynchronous scheduling's first GPU run. The graph tests (incl. the new
# async-vs-sync replay test: device tokens into the graph's input buffer) and the sampler GPU tests; the sampler
# alone at batch 128; bench decode fp8, no adapter, 128/128 and ctx1024 at batch 64 and 256, synchronous (kept
# graph inputs, the default) then --async-scheduling, same machine. Files: tests.log, sampler128.json, bench.log,
# sync/ async/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_cuda_graphs.py \
    tests/test_sample_triton.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 40 python3 scripts/bench_sampler.py --batches 128 --out "$OUT/sampler128.json" 2>&1 | grep -v "^WARN" | tail -3
timeout 145 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0 \
    --out "$OUT/sync" > "$OUT/bench.log" 2>&1
timeout 145 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0 \
    --async-scheduling --out "$OUT/async" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-170
true
