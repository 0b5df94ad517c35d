"""The package's layers, read from the source (nothing imported): no import cycles between modules, each package
imports only those below it (docs/structure.md states the order), imports at the top of files, no file over 600
lines, and the operational MOELORA_* environment variables few."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moelora"

# the layer order, lowest first (docs/structure.md): a package imports only packages of a lower rank, or its own
RANK = {"kernels": 0, "config": 0, "layers": 1, "adapters": 2, "models": 3, "distributed": 4, "engine": 5,
        "demo": 6, "server": 7, "cli": 8, "__main__": 9, "__init__": 10}  # __init__: the package's face (LLM, ...)
# files whose imports inside functions are on purpose: the command line loads only what the command asked for
# (the server's web stack, the benchmarks)
LAZY_OK = {"moelora/cli.py"}
OPTIONAL = {"triton", "matplotlib", "tqdm", "peft", "transformers", "openai", "fastapi", "uvicorn", "numpy"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(path: pathlib.Path) -> list[tuple[str, bool, int]]:
    """(imported moelora module, at module level, line) for every import of moelora in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports under a module-level if / try (optional dependencies, TYPE_CHECKING) count as top
        if isinstance(n, (ast.If, ast.Try)):
            top.update(id(c) for c in ast.walk(n))
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("moelora"):
                out.append((name, id(node) in top, node.lineno))
    return out


def _type_checking_only(path: pathlib.Path) -> set[int]:
    """Lines of imports under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    tree = ast.parse(path.read_text())
    lines = set()
    for n in tree.body:
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            lines.update(c.lineno for c in ast.walk(n) if hasattr(c, "lineno"))
    return lines


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        skip = _type_checking_only(path)
        for name, _, line in _imports(path):
            if name != mod and line not in skip and not mod.startswith(name + "."):
                g[mod].add(name)
    return g


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_each_package_imports_only_lower_layers():
    bad = []
    for mod, deps in _graph().items():
        mine = _package(mod)
        for d in deps:
            theirs = _package(d)
            if theirs != mine and RANK[theirs] >= RANK[mine] and theirs != "__init__":
                bad.append(f"{mod} imports {d} ({mine} is not above {theirs})")
    assert bad == []


def test_kernels_import_nothing_else_of_moelora():
    bad = [f"{m} -> {d}" for m, deps in _graph().items() if m.startswith("moelora.kernels")
           for d in deps if not d.startswith("moelora.kernels")]
    assert bad == []


def _lazy_imports(path: pathlib.Path) -> list[str]:
    """Imports inside functions or classes, other than of optional dependencies."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "."]
            else:
                continue
            out += [f"{node.lineno} {n}" for n in names if n.split(".")[0] not in OPTIONAL]
    return sorted(set(out))


def test_imports_at_the_top_of_files():
    bad = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if rel not in LAZY_OK:
            bad += [f"{rel}:{item}" for item in _lazy_imports(path)]
    assert bad == []


@pytest.mark.parametrize("pkg", ["moelora", "moelora_bench"])
def test_no_file_over_600_lines(pkg):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_at_most_15_environment_variables():
    names = set()
    for path in MODULES.values():
        names.update(re.findall(r"MOELORA_[A-Z0-9_]+", path.read_text()))
    assert len(names) <= 15, sorted(names)

