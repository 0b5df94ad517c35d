"""`moelora bench plot FILE... [--out DIR]`: PNGs from `bench report` JSON (matplotlib, no GPU needed).

- `<stem>-tokens.png`: decode tokens/s vs batch for 0/1/4/8 adapters (vLLM 0.26's measured points beside, at
  Qwen3-30B-A3B dimensions);
- `<stem>-floor.png`: decode step time as a multiple of the byte-floor time;
- `<stem>-kept.png`: share of the no-adapter throughput kept vs adapters, beside SGLang's published and
  vLLM 0.26's measured figures (`published.py`);
- `<stem>-peft.png`: moelora vs transformers + PEFT, tokens/s vs batch;
- `<stem>-summary.md`: the same figures as markdown tables (`summary.py`).
Several files (parts of one split run) are merged into one set of plots. Any other file (a `bench serve` or
`bench decode` result, not JSON, ...) is an error naming the file and what it is, before anything is written.
"""

from __future__ import annotations

import json
import os

from moelora_bench.figures import add_kept
from moelora_bench.published import KEPT, VLLM_TOKENS_PER_S, kept_value
from moelora_bench.summary import markdown, panel_key as _panel_key
from moelora.config import ConfigError

ADAPTER_COLORS = {0: "#222222", 1: "#1f77b4", 2: "#17becf", 4: "#2ca02c", 8: "#d62728", 32: "#9467bd"}
PLOTTED_ADAPTERS = (0, 1, 2, 4, 8)  # tokens/s and floor plots: the counts a reader compares first
FULL_QWEN3 = "Qwen3-30B-A3B"
OUR_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#d62728")  # moelora lines in the kept plot (references are warm colours)


class NotAReportError(ConfigError):
    """A file `bench plot` cannot plot. (A ConfigError so that `moelora bench plot` prints its one-line message
    without a traceback and exits 1, see moelora.cli._expected_errors; it is a ValueError too.)"""


EXPECTED = "`moelora bench plot` expects the JSON that `moelora bench report` writes (report-*.json)"


def read_report(path: str) -> dict:
    """The report in `path`; NotAReportError, saying what the file is instead, for anything else."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise NotAReportError(f"cannot read {path}: {e.strerror or e}; {EXPECTED}") from None
    except (ValueError, UnicodeDecodeError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:80]
        raise NotAReportError(f"{path} is not JSON ({why}); {EXPECTED}") from None
    if not isinstance(d, dict):
        raise NotAReportError(f"{path} holds a JSON {type(d).__name__}, not a report; {EXPECTED}")
    kind = d.get("kind")
    if kind == "report" or (kind is None and any(isinstance(d.get(k), list) for k in ("decode", "prefill"))):
        return d
    what = f"a `bench {kind}` result (kind {kind!r})" if isinstance(kind, str) and kind else \
        f"JSON without a report's decode / prefill rows (keys: {', '.join(sorted(map(str, d))[:6]) or 'none'})"
    raise NotAReportError(f"{path} is {what}, not a `bench report` result; {EXPECTED}")


def load(files: list[str]) -> dict:
    """One report from several files: rows and engines concatenated, run times summed (`parts` counts the
    files); ceilings, device, date and commit of the first file."""
    merged: dict = {}
    for path in files:
        d = read_report(path)
        if not merged:
            merged = {**d, "decode": [], "prefill": [], "notes": [], "peft": None, "engines": [], "elapsed_s": 0.0,
                      "parts": 0}
        merged["parts"] += 1
        merged["elapsed_s"] += d.get("elapsed_s") or 0.0
        merged["engines"] += d.get("engines", [])
        merged["decode"] += d.get("decode", [])
        merged["prefill"] += d.get("prefill", [])
        merged["notes"] += [n for n in d.get("notes", []) if n not in merged["notes"]]
        merged["peft"] = merged["peft"] or d.get("peft")
    add_kept(merged["decode"])
    return merged


def _adapters(n: int) -> str:
    return "no adapter" if n == 0 else "1 adapter" if n == 1 else f"{n} adapters"


def _color(n: int) -> str:
    return ADAPTER_COLORS.get(n, "#7f7f7f")


def _engines(rows: list[dict]) -> list[tuple[str, str, int]]:
    """(model, dtype, engine rank) of the rows, each once, sorted by `_panel_key`."""
    return sorted({(r["model"], r["dtype"], r["engine_rank"]) for r in rows}, key=_panel_key)


def _panels(plt, n: int, width: float = 6.0, height: float = 4.6):
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _title(d: dict) -> str:
    return f"{d.get('device', '?')} · {str(d.get('date', ''))[:10]} · commit {str(d.get('commit', ''))[:8]}"


def _batch_axis(ax, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("decode batch (sequences)")
    ax.grid(True, which="both", alpha=0.3)


def _log_y(ax) -> None:
    """A log y axis labelled with plain numbers (minor ticks too when the data span less than a decade)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    fmt = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    lo, hi = ax.get_ylim()
    ax.yaxis.set_minor_formatter(fmt if hi / max(lo, 1e-12) < 10 else NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=8)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_axis_off()


