"""docs/configuration.md from the code: `python -m moelora_bench.config_doc > docs/configuration.md`.

Two tables: the operational MOELORA_* environment variables (OPERATIONAL below: what the package reads from the
environment), then every KernelConfig field as a dotted name with its default and meaning, the meaning taken from
its dataclass's docstring ("name: meaning." or "name / other: meaning.", kernels/*/config.py). A field its docstring
does not explain is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re

from moelora.kernels.config import KernelConfig

# the operational variables: name -> (default, what it does); tests/test_docs_configuration.py checks this list
# against the names the sources read
OPERATIONAL: dict[str, tuple[str, str]] = {
    "MOELORA_CPU_THREADS": (
        "unset: the physical cores this process may use minus one, split between the ranks of the host, 1 to 8",
        "torch's intra-op threads for an engine on the CPU where `--cpu-threads` (`EngineArgs.cpu_threads`) is not "
        "given; it wins over `OMP_NUM_THREADS` (which, set alone, leaves torch as it started). An integer >= 1."),
    "MOELORA_API_KEY": (
        "unset (no key)",
        "The default of `moelora serve --api-key`: every endpoint but `/health` then requires `Authorization: Bearer "
        "KEY`."),
    "MOELORA_COLLECTIVE_TIMEOUT_S": (
        "`600`", "Rank 0's rendezvous and collective timeout (seconds) for the workers of a tensor / expert "
                 "parallel engine."),
    "MOELORA_PING_INTERVAL_S": (
        "`2`", "Under torchrun, rank 0 pings the workers after this many seconds without a completed step."),
    "MOELORA_PING_TIMEOUT_S": (
        "`20`", "Under torchrun, how long (seconds) rank 0 waits for every worker to answer a ping (a gloo monitored "
                "barrier naming the missing ranks)."),
    "MOELORA_DUMP_STACKS_S": (
        "unset (off)", "Every process prints every thread's stack every that many seconds (`faulthandler`): for a "
                       "stuck run."),
    "MOELORA_COMMIT": (
        "unset (`git rev-parse HEAD`)", "The commit the benchmarks record in their results, for a tree without "
                                        "`.git`; when set it wins over git."),
}

INTRO = """\
# Configuration

Two kinds of settings besides the command lines' flags (`moelora serve --help`):

- **Operational environment variables** (`MOELORA_*`): deployment and bookkeeping, read when the process or the
  engine starts. A plain `moelora serve` needs none of them.
- **The kernel config** (`KernelConfig`, `moelora/kernels/config.py`): every kernel choice, one frozen object built
  once from `--kernel-config JSON` (`moelora serve`, `generate`, `demo`, `bench decode`, `bench report`) or
  `EngineArgs(kernel_config=KernelConfig(...))`, handed to the model when it is built; each layer picks its backends
  from it then. The JSON is an object of fields by section, e.g.
  `--kernel-config '{"side_stream_priority": "normal", "moe_lora": {"early": false}}'`; an unknown field or a value of
  the wrong type is an error naming it. The defaults are what measured fastest
  ([`performance-history.md`](performance-history.md)); what lost was deleted ([`experiments.md`](experiments.md)).
  `moelora bench decode --ab "name:key=value[,key=value];..."` compares configs in one process by these dotted names
  (e.g. `--ab "late:moe_lora.early_down=0"`): each variant is the base config with those fields set, the graphs
  recaptured between variants.

This page is generated: `python -m moelora_bench.config_doc > docs/configuration.md`.
"""


def _doc_meanings(cls: type) -> dict[str, str]:
    """{field: meaning} from cls's docstring, whose text reads "name: meaning. other / third: meaning. ..."."""
    fields = {f.name for f in dataclasses.fields(cls)}
    text = " ".join((cls.__doc__ or "").split())
    labels = [m for m in re.finditer(r"(?:^|(?<=[.)]\s))((?:[a-z_][a-z0-9_]*\s*/\s*)*[a-z_][a-z0-9_]*):\s", text)
              if all(n.strip() in fields for n in m.group(1).split("/"))]
    out: dict[str, str] = {}
    for i, m in enumerate(labels):
        end = labels[i + 1].start() if i + 1 < len(labels) else len(text)
        for name in m.group(1).split("/"):
            out[name.strip()] = text[m.end():end].strip()
    return out


def kernel_fields(cfg: KernelConfig | None = None) -> list[tuple[str, object, str]]:
    """(dotted name, default, meaning) of every KernelConfig field, in the dataclasses' order."""
    rows: list[tuple[str, object, str]] = []

    def walk(obj, prefix: str) -> None:
        meanings = _doc_meanings(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
                continue
            if f.name not in meanings:
                raise ValueError(f"{type(obj).__name__}.{f.name} ({prefix}{f.name}) is not explained in its class's "
                                 f"docstring: add '{f.name}: what it chooses.' there")
            rows.append((prefix + f.name, value, meanings[f.name]))

    walk(cfg or KernelConfig(), "")
    return rows


def page() -> str:
    lines = [INTRO, "## Operational environment variables", "", "| variable | default | what it does |",
             "|---|---|---|"]
    lines += [f"| `{name}` | {default} | {what} |" for name, (default, what) in sorted(OPERATIONAL.items())]
    lines += ["", "## Kernel config fields", "",
              "Dotted names as `--ab` takes them; defaults as `--kernel-config` JSON writes them.", "",
              "| field | default | what it chooses |", "|---|---|---|"]
    lines += [f"| `{name}` | `{json.dumps(default)}` | {what.replace('|', '/')} |"
              for name, default, what in kernel_fields()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
