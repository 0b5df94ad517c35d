#!/usr/bin/env bash
# Session 13, call 2 (one H200): call 1 showed --async-scheduling no faster (host time unchanged): the sampler's
# torch.tensor(list, device=cuda) copies synchronise the stream. Now through non-blocking copies. The no-sync GPU
# tests (sampler paths; a steady asynchronous step under torch.cuda.set_sync_debug_mode), the graph tests, the
# sampler GPU tests; bench decode fp8 no adapter 128/128 + ctx1024 at b64/b256 synchronous and asynchronous; async
# with 4 and 8 adapters at b64. Files: tests.log, bench.log, sync/ async/ async_lora/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_no_sync_gpu.py \
    tests/test_cuda_graphs.py tests/test_sample_triton.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 140 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0 \
    --out "$OUT/sync" > "$OUT/bench.log" 2>&1
timeout 140 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0 \
    --async-scheduling --out "$OUT/async" >> "$OUT/bench.log" 2>&1
timeout 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --async-scheduling --out "$OUT/async_lora" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