def plot_tokens(plt, d: dict, path: str) -> str:
    engines = _engines(d["decode"])
    fig, axes = _panels(plt, max(len(engines), 1))
    if not engines:
        _empty(axes[0], "no decode rows")
    for ax, (model, dtype, rank) in zip(axes, engines):
        rows = [r for r in d["decode"] if (r["model"], r["dtype"], r["engine_rank"]) == (model, dtype, rank)]
        batches = sorted({r["batch"] for r in rows})
        for n in sorted({r["adapters"] for r in rows}):
            if n not in PLOTTED_ADAPTERS:
                continue
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["adapters"] == n)
            ax.plot(*zip(*pts), "o-", color=_color(n), label=f"moelora, {_adapters(n)}")
        if model == FULL_QWEN3 and rank == 16:  # vLLM's runs: Qwen3-30B-A3B dims, rank-16 adapters
            for ref in VLLM_TOKENS_PER_S:
                if ref["dtype"] == dtype and ref["adapters"] in PLOTTED_ADAPTERS:
                    ax.plot(ref["batch"], ref["tokens_per_s"], "^", color=_color(ref["adapters"]), markersize=9,
                            markeredgecolor="black",
                            label=f"vLLM 0.26 ({ref.get('device', 'H200')}), {_adapters(ref['adapters'])}")
        _batch_axis(ax, batches)
        _log_y(ax)
        ax.set_ylabel("decode tokens/s (log scale)")
        ax.set_title(f"{model}, {dtype}, LoRA rank {rank}")
        _legend(ax)
    fig.suptitle(f"Decode throughput vs batch — {_title(d)}", fontsize=12)
    return _save(fig, path)


def plot_floor(plt, d: dict, path: str) -> str:
    engines = _engines([r for r in d["decode"] if r.get("step_over_floor")])
    fig, axes = _panels(plt, max(len(engines), 1))
    if not engines:
        _empty(axes[0], "no byte floor (no bandwidth measured)")
    for ax, (model, dtype, rank) in zip(axes, engines):
        rows = [r for r in d["decode"] if (r["model"], r["dtype"], r["engine_rank"]) == (model, dtype, rank)
                and r.get("step_over_floor")]
        for n in sorted({r["adapters"] for r in rows}):
            if n not in PLOTTED_ADAPTERS:
                continue
            pts = sorted((r["batch"], r["step_over_floor"]) for r in rows if r["adapters"] == n)
            ax.plot(*zip(*pts), "o-", color=_color(n), label=_adapters(n))
        ax.axhline(1.0, color="grey", linestyle="--", label="byte floor (bytes touched / measured bandwidth)")
        _batch_axis(ax, sorted({r["batch"] for r in rows}))
        ax.set_ylabel("step time / byte-floor time (×, lower is better)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{model}, {dtype}, LoRA rank {rank}")
        _legend(ax)
    bw = (d.get("ceilings") or {}).get("copy_gbs")
    fig.suptitle(f"Decode step time over the byte floor (copy bandwidth {bw or 0:.0f} GB/s) — {_title(d)}", fontsize=12)
    return _save(fig, path)


