"""docs/switches.md against the code: one row for every MOELORA_* environment variable the package reads, no row for
one it no longer reads, and the A/B-able switches of moelora_bench/switches.py marked with the values they take."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "switches.md"
NAME = re.compile(r"MOELORA_[A-Z0-9_]+")
COLUMNS = ["variable", "default", "values", "what it does", "status"]


def source_names() -> dict[str, list[str]]:
    """Every MOELORA_* name in the package's .py files -> the files (relative to the repo) that name it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "moelora").rglob("*.py")):
        for name in set(NAME.findall(path.read_text(encoding="utf-8"))):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def page_rows() -> list[tuple[int, dict[str, str]]]:
    """(line number, {column: cell}) for every table row of the page whose first cell is a backticked MOELORA_* name;
    a table that is not laid out as COLUMNS fails."""
    rows = []
    header = None
    for n, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            assert header == COLUMNS, (f"docs/switches.md:{n}: a table's header is {header}; every table there must "
                                       f"have the columns {COLUMNS}")
            continue
        if all(set(c) <= set("-: ") for c in cells):  # the |---|---| line
            continue
        m = re.fullmatch(r"`(MOELORA_[A-Z0-9_]+)`", cells[0])
        assert m, (f"docs/switches.md:{n}: the first cell {cells[0]!r} is not one backticked MOELORA_* name; write "
                   f"each row as | `MOELORA_X` | default | values | what it does | status |")
        assert len(cells) == len(COLUMNS), (f"docs/switches.md:{n}: {m.group(1)}'s row has {len(cells)} cells, not "
                                            f"{len(COLUMNS)} (a '|' inside a cell splits it: write '/' instead)")
        rows.append((n, dict(zip(COLUMNS, cells))))
    return rows


def rows_by_name() -> dict[str, tuple[int, dict[str, str]]]:
    return {row["variable"].strip("`"): (n, row) for n, row in page_rows()}


def test_the_page_has_tables():
    assert len(page_rows()) >= 10, "docs/switches.md: no switch tables found (| `MOELORA_X` | ... | rows)"


def test_every_variable_in_the_sources_has_a_row():
    documented = rows_by_name()
    missing = {name: files for name, files in source_names().items() if name not in documented}
    assert not missing, "\n".join(
        f"{name} is named in {', '.join(files)} but has no row in docs/switches.md: add a row for {name} to "
        f"docs/switches.md (| `{name}` | default | values | what it does | status |)" for name, files in
        sorted(missing.items()))


def test_no_stale_or_duplicate_rows():
    sources = source_names()
    seen: dict[str, int] = {}
    problems = []
    for n, row in page_rows():
        name = row["variable"].strip("`")
        if name in seen:
            problems.append(f"docs/switches.md:{n}: {name} has a second row (first at line {seen[name]}): keep one")
        seen.setdefault(name, n)
        for mentioned in [name] + NAME.findall(" ".join(row[c] for c in COLUMNS[1:])):
            if mentioned not in sources:
                problems.append(f"docs/switches.md:{n}: {mentioned} is named there but no .py file under moelora/ "
                                f"reads it any more: remove its row (or the mention), or restore the switch")
    assert not problems, "\n".join(problems)


def _code_spans(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]*)`", cell))


def test_every_ab_switch_is_marked_with_its_values():
    from moelora_bench.switches import SWITCHES

    documented = rows_by_name()
    problems = []
    for name, (_set, _get, values) in sorted(SWITCHES.items()):
        if name not in documented:
            problems.append(f"{name} is A/B-able (moelora_bench/switches.py) but has no row: add a row for {name} to "
                            f"docs/switches.md, marked (A/B) in its status column")
            continue
        n, row = documented[name]
        if "(A/B)" not in row["status"]:
            problems.append(f"docs/switches.md:{n}: {name} is in moelora_bench/switches.py's SWITCHES: add (A/B) to "
                            f"its status column")
        absent = [v for v in values if v not in _code_spans(row["values"])]
        if absent:
            problems.append(f"docs/switches.md:{n}: bench decode --ab takes {name}={'/'.join(absent)}, not listed in "
                            f"its values column: add {', '.join(f'`{v}`' for v in absent)} there (as code)")
    for name, (n, row) in sorted(documented.items()):
        if "(A/B)" in row["status"] and name not in SWITCHES:
            problems.append(f"docs/switches.md:{n}: {name} is marked (A/B) but is not in moelora_bench/switches.py's "
                            f"SWITCHES: remove the mark, or add the switch there")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("column", ["default", "values", "what it does", "status"])
def test_no_empty_cells(column):
    empty = [f"docs/switches.md:{n}: {row['variable']}" for n, row in page_rows() if not row[column]]
    assert not empty, f"fill the {column!r} cell of: " + ", ".join(empty)
