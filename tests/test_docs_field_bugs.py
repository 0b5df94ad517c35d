"""docs/field-bugs.md against FIELD_NOTES.md and the test suite: one row per bug that shipped elsewhere (FIELD_NOTES'
"Bugs that shipped" table, same order, same "where"), every test a row names defined in its file, every row naming
at least one test or saying "none", and each row's `runs` cell matching the GPU marks of the tests it lists.

FIELD_NOTES.md lives outside the repository (../shared/design/FIELD_NOTES.md from its root); a clean clone (CI)
has no copy, and the comparison with it is then skipped. Parses text only (ast for the test files): no torch."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "field-bugs.md"
NOTES = ROOT.parent / "shared" / "design" / "FIELD_NOTES.md"
COLUMNS = ["bug (where)", "our guard", "tests", "runs"]
RUNS = {"CPU", "GPU", "both"}
EXPECTED_ROWS = 14  # FIELD_NOTES' "Bugs that shipped" table
TEST_ID = re.compile(r"`([^`]*::[^`]*)`")  # a backticked span naming a test: `tests/test_x.py::test_name`
WHERE = re.compile(r"\(([^()]*)\)\s*$")  # the trailing "(where)" of the first cell


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _is_rule(cells: list[str]) -> bool:
    return all(c and set(c) <= set("-: ") for c in cells)


def _table_after(lines: list[str], start: int) -> list[tuple[int, list[str]]]:
    """(line number, cells) of the header and rows of the first table at or after lines[start] (0-based index)."""
    rows: list[tuple[int, list[str]]] = []
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("|"):
            cells = _cells(lines[i])
            if not _is_rule(cells):
                rows.append((i + 1, cells))
        elif rows:
            break
    return rows


@functools.lru_cache(maxsize=None)
def page_rows() -> tuple[tuple[int, dict[str, str]], ...]:
    """(line number, {column: cell}) of each row of the page's table of bugs; the table's layout is checked."""
    assert PAGE.is_file(), f"{PAGE.relative_to(ROOT)} is missing"
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    table = _table_after(lines, 0)
    assert table, "docs/field-bugs.md: no table found (| bug (where) | our guard | tests | runs |)"
    (n, header), body = table[0], table[1:]
    assert header == COLUMNS, f"docs/field-bugs.md:{n}: the table's header is {header}, not {COLUMNS}"
    rows = []
    for n, cells in body:
        assert len(cells) == len(COLUMNS), (
            f"docs/field-bugs.md:{n}: the row {cells[0][:60]!r} has {len(cells)} cells, not {len(COLUMNS)} (a '|' "
            f"inside a cell splits it)")
        rows.append((n, dict(zip(COLUMNS, cells))))
    return tuple(rows)


def notes_rows() -> list[dict[str, str]]:
    """FIELD_NOTES' "Bugs that shipped" table as {bug, where, lesson} rows (skips the test where the file is absent)."""
    if not NOTES.is_file():
        pytest.skip(f"{NOTES} is absent (a clean clone): the rows are not compared with FIELD_NOTES")
    lines = NOTES.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("#") and "Bugs that shipped" in line), None)
    assert start is not None, f"{NOTES}: no 'Bugs that shipped' section"
    table = _table_after(lines, start)
    assert table and table[0][1] == ["bug", "where", "lesson"], f"{NOTES}: the bugs table's header changed: {table[:1]}"
    return [dict(zip(["bug", "where", "lesson"], cells)) for _, cells in table[1:]]


def _label(n: int, row: dict[str, str]) -> str:
    return f"docs/field-bugs.md:{n} (row {row['bug (where)'][:70]!r})"