def plot_kept(plt, d: dict, path: str) -> str:
    """One panel per (model, dtype); x: distinct adapters in the batch (plus a 'not stated' column for
    published figures without a count); moelora lines coloured by batch, dashed for rank 64; the published
    figures of the same precision class (bf16, or fp8/nvfp4) as markers."""
    ours = [r for r in d["decode"] if r["adapters"] > 0 and r.get("kept") is not None]
    panels = sorted({(r["model"], r["dtype"]) for r in ours}, key=_panel_key) or [("", "bf16")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 6 * len(panels)), squeeze=False)
    for ax, (model, dtype) in zip(axes[:, 0], panels):
        low = dtype not in ("bf16", "fp16", "fp32")
        refs = [e for e in KEPT if (e["dtype"] not in ("bf16",)) == low]
        rows = [r for r in ours if (r["model"], r["dtype"]) == (model, dtype)]
        counts = sorted({r["adapters"] for r in rows} | {e["adapters"] for e in refs if e["adapters"]})
        xpos = {None: 0, **{n: i + 1 for i, n in enumerate(counts)}}
        batches = sorted({r["batch"] for r in rows})
        shown = [b for b in batches if b in (16, 64)] or batches
        ranks = sorted({r["engine_rank"] for r in rows})
        for j, b in enumerate(shown):
            for k, rank in enumerate(ranks):
                pts = sorted((xpos[r["adapters"]], 100 * r["kept"]) for r in rows
                             if (r["batch"], r["engine_rank"]) == (b, rank))
                if pts:
                    ax.plot(*zip(*pts), "o" + ("-", "--", ":")[k % 3], color=OUR_COLORS[j % len(OUR_COLORS)],
                            linewidth=2.5, label=f"moelora, batch {b}, rank {rank}")
        _published_kept(ax, refs, xpos)
        ax.set_xticks(list(xpos.values()))
        ax.set_xticklabels(["not stated\n(published)"] + [str(n) for n in counts])
        ax.set_xlabel("distinct adapters in the decode batch")
        ax.set_ylabel("decode throughput kept vs no adapter (%)")
        ax.set_ylim(0, max([110.0] + [100 * r["kept"] + 5 for r in rows]))
        ax.axhline(100, color="grey", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
        ax.set_title(f"{model}, {dtype} base — markers: {'fp8/nvfp4' if low else 'bf16'} figures of other systems")
    fig.suptitle(f"Share of the no-adapter decode throughput kept — {_title(d)}\n"
                 "lines: moelora, this run · markers: vLLM 0.26 (measured: bf16 on an H200, FP8 on an H100) and "
                 "SGLang (published), from FIELD_NOTES.md, not re-measured here", fontsize=11)
    return _save(fig, path)


def _published_kept(ax, refs: list[dict], xpos: dict) -> None:
    series: list[tuple[str, list[dict]]] = []  # one legend entry per published setup
    for e in refs:
        label = f"{e['system']}: {e['setup']}"
        if not series or series[-1][0] != label:
            series.append((label, []))
        series[-1][1].append(e)
    markers = "^v<>sDPXh*"
    for i, (label, entries) in enumerate(series):
        vllm = label.startswith("vLLM")
        color = "#ff7f0e" if vllm else ("#8c564b", "#bcbd22", "#7f7f7f", "#e377c2")[i % 4]
        dx = -0.22 + 0.44 * i / max(len(series) - 1, 1)  # spread the setups sideways around their column
        for k, e in enumerate(entries):
            mid, lo, hi = kept_value(e)
            x = xpos[e["adapters"]] + dx
            ax.errorbar(x, 100 * mid, yerr=[[100 * (mid - lo)], [100 * (hi - mid)]], fmt=markers[i % len(markers)],
                        color=color, markersize=7, capsize=3, label=label if k == 0 else None)
            if e["batch"]:
                ax.annotate(f"bs{e['batch']}", (x, 100 * mid), textcoords="offset points", xytext=(5, -3),
                            fontsize=7, color=color)


def plot_peft(plt, d: dict, path: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 6))
    peft = d.get("peft")
    if not peft or not peft.get("rows"):
        _empty(ax, "no transformers + PEFT rows")
        return _save(fig, path)
    model, rank = peft.get("model"), peft.get("rank")
    ours = [r for r in d["decode"] if r["model"] == model and r["engine_rank"] == rank and r["dtype"] == "bf16"]
    counts = sorted({r["adapters"] for r in peft["rows"]})
    for n in counts:
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in ours if r["adapters"] == n)
        if pts:
            ax.plot(*zip(*pts), "o-", color=_color(n), linewidth=2, label=f"moelora, {_adapters(n)}")
        best: dict[int, float] = {}
        for r in peft["rows"]:
            if r["adapters"] == n:
                best[r["batch"]] = max(best.get(r["batch"], 0.0), r["tokens_per_s"])
        ax.plot(*zip(*sorted(best.items())), "s--", color=_color(n), label=f"transformers + PEFT, {_adapters(n)}")
    layers = f"{peft['layers']} of {peft['full_layers']} layers, scaled to {peft['full_layers']}" \
        if peft["layers"] != peft["full_layers"] else f"{peft['layers']} layers"
    _batch_axis(ax, sorted({r["batch"] for r in peft["rows"]} | {r["batch"] for r in ours}))
    _log_y(ax)
    ax.set_ylabel("decode tokens/s (log scale)")
    mixing = "mixed batches" if any(r.get("mixed_batch") for r in peft["rows"]) else \
        "one pass per adapter (PEFT refuses mixed batches)"
    ax.set_title(f"moelora vs transformers + PEFT ({model}, bf16, rank {rank})\n"
                 f"PEFT: {layers}; {mixing} — {_title(d)}", fontsize=11)
    _legend(ax)
    return _save(fig, path)


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))  # one entry per label
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="best")


def _save(fig, path: str) -> str:
    fig.set_layout_engine("constrained")  # keeps the suptitle clear of the first row's titles (tight_layout does not)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_files(files: list[str], out_dir: str | None = None) -> list[str]:
    """Write the PNGs for the report(s) in `files`; returns their paths. NotAReportError (nothing written) when a
    file is not a `bench report` result."""
    d = load(files)  # first: a wrong file is an error before matplotlib is needed or anything is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.dirname(os.path.abspath(files[0]))
    os.makedirs(out_dir, exist_ok=True)
    stems = [os.path.splitext(os.path.basename(f))[0] for f in files]
    stem = os.path.commonprefix(stems).rstrip("-_") or stems[0]  # parts of a split run: their shared name
    paths = [fn(plt, d, os.path.join(out_dir, f"{stem}-{name}.png"))
             for name, fn in (("tokens", plot_tokens), ("floor", plot_floor), ("kept", plot_kept), ("peft", plot_peft))]
    table = os.path.join(out_dir, f"{stem}-summary.md")
    with open(table, "w") as f:
        f.write(markdown(d))
    return paths + [table]
