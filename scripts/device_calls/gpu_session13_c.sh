#!/usr/bin/env bash
# Session 13, call 3 (one H200): asynchronous scheduling is now the default on a GPU. The engine-level GPU tests
# under it (graphs, overlap, DeepSeek, parity, FP8/NVFP4, dense overlap, streams) and the no-sync tests (the
# sampler's mixed greedy/sampled path through index_select/index_copy_; "error" mode names the line). Then the
# one-pass sampler below 256 rows now that the host's launches hide behind the GPU: bench decode fp8, no adapter,
# 128/128 at batch 64 and 128, default (torch sampler there) against MOELORA_FUSED_SAMPLER_MIN_ROWS=1.
# Files: tests.log, bench.log, torch_sampler/ fused_sampler/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_no_sync_gpu.py \
    tests/test_cuda_graphs.py tests/test_graphs_overlap.py tests/test_deepseek_gpu.py tests/test_parity.py \
    tests/test_dense_lora_overlap.py tests/test_streams.py tests/test_fp8_gpu.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  |sampler.py|async_step|llm_engine" "$OUT/tests.log" | cut -c1-300 | tail -25
timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0 \
    --out "$OUT/torch_sampler" > "$OUT/bench.log" 2>&1
MOELORA_FUSED_SAMPLER_MIN_ROWS=1 timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,128 --adapter-counts 0 --out "$OUT/fused_sampler" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
