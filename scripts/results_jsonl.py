"""Append benchmark result JSON to bench/results/<kind>.jsonl: one row per measured configuration.

Every row holds `date`, `device`, `commit` (the tree measured; null where the file did not record it, with a
`commit_note`), `set` (a short name for the rows measured together, which the docs cite), `source_file` (the JSON
the row came from), `config` (what was measured: model, dtype, workload, batch, adapters, variant and switches,
versions, ...) and the measurements beside them. Per-kernel profiles are left out; a LoRA tax by kernel is cut to
its largest entries.

    python scripts/results_jsonl.py RESULT.json... --set NAME [--bench SCRIPT] [--out bench/results] [--dry-run]
    python scripts/results_jsonl.py --compare OUT NAME=PATH...   (two trees' runs side by side: gpu_bench.sh TREES)

Where rows go: `bench decode` -> decode.jsonl, `bench report` -> report.jsonl, `bench kernels` -> kernels.jsonl,
`scripts/profile_prefill.py` -> prefill.jsonl, `bench serve` -> serve.jsonl (its summary as it is, one row);
anything else (the sweeps and microbenchmarks in scripts/) -> micro.jsonl, with `bench` naming what wrote it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

# keys that say what was measured; every other key of a row is a measurement
CONFIG_KEYS = {
    "model", "dtype", "workload", "batch", "adapters", "rank", "engine_rank", "lora_targets", "expert_lora_layout",
    "variant", "switches", "kernel_config", "env", "ab_round", "decode_steps", "graphs", "async_scheduling", "lora_overlap",
    "fused_lora", "tensor_parallel_size", "expert_parallel_size", "prompts", "prompt_len", "case", "tokens", "site",
    "H", "O", "I", "E", "top_k", "path", "slot_expert_pairs", "pairs", "groups", "block_m", "block_n", "block_k",
    "block_d", "num_warps", "num_stages", "split_k", "decode", "config", "note", "transport", "context", "vocab",
    "temperature", "world", "hidden", "layers", "kind", "part", "passes", "mixed_batch", "new_tokens", "mode",
}
# file-level keys copied into every row's config
RUN_CONFIG_KEYS = ("torch", "triton", "graphs", "tensor_parallel_size", "expert_parallel_size", "expert_lora_layout",
                   "dtype", "prompts", "prompt_len", "rank", "world", "hidden", "top_k", "layers", "setup")
# file-level measurements copied into every row
RUN_RESULT_KEYS = ("hbm_gbs", "hbm_read_gbs", "copy_gb_s", "startup_to_first_token_s", "adapter_load_s",
                   "adapter_bytes")
DROP = {"profile", "profile_vs_default", "profile_trace", "experts_touched", "repeats_profile"}
TAX_ENTRIES = 8
TARGET = {"decode": "decode.jsonl", "report": "report.jsonl", "kernels": "kernels.jsonl",
          "profile-prefill": "prefill.jsonl", "serve": "serve.jsonl"}


def _date(d: dict, meta: dict, name: str) -> str | None:
    v = d.get("date") or meta.get("date")
    if v:
        return str(v)
    m = re.search(r"\d{4}-\d{2}-\d{2}", name)
    return m.group(0) if m else None


def _short_tax(tax: dict) -> dict:
    """A LoRA tax by kernel (moelora_bench/profile.py's profile_tax) cut to its largest entries, names shortened."""
    kernels = sorted(tax.get("kernels", []), key=lambda k: -abs(k.get("us", 0.0)))[:TAX_ENTRIES]
    return {"unit": tax.get("unit"), "total_us": round(tax.get("total_us", 0.0), 1),
            "largest": [{"name": k["name"][:80], "us": round(k.get("us", 0.0), 1)} for k in kernels]}


def _round(v):
    if isinstance(v, float):
        return int(v) if v.is_integer() and abs(v) < 2 ** 53 else float(f"{v:.7g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def _split(row: dict) -> tuple[dict, dict]:
    config, result = {}, {}
    for k, v in row.items():
        if k in DROP:
            if k == "experts_touched" and v:
                result["experts_touched_mean"] = round(statistics.mean(v), 2)
            continue
        if k in ("tax", "profile_tax") and isinstance(v, dict):
            result[k] = _short_tax(v)
        elif k in CONFIG_KEYS:
            config[k] = v
        else:
            result[k] = v
    return config, result


def _explode(row: dict) -> list[dict]:
    """Sweep rows holding several launch configurations (a dict of variant -> figures, or a list of configs):
    one row each."""
    for key in ("variants", "grouped"):
        v = row.get(key)
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            base = {k: x for k, x in row.items() if k != key}
            out = [{**base, "config": name, **figs} for name, figs in v.items()]
            if "per_pair_us" in row:  # sweep_moe_lora_grouped: the per-pair kernel is a configuration too
                out.insert(0, {**{k: x for k, x in base.items() if not k.startswith("grouped")},
                               "config": "per-pair", "us": row["per_pair_us"]})
                for r in out:
                    r.pop("per_pair_us", None)
            return out
    if isinstance(row.get("configs"), list):
        base = {k: x for k, x in row.items() if k != "configs"}
        return [{**base, **c} for c in row["configs"]]
    return [row]


def _by_variant(rows: list[dict], variants: dict) -> list[dict]:
    """Rows with one column of figures per variant (scripts/bench_defer_chain.py: `variants` maps each name to its
    switches): one row per variant, and the columns that are not variants (the parts alone) as rows of their own."""
    out = []
    for row in rows:
        base = {k: v for k, v in row.items() if not isinstance(v, (int, float)) or k in CONFIG_KEYS}
        for k, v in row.items():
            if k in base:
                continue
            out.append({**base, "config": k, "env": variants.get(k, {}), "us": v} if k in variants
                       else {**base, "config": f"{k} alone", "us": v})
    return out


def _kept(rows: list[dict]) -> None:
    """`kept` for rows of one plain (not A/B) decode run: tokens/s against the no-adapter row of the same case."""
    if any("variant" in r["config"] for r in rows):
        return
    key = ("workload", "batch", "dtype", "model")
    base = {tuple(r["config"].get(k) for k in key): r["tokens_per_s"] for r in rows
            if r["config"].get("adapters") == 0 and "tokens_per_s" in r}
    for r in rows:
        b = base.get(tuple(r["config"].get(k) for k in key))
        if b and "tokens_per_s" in r and "kept" not in r:
            r["kept"] = round(r["tokens_per_s"] / b, 4)


def rows_of(path: str, set_name: str, bench: str | None = None) -> tuple[str, list[dict]]:
    """(the .jsonl file name, the rows) for one result file; `bench` names what wrote a micro.jsonl file (default:
    its `kind`, else its name up to the date)."""
    with open(path) as f:
        d = json.load(f)
    name = os.path.basename(path)
    if isinstance(d, list):
        d = {"rows": d}
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    kind = d.get("kind") or meta.get("kind") or re.sub(r"-(s\d+|\d{4}-).*", "", name.removesuffix(".json"))
    target = TARGET.get(kind, "micro.jsonl")
    commit = d.get("commit") or meta.get("commit") or meta.get("git_commit") or None
    device = d.get("device") or meta.get("device")
    if device is None:  # the file name ends <date>-<device>.json
        m = re.search(r"\d{4}-\d{2}-\d{2}-(.+)\.json$", name)
        device = m.group(1).replace("-", " ") if m else None
    head = {"date": _date(d, meta, name), "device": device, "commit": commit}
    if commit is None:
        head["commit_note"] = "not recorded in the result file"
    elif d.get("commit_note"):
        head["commit_note"] = d["commit_note"]
    head["set"] = set_name
    head["source_file"] = name
    if kind == "serve":
        return target, [{**head, **{k: v for k, v in d.items() if k not in head}}]
    run_config = {k: d.get(k, meta.get(k)) for k in RUN_CONFIG_KEYS if d.get(k, meta.get(k)) is not None}
    env = {k: v for k, v in (d.get("env_switches") or {}).items() if k != "MOELORA_COMMIT"}
    if env:
        run_config["env_switches"] = env
    if target == "micro.jsonl":
        run_config["bench"] = bench or kind
    run_result = {k: d.get(k, meta.get(k)) for k in RUN_RESULT_KEYS if d.get(k, meta.get(k)) is not None}
    ceilings = d.get("ceilings") or {}
    if ceilings:
        run_result["copy_gbs"] = ceilings.get("copy_gbs")
        run_result["matmul_tflops"] = ceilings.get("matmul_tflops")
    notes = [n for n in (d.get("note"), d.get("floor_note"), d.get("conditions")) if isinstance(n, str)]
    parts: list[tuple[str | None, list]] = []
    if kind == "report":
        parts = [("decode", d.get("decode") or []), ("prefill", d.get("prefill") or [])]
        peft = d.get("peft")
        if isinstance(peft, dict):
            extra = {k: peft[k] for k in ("layers", "full_layers", "rank", "mode", "prompt_len", "dtype") if k in peft}
            parts.append(("peft", [{**extra, **r} for r in peft.get("rows", [])]))
    else:
        for k, v in d.items():
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and k not in ("engines",):
                variants = d.get("variants")
                if isinstance(variants, dict) and variants and all(isinstance(x, dict) for x in variants.values()):
                    v = _by_variant(v, variants)
                parts.append((None, v))
        if not parts:  # a file of one measurement (e.g. the demo's graphs against eager)
            scalar = {k: v for k, v in d.items() if k not in ("kind", "date", "device", "commit", "commit_note",
                                                               "env_switches", "meta", *RUN_CONFIG_KEYS)}
            parts = [(None, [scalar])]
    out = []
    for part, rows in parts:
        for raw in rows:
            for row in _explode(raw):
                config, result = _split(row)
                if part:
                    config = {"part": part, **config}
                config = {**config, **{k: v for k, v in run_config.items() if k not in config}}
                if notes:
                    config.setdefault("note", " ".join(notes))
                out.append(_round({**head, "config": config, **run_result, **result}))
    if kind == "decode":
        _kept(out)
    return target, out


def compare(out: str, trees: list[str]) -> None:
    """`--compare OUT NAME=PATH...` (scripts/gpu_bench.sh with TREES): whether the trees' demo rows (greedy tokens)
    are the same, and each decode case's tokens/s per tree with the last tree's ratio to the first's; for the cases
    profiled (`--profile-steps`), one decoder layer's span and each kernel's median µs per tree, side by side (a
    kernel is its stream, name and run in the layer; "-": the tree has no such kernel)."""
    import glob

    names = [t.split("=")[0] for t in trees]
    if all(os.path.exists(f"{out}/{n}/demo.txt") for n in names):  # DEMO_TIMEOUT=0: no demo
        demo = {n: [re.sub(r"[0-9.]+ (s|tokens/s)", "", line) for line in open(f"{out}/{n}/demo.txt")] for n in names}
        print("demo rows (greedy tokens):", "the same" if all(demo[n] == demo[names[0]] for n in names) else "DIFFER")
    rows: dict[tuple, dict[str, float]] = {}
    layers: dict[tuple, dict[str, dict]] = {}
    for n in names:
        for f in sorted(glob.glob(f"{out}/{n}/decode-*.json")):
            d = json.load(open(f))
            for r in d["rows"]:
                key = (d.get("dtype"), r.get("workload"), r["batch"], r["adapters"])
                rows.setdefault(key, {})[n] = r["tokens_per_s"]
                if (r.get("profile") or {}).get("layer"):
                    layers.setdefault(key, {})[n] = r["profile"]["layer"]
    print(f"{'dtype':9s} {'workload':8s} {'batch':>5s} {'ad':>3s} " + " ".join(f"{n:>9s}" for n in names) + "  ratio")
    for (dtype, workload, batch, ad), v in rows.items():
        vals = [v.get(n) for n in names]
        ratio = f"{vals[-1] / vals[0]:.3f}" if all(vals) else "-"
        print(f"{str(dtype):9s} {str(workload):8s} {batch:5d} {ad:3d} " + " ".join(f"{x or 0:9.1f}" for x in vals)
              + f"  {ratio}")
    for key, per in layers.items():
        print(f"one layer, {' '.join(map(str, key))}: span "
              + ", ".join(f"{n} {per[n]['span_us']:.1f}" for n in names if n in per) + " µs; kernels (µs):")
        cols: dict[tuple, dict[str, float]] = {}
        for n in names:
            seen: dict[tuple, int] = {}
            for k in (per.get(n) or {}).get("kernels", []):
                kind = (k["stream"], k["name"])
                seen[kind] = seen.get(kind, 0) + 1
                cols.setdefault((*kind, seen[kind]), {})[n] = k["dur_us"]
        for (stream, name, run), v in cols.items():
            print(f"  {name[:56]:56s} {stream:4s} " + " ".join(f"{v[n]:9.1f}" if n in v else f"{'-':>9s}" for n in names))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--set", required=True, help="a short name for these rows, e.g. grid-fp8 or ab-early-down")
    ap.add_argument("--bench", default=None,
                    help="micro.jsonl rows: the script that wrote them (default: the file's kind)")
    ap.add_argument("--out", default="bench/results", help="folder of the .jsonl files (default %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="print the rows instead of appending them")
    args = ap.parse_args()
    for path in args.files:
        target, rows = rows_of(path, args.set, args.bench)
        lines = "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows)
        if args.dry_run:
            sys.stdout.write(lines)
            continue
        with open(os.path.join(args.out, target), "a") as f:
            f.write(lines)
        print(f"{path}: {len(rows)} rows -> {os.path.join(args.out, target)}")


if __name__ == "__main__":
    main()
