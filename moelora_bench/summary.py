"""Markdown tables of a `bench report` (printed at the end of the run, written beside the plots): decode
tokens/s with the share kept and the multiple of the byte floor, prefill tokens/s, moelora vs transformers +
PEFT, and the run's notes."""

from __future__ import annotations


DTYPE_ORDER = ("fp32", "fp16", "bf16", "fp8", "nvfp4")


def panel_key(k: tuple) -> tuple:
    """Sort key of a (model, dtype[, rank]) table or plot panel: by model, then precision from wide to narrow,
    then rank (the parts of a split run arrive in any order)."""
    dtype = DTYPE_ORDER.index(k[1]) if k[1] in DTYPE_ORDER else len(DTYPE_ORDER)
    return (k[0], dtype, *k[2:])


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(d: dict) -> str:
    c = d.get("ceilings") or {}
    mm = c.get("matmul_tflops") or {}
    lines = [f"**{d.get('device')}**, {str(d.get('date', ''))[:16]} UTC, commit `{str(d.get('commit', ''))[:10]}`, "
             f"torch {d.get('torch', '?')}, Triton {d.get('triton', '—')}. Copy bandwidth {_fmt(c.get('copy_gbs'))} GB/s; "
             f"matmul {_fmt(mm.get('bf16'), ',.1f')} TFLOP/s bf16, {_fmt(mm.get('fp8'), ',.1f')} fp8. "
             f"Run time {_fmt(d.get('elapsed_s'))} s"
             + (f" (the sum of {d['parts']} parts run one after another or side by side)." if d.get("parts", 1) > 1 else "."),
             ""]
    for e in sorted(d.get("engines", []), key=lambda e: panel_key((e["model"], e["dtype"], e["rank"]))):
        lines.append(f"- engine {e['model']} {e['dtype']} rank {e['rank']}: {e['layers']} layers, {e['max_loras']} LoRA "
                     f"slots, CUDA graphs {'on' if e['graphs'] else 'off'}, built in {e['build_s']:.1f} s")
    lines.append("")
    engines = sorted({(r["model"], r["dtype"], r["engine_rank"]) for r in d.get("decode", [])}, key=panel_key)
    for model, dtype, rank in engines:
        rows = [r for r in d["decode"] if (r["model"], r["dtype"], r["engine_rank"]) == (model, dtype, rank)]
        counts = sorted({r["adapters"] for r in rows})
        cell = {(r["batch"], r["adapters"]): r for r in rows}
        lines += [f"Decode tokens/s — {model}, {dtype}, rank {rank} (kept vs no adapter · step time / byte floor)", "",
                  "| batch | " + " | ".join("no adapter" if n == 0 else "1 adapter" if n == 1 else f"{n} adapters" for n in counts) + " |",
                  "|---:|" + "---:|" * len(counts)]
        for b in sorted({r["batch"] for r in rows}):
            cells = []
            for n in counts:
                r = cell.get((b, n))
                if r is None:
                    cells.append("—")
                    continue
                kept = "" if not n or r.get("kept") is None else f" · {100 * r['kept']:.0f}%"
                fl = "" if r.get("step_over_floor") is None else f" · {r['step_over_floor']:.1f}×"
                cells.append(f"{r['tokens_per_s']:,.0f}{kept}{fl}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    if d.get("prefill"):
        lines += ["Prefill tokens/s (2k-token prompts unless stated)", "",
                  "| model | dtype | rank | adapters | prompts × tokens | tokens/s | share of the FLOP floor |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in d["prefill"]:
            share = "—" if r.get("floor_share") is None else f"{100 * r['floor_share']:.0f}%"
            lines.append(f"| {r['model']} | {r['dtype']} | {r['engine_rank']} | {r['adapters']} | "
                         f"{r['prompts']} × {r['prompt_len']} | {r['tokens_per_s']:,.0f} | {share} |")
        lines.append("")
    peft = d.get("peft")
    if peft and peft.get("rows"):
        ours = {(r["batch"], r["adapters"]): r["tokens_per_s"] for r in d.get("decode", [])
                if r["model"] == peft.get("model") and r["dtype"] == "bf16" and r["engine_rank"] == peft.get("rank")}
        layers = (f"PEFT ran {peft['layers']} of {peft['full_layers']} layers, tokens/s scaled to {peft['full_layers']}"
                  if peft["layers"] != peft["full_layers"] else f"all {peft['layers']} layers")
        lines += [f"moelora vs transformers + PEFT ({peft.get('model')}, bf16, rank {peft.get('rank')}; {layers})", "",
                  "| batch | adapters | moelora tokens/s | transformers + PEFT tokens/s | passes | moelora / PEFT |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in peft["rows"]:
            mine = ours.get((r["batch"], r["adapters"]))
            ratio = "—" if mine is None else f"{mine / r['tokens_per_s']:.1f}×"
            lines.append(f"| {r['batch']} | {r['adapters']} | {_fmt(mine)} | {r['tokens_per_s']:,.1f} | "
                         f"{r.get('passes', 1)} | {ratio} |")
        lines.append("")
    if d.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in d["notes"]] + [""]
    return "\n".join(lines)
