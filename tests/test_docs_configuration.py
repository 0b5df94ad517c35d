"""docs/configuration.md against the code: one row for exactly the MOELORA_* environment variables the sources read
(found by grepping moelora/ and moelora_bench/), one row for exactly every KernelConfig field (field_names()), and
the generator (moelora_bench/config_doc.py) explains every field and every variable."""

from __future__ import annotations

import re
from pathlib import Path

from moelora.kernels.config import field_names
from moelora_bench.config_doc import OPERATIONAL, kernel_fields, page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"MOELORA_[A-Z0-9_]+")
REGENERATE = "regenerate it: python -m moelora_bench.config_doc > docs/configuration.md"


def source_names() -> dict[str, list[str]]:
    """Every MOELORA_* name in the .py files of moelora/ and moelora_bench/ (the page's generator, which lists them,
    aside) -> the files that name it."""
    found: dict[str, list[str]] = {}
    for package in ("moelora", "moelora_bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "config_doc.py":
                continue
            for name in set(NAME.findall(path.read_text(encoding="utf-8"))):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def page_rows(header: str) -> list[str]:
    """The first cells (backticks stripped) of the table whose header row starts with `| header |`."""
    rows, inside = [], False
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| {header} |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not set(line) <= set("|-: "):
            rows.append(line.split("|")[1].strip().strip("`"))
    return rows


def test_the_page_lists_exactly_the_variables_the_sources_read():
    documented, read = page_rows("variable"), source_names()
    missing = {n: files for n, files in read.items() if n not in documented}
    stale = [n for n in documented if n not in read]
    assert not missing and not stale, (
        "".join(f"\n{n} is named in {', '.join(f)} but has no row in docs/configuration.md" for n, f in missing.items())
        + "".join(f"\n{n} has a row in docs/configuration.md but no source names it any more" for n in stale)
        + f"\n(add or remove it in OPERATIONAL, moelora_bench/config_doc.py, then {REGENERATE})")
    assert len(documented) == len(set(documented)), f"a variable has two rows: {REGENERATE}"


def test_the_generator_knows_every_variable_the_sources_read():
    assert sorted(OPERATIONAL) == sorted(source_names()), "OPERATIONAL (moelora_bench/config_doc.py) != the sources"


def test_the_page_lists_exactly_the_kernel_config_fields():
    documented = page_rows("field")
    assert sorted(documented) == sorted(field_names()), (
        f"docs/configuration.md's fields {sorted(documented)} are not KernelConfig's {sorted(field_names())}: "
        + REGENERATE)


def test_every_field_is_explained_in_its_docstring():
    rows = kernel_fields()  # raises, naming the field, for one its dataclass's docstring does not explain
    assert [name for name, _, _ in rows] and sorted(n for n, _, _ in rows) == sorted(field_names())
    assert all(what for _, _, what in rows)
    assert "## Kernel config fields" in page() and "`side_stream_priority` | `\"high\"` |" in page()
