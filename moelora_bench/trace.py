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


MARKERS = ("_paged_attn_split_kernel", "_mla_attn_kernel")  # kernels that run once a decoder layer
GEMM_ORDER = {4: ("o_proj", "gate_up", "down", "qkv"), 5: ("o_proj", "router", "gate_up", "down", "qkv")}
# kernels that read a role's bytes, the n-th run in a layer taking the n-th role (from the attention on: o's LoRA
# comes before the next layer's q/k/v LoRA, the gate/up LoRA before the down LoRA)
READERS = {"_paged_attn_split_kernel": ("kv",), "_mla_attn_kernel": ("kv",), "_router_topk_kernel": ("router",),
           "_shrink_kernel": ("o_lora_a", "qkv_lora_a"), "_lora_delta_kernel": ("o_lora_b", "qkv_lora_b"),
           "_expand_kernel": ("o_lora_b", "qkv_lora_b"), "_moe_lora_fused_kernel": ("gate_up_lora", "down_lora"),
           "_moe_lora_grouped_kernel": ("gate_up_lora", "down_lora")}


def _is_gemm(name: str) -> bool:
    """A weight GEMM: ours (`_fp8_gemm_kernel`, `_expert_gemm_kernel`, `_nvfp4_gemm_kernel`) or cuBLAS's."""
    n = name.lower()
    return "gemm" in n or n.startswith("nvjet") or "cutlass" in n


def one_layer(names: list[str], kernels: list[list]) -> dict | None:
    """One decoder layer's kernels of both streams in start order (layer_table's main and side stream merged, by
    the first of MARKERS the trace has), each with the role whose bytes it reads (`roles`); None without a
    marker. Returns {"layers", "span_us", "marker", "kernels": [{"name", "stream", "start_us", "dur_us",
    "gap_us", "role"}]}."""
    marker = next((m for m in MARKERS if m in names), None)
    if marker is None:
        return None
    t = layer_table(names, kernels, marker)
    rows = [{**r, "stream": "main"} for r in t["main"]] + [{**r, "stream": "side", "gap_us": None} for r in t["side"]]
    rows.sort(key=lambda r: r["start_us"])
    for r, role in zip(rows, roles([r["name"] for r in rows])):
        r["role"] = role
    return {"layers": t["layers"], "span_us": t["span_us"], "marker": marker, "kernels": rows}


def roles(names: list[str]) -> list[str | None]:
    """The floor role (floor.py) each kernel of one layer reads, by name and run (READERS), the weight GEMMs by
    their order (GEMM_ORDER: 4 GEMMs from the attention on are o_proj, gate_up, down, the next layer's qkv; 5 with
    the router's); None for a kernel that reads no floor bytes (norms, rotary, alignment, activation, reductions)
    or one these rules do not place."""
    gemms = [i for i, n in enumerate(names) if _is_gemm(n)]
    order = GEMM_ORDER.get(len(gemms), ())
    out: list[str | None] = [None] * len(names)
    for i, role in zip(gemms, order):
        out[i] = role
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in READERS:
            k = seen[n] = seen.get(n, -1) + 1
            out[i] = READERS[n][k] if k < len(READERS[n]) else None
    return out


def format_kernel_bytes(layer: dict, role_bytes: dict[str, float], read_gbs: float | None) -> str:
    """The layer's kernels with what they must read: start, duration and gap (µs), the floor bytes of the kernel's
    role (MB), the rate that is (GB/s) and its share of the read bandwidth; then the layer's span against its
    floor, the time in kernels that read no floor bytes, and the roles no kernel was placed on."""
    out = [f"  one layer ({layer['layers']} layers, medians): span {layer['span_us']:.1f} us",
           "      start     dur     gap      MB    GB/s  %read  kernel (role, stream)"]
    placed, idle = set(), 0.0
    for r in layer["kernels"]:
        b = role_bytes.get(r["role"], 0.0) if r["role"] else 0.0
        placed.add(r["role"])
        gbs = b / (r["dur_us"] * 1e3) if r["dur_us"] > 0 else 0.0
        share = f"{100 * gbs / read_gbs:5.0f}%" if read_gbs and b else "     -"
        gap = "      -" if r["gap_us"] is None else f"{r['gap_us']:7.1f}"
        if not b and r["stream"] == "main":
            idle += r["dur_us"]
        out.append(f"    {r['start_us']:7.1f} {r['dur_us']:7.1f} {gap} {b / 1e6:7.2f} {gbs:7.0f} {share}  "
                   f"{r['name'][:60]} ({r['role'] or '-'}, {r['stream']})")
    total = sum(role_bytes.values())
    floor_us = total / (read_gbs * 1e3) if read_gbs else None
    rest = {k: v for k, v in role_bytes.items() if v and k not in placed}
    out.append(f"    floor bytes {total / 1e6:.2f} MB" + (f" = {floor_us:.1f} us at {read_gbs:.0f} GB/s: span "
                                                         f"{layer['span_us'] / floor_us:.2f}x the floor" if floor_us else "")
               + f"; main-stream kernels that read no floor bytes {idle:.1f} us")
    if rest:
        out.append("    not placed on a kernel: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in rest.items()))
    return "\n".join(out)


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
