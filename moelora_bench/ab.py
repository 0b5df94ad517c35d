"""In-process A/B of kernel configs for `bench decode --ab`: each variant is the base KernelConfig with dotted keys
overridden ("early0:moe_lora.early=0;nopdl:fp8.lora_pdl=0"), applied to the built engine (LLMEngine.reconfigure:
the layers' choices, the side stream, the graphs recaptured) between its cases.

One process measures every variant on the same GPU, weights and requests: differences between machines (~1.4% on
the H200s lent here) and start-up costs drop out of the comparison.
"""

from __future__ import annotations

import statistics

from moelora.kernels.config import KernelConfig


def parse_ab(spec: str, base: KernelConfig) -> list[tuple[str, KernelConfig]]:
    """'name:key=v[,key=v];name2:key=v' -> [(name, base.with_overrides({key: v}))]: the names unique and not
    'default', every key a dotted KernelConfig field (kernels/config.py field_names) with a value of its type; else
    a ValueError naming the variant, before anything is built."""
    out: list[tuple[str, KernelConfig]] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, sep, body = part.partition(":")
        name = name.strip()
        if not sep or not name or name == "default" or name in (n for n, _ in out):
            raise ValueError(f"--ab variant {part!r}: write name:key=value[,key=value] with a unique name other than "
                             "'default'")
        items: dict[str, str] = {}
        for item in (i.strip() for i in body.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--ab variant {name!r}: {item!r} is not key=value (a dotted kernel config field, "
                                 "e.g. moe_lora.early=0)")
            items[key.strip()] = value.strip()
        try:
            out.append((name, base.with_overrides(items)))
        except ValueError as e:
            raise ValueError(f"--ab variant {name!r}: {e}") from None
    return out


def format_ab(rows: list[dict]) -> str:
    """The A/B table of `bench decode --ab`: per variant and case (workload, batch, adapters, targets), the median
    tokens/s and step over its rounds, the kept share against the default's no-adapter median of that workload and
    batch, and the change against the default's median for the same case."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "variant" in r:
            key = (r["variant"], r.get("workload"), r["batch"], r["adapters"], r.get("lora_targets") or "all")
            groups.setdefault(key, []).append(r)

    def median(key, field):
        vals = [r[field] for r in groups.get(key, [])]
        return statistics.median(vals) if vals else None

    own_base = any(k[0] != "default" and k[3] == 0 for k in groups)  # bench decode --ab-base
    lines = ["A/B (medians over rounds; kept: against the default's no-adapter median; vs default: same case"
             + ("; own: against the variant's own no-adapter median" if own_base else "") + ")",
             f"{'variant':14s} {'workload':8s} {'batch':>5s} {'ad':>3s} {'targets':10s} {'runs':>4s} {'tok/s':>9s} "
             f"{'step ms':>8s} {'kept':>6s} {'vs default':>10s}" + (f" {'own':>6s}" if own_base else "")]
    for key in groups:
        variant, workload, batch, n, which = key
        tps, step = median(key, "tokens_per_s"), median(key, "step_ms")
        base = median(("default", workload, batch, 0, "all"), "tokens_per_s")
        same = median(("default", workload, batch, n, which), "tokens_per_s")
        kept = f"{tps / base:6.1%}" if base and n else "     -"
        vs = f"{tps / same - 1:+10.2%}" if same and variant != "default" else "         -"
        own = ""
        if own_base:
            mine = median((variant, workload, batch, 0, "all"), "tokens_per_s")
            own = f" {tps / mine:6.1%}" if mine and n else "      -"
        lines.append(f"{variant:14s} {workload or '-':8s} {batch:5d} {n:3d} {which:10s} {len(groups[key]):4d} "
                     f"{tps:9.1f} {step:8.2f} {kept} {vs}{own}")
    return "\n".join(lines)