def _norm(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def defined_tests(relpath: str) -> tuple[dict[str, bool], bool]:
    """({test name or Class::name: whether it carries pytest.mark.gpu}, whether the module is marked gpu), from the
    file's syntax tree (functions at module level and methods of classes, nested classes too)."""
    tree = ast.parse((ROOT / relpath).read_text(encoding="utf-8"), filename=relpath)

    def marked(decorators) -> bool:
        return any("mark.gpu" in ast.unparse(d) for d in decorators)

    module_gpu = any(
        isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        and "mark.gpu" in ast.unparse(node.value)
        for node in tree.body)
    found: dict[str, bool] = {}

    def walk(body, prefix: str, gpu: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}::", gpu or marked(node.decorator_list))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                g = gpu or marked(node.decorator_list)
                found[prefix + node.name] = g
                found.setdefault(node.name, g)  # a method may be named without its class

    walk(tree.body, "", module_gpu)
    return found, module_gpu


def check_test_id(test_id: str) -> tuple[str | None, bool]:
    """(what is wrong with `test_id`, or None; whether the test is marked gpu)."""
    if "[" in test_id:
        return "names one parametrized case: write the function name only", False
    path, _, name = test_id.partition("::")
    if not re.fullmatch(r"tests/[\w/]+\.py", path) or not re.fullmatch(r"\w+(::\w+)*", name):
        return "is not of the form tests/test_x.py::test_name (or ::Class::test_name)", False
    if not (ROOT / path).is_file():
        return f"{path} does not exist", False
    found, module_gpu = defined_tests(path)
    if name not in found:
        return f"{path} defines no 'def {name.split('::')[-1]}'" + (
            f" in class {name.rsplit('::', 1)[0]}" if "::" in name else ""), False
    if not name.split("::")[-1].startswith("test"):
        return f"{name} is not a test function (pytest collects test* names only)", False
    return None, found[name] or module_gpu


def test_the_page_has_one_row_per_shipped_bug():
    rows = page_rows()
    assert len(rows) == EXPECTED_ROWS, (
        f"docs/field-bugs.md has {len(rows)} rows in its table; FIELD_NOTES.md lists {EXPECTED_ROWS} bugs that "
        f"shipped: one row each")
    for n, row in rows:
        assert WHERE.search(row["bug (where)"]), f"{_label(n, row)}: the first cell must end in '(where)'"
        assert row["our guard"] and row["our guard"] != "-", f"{_label(n, row)}: 'our guard' is empty"
        assert row["runs"] in RUNS, f"{_label(n, row)}: runs is {row['runs']!r}; write one of {sorted(RUNS)}"


def test_rows_follow_field_notes():
    notes = notes_rows()
    rows = page_rows()
    assert len(notes) == EXPECTED_ROWS, (
        f"{NOTES} now lists {len(notes)} bugs that shipped (was {EXPECTED_ROWS}): update docs/field-bugs.md and "
        f"EXPECTED_ROWS in tests/test_docs_field_bugs.py")
    problems = []
    for i, (note, (n, row)) in enumerate(zip(notes, rows), 1):
        where = WHERE.search(row["bug (where)"])
        got = _norm(where.group(1)) if where else None
        if got != _norm(note["where"]):
            problems.append(f"{_label(n, row)} is row {i}, and says where={got!r}; FIELD_NOTES' row {i} "
                            f"({note['bug'][:70]!r}) is from {note['where']!r}: keep FIELD_NOTES' order and its "
                            f"'where' text")
    for note in notes[len(rows):]:
        problems.append(f"FIELD_NOTES' bug {note['bug'][:70]!r} ({note['where']}) has no row in docs/field-bugs.md")
    assert not problems, "\n".join(problems)


def test_every_row_names_a_test_or_says_none():
    problems = []
    for n, row in page_rows():
        cell = row["tests"]
        ids = TEST_ID.findall(cell)
        if not ids and not cell.lower().startswith("none"):
            problems.append(f"{_label(n, row)}: the tests cell {cell!r} names no test (`tests/test_x.py::test_name`) "
                            f"and does not say 'none'")
        if ids and cell.lower().startswith("none"):
            problems.append(f"{_label(n, row)}: the tests cell says 'none' but names {ids}")
    assert not problems, "\n".join(problems)
    if any(row["tests"].lower().startswith("none") for _, row in page_rows()):
        text = PAGE.read_text(encoding="utf-8")
        assert re.search(r"^#+\s*Gaps\b", text, re.M | re.I), (
            "docs/field-bugs.md: a row says 'none': explain the missing test in a '## Gaps' section")


def test_every_listed_test_exists():
    problems = []
    for n, row in page_rows():
        for test_id in TEST_ID.findall(row["tests"]):
            wrong, _ = check_test_id(test_id)
            if wrong:
                problems.append(f"{_label(n, row)}: `{test_id}`: {wrong}")
    assert not problems, "\n".join(problems)


def test_runs_matches_the_gpu_marks():
    """CPU: none of the row's tests is marked gpu; GPU: all are; both: some of each (a 'none' row: not checked)."""
    problems = []
    for n, row in page_rows():
        marks = {}
        for test_id in TEST_ID.findall(row["tests"]):
            wrong, gpu = check_test_id(test_id)
            if not wrong:  # a missing test is reported by test_every_listed_test_exists
                marks[test_id] = gpu
        if not marks:
            continue
        gpu = sorted(t for t, g in marks.items() if g)
        cpu = sorted(t for t, g in marks.items() if not g)
        want = "both" if gpu and cpu else "GPU" if gpu else "CPU"
        if row["runs"] != want:
            problems.append(f"{_label(n, row)}: runs says {row['runs']!r}, the tests say {want!r} "
                            f"(marked gpu: {gpu or 'none'}; CPU: {cpu or 'none'})")
    assert not problems, "\n".join(problems)
