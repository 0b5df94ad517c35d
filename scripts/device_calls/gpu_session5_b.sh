#!/usr/bin/env bash
# Planned second call of session 5 on nvidia-h200-x2: ep=2 bench (both GPUs), then at the same time GPU 0: the
# dense-overlap tests + bf16 off/on, GPU 1: fp8 off/on. Logs merged into all.log (8 files at most come back).
# Files: all.log, ep2/, bf16-off/ bf16-on/ fp8-off/ fp8-on/ decode-*.json.
D="$(dirname "$0")"
T_TESTS=0 T_TP2=0 T_EP2=${T_EP2:-160} bash "$D/../gpu_parallel_x2.sh"
SKIP_INSTALL=1 CUDA_VISIBLE_DEVICES=0 DTYPES=bfloat16 bash "$D/gpu_dense_overlap.sh" > "$OUT/g0.log" 2>&1 &
SKIP_INSTALL=1 CUDA_VISIBLE_DEVICES=1 DTYPES=fp8 RUN_TESTS=0 bash "$D/gpu_dense_overlap.sh" > "$OUT/g1.log" 2>&1
wait
cat "$OUT"/*.log > "$OUT/all.tmp"; rm -f "$OUT"/*.log; mv "$OUT/all.tmp" "$OUT/all.log"
grep -E "passed|failed|tok/s|Error" "$OUT/all.log" | grep -v "^WARN" | cut -c1-200
