#!/usr/bin/env bash
# Session 12, call 6 (one H200): the CUDA-graph decode step's host inputs kept between steps (engine/graph_inputs.py:
# pinned buffers, block tables updated in place, an event before each rewrite): the graph tests (replay equals
# eager with mixed adapters; a long generation). File: tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
