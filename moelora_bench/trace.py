"""One decoder layer's kernels, in order, from a kernel trace (bench decode --profile-trace; profile.write_kernel_trace):
where a layer's time goes on the main stream — each kernel's duration and the gap before it (idle time, or
negative when it started before the previous kernel ended: programmatic dependent launch) — and which side-stream
kernels ran beside it. The median over the layers of every profiled step, so one figure per kernel position."""

from __future__ import annotations

import argparse
import gzip
import json
import statistics


def load_trace(path: str) -> tuple[list[str], list[list]]:
    """(names, kernels [[name index, stream, start µs, duration µs] ...] in start order) of a trace file."""
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    return d["names"], d["kernels"]


def layer_table(names: list[str], kernels: list[list], marker: str = "_paged_attn_split_kernel") -> dict:
    """Split the trace into layers: a layer is the kernels from one run of `marker` (a kernel that runs once a
    layer) to the next, its main stream the stream that ran that marker (a CUDA graph's replay may put its branches
    on other streams than the ones captured, and move them when the graph changes: with the routed-expert LoRA
    issued early, the busiest stream ran the marker only once a step); gaps over 10x the median spacing
    are step boundaries, and only the layers whose main-stream kernel sequence is the most common one are kept.
    Returns {"layers": n, "span_us": median layer span, "main": [{"name", "dur_us", "gap_us", "start_us"} per
    position], "side": [{"name", "dur_us", "start_us"}] the side stream's kernels by their median start in the
    layer}. dur / gap / start: medians over the layers."""
    try:
        mk = names.index(marker)
    except ValueError:
        raise ValueError(f"layer_table: no kernel named {marker!r} in the trace (pick one that runs once a layer)")
    runs = [(k[2], k[1]) for k in kernels if k[0] == mk]
    starts = [t for t, _ in runs]
    layers: list[tuple[list, list, float]] = []
    for (a, main), b in zip(runs, starts[1:]):
        if b - a > 10 * statistics.median([y - x for x, y in zip(starts, starts[1:])]):
            continue  # a step boundary
        m = [k for k in kernels if k[1] == main and a <= k[2] < b]
        s = [k for k in kernels if k[1] != main and a <= k[2] < b]
        layers.append((m, s, b - a))
    if not layers:
        return {"layers": 0, "span_us": 0.0, "main": [], "side": []}
    sig = statistics.mode([tuple(k[0] for k in m) for m, _, _ in layers])
    same = [(m, s, span) for m, s, span in layers if tuple(k[0] for k in m) == sig]
    main_rows = []
    for i, n in enumerate(sig):
        durs = [m[i][3] for m, _, _ in same]
        offs = [m[i][2] - m[0][2] for m, _, _ in same]
        gaps = [m[i][2] - (m[i - 1][2] + m[i - 1][3]) if i else 0.0 for m, _, _ in same]
        main_rows.append({"name": names[n], "dur_us": statistics.median(durs), "gap_us": statistics.median(gaps),
                          "start_us": statistics.median(offs)})
    side: dict[int, list] = {}
    for m, s, _ in same:
        for j, k in enumerate(s):
            side.setdefault((k[0], j), []).append((k[2] - m[0][2], k[3]))
    side_rows = [{"name": names[n], "start_us": statistics.median(v[0] for v in vs),
                  "dur_us": statistics.median(v[1] for v in vs)} for (n, _), vs in side.items()
                 if len(vs) * 2 >= len(same)]
    side_rows.sort(key=lambda r: r["start_us"])
    return {"layers": len(same), "span_us": statistics.median(span for _, _, span in same), "main": main_rows,
            "side": side_rows}


def format_layer_table(t: dict, title: str = "") -> str:
    out = [f"{title}{t['layers']} layers, median span {t['span_us']:.1f} us",
           "  main stream:    start     dur     gap  kernel"]
    for r in t["main"]:
        out.append(f"             {r['start_us']:8.1f} {r['dur_us']:7.1f} {r['gap_us']:7.1f}  {r['name'][:80]}")
    if t["side"]:
        out.append("  side stream:    start     dur")
        for r in t["side"]:
            out.append(f"             {r['start_us']:8.1f} {r['dur_us']:7.1f}          {r['name'][:80]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelora_bench.trace",
                                description="One decoder layer's kernels, in order, from bench decode --profile-trace "
                                            "files: median duration, gap before and start in the layer, per kernel")
    p.add_argument("traces", nargs="+", help="trace-*.json.gz files")
    p.add_argument("--marker", default="_paged_attn_split_kernel", help="a kernel that runs once a layer")
    args = p.parse_args(argv)
    for path in args.traces:
        print(format_layer_table(layer_table(*load_trace(path), marker=args.marker), title=f"{path}: "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
