#!/usr/bin/env bash
# One device call: `moelora bench report` (its options as arguments; none = --quick), JSON and full log under $OUT.
# The GPU image has no matplotlib: draw the PNGs afterwards where it is installed,
#   moelora bench plot OUT/report-*.json --out bench/results
# Set MOELORA_COMMIT to the commit measured (the copied tree has no .git).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--quick)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# the log keeps the progress bar; the tail shown here drops it and ends with the summary tables
python3 -m moelora bench report --out "$OUT" --no-plot "${ARGS[@]}" 2>&1 | tee "$OUT/report.log" \
    | tr '\r' '\n' | grep -v '^bench report:' | tail -120
