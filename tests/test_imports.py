"""The package's shape: dependencies point one way, and `import xlafit` stays light.

The import graph is read from the source (``ast``), so an import inside a function counts as
an edge too: hiding a cycle behind one is how cycles grew before.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Function-level imports of xlafit modules allowed outside cli/ (whose commands import the
# library when they run, for a fast `xlafit --help`), each with its reason at the import.
ALLOWED_LAZY: set[tuple[str, str]] = set()

# Heavy or optional third-party packages that `import xlafit` must not load.
OPTIONAL = ("keras", "torch", "torchax", "transformers", "gcsfs", "matplotlib", "tensorflow")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "xlafit").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _edges(modules: dict[str, Path]) -> list[tuple[str, str, bool, int]]:
    """(importer, imported module, inside a function?, line) for every import of xlafit."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target.split(".")[0] == "xlafit" and target != name:
                    edges.append((name, target, id(node) in in_function, node.lineno))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for importer, imported, _, _ in _edges(_modules()):
        graph.setdefault(importer, set()).add(imported)
    assert _cycles(graph) == []


def test_the_subpackages_depend_one_way():
    """Between subpackages too (``hf`` uses ``models``, never the reverse), not only modules."""
    top = {m: ".".join(m.split(".")[:2]) for m in _modules()}
    graph: dict[str, set[str]] = {}
    for importer, imported, _, _ in _edges(_modules()):
        a, b = top[importer], top.get(imported, imported)
        if a != b and "xlafit" not in (a, b):  # the package root re-exports the public API
            graph.setdefault(a, set()).add(b)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_level_import_of_xlafit_outside_the_cli():
    hidden = [
        f"{importer}:{line} imports {imported}"
        for importer, imported, in_function, line in _edges(_modules())
        if in_function and not importer.startswith("xlafit.cli") and (importer, imported) not in ALLOWED_LAZY
    ]
    assert hidden == [], "import at the top of the module (or move the shared piece down a layer)"


def test_import_xlafit_loads_no_optional_package():
    code = (
        "import sys; before = set(sys.modules); import jax; after_jax = set(sys.modules); import xlafit; "
        f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules and m not in after_jax))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Functions longer than this (docstring excluded) read as several jobs; the exceptions, and why.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if docstring and isinstance(first.value.value, str):
                lines -= (first.end_lineno or first.lineno) - first.lineno + 1
            if lines > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in LONG_FUNCTIONS:
                long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


# The package's own lazy attribute access (`xlafit.Trainer` without importing the trainer
# at `import xlafit`) is the one logic a package's __init__.py holds.
INIT_FUNCTIONS = {"xlafit": {"__getattr__", "__dir__"}}


def test_a_packages_init_re_exports_and_holds_no_logic():
    """A package's ``__init__.py`` names what it offers; its functions and classes live in
    modules of their own, where a reader of the package's tree finds them by name."""
    held = []
    for name, path in _modules().items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        defined = {
            node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        held += [f"{name}.{d}" for d in sorted(defined - INIT_FUNCTIONS.get(name, set()))]
    assert not held, f"defined in a package's __init__.py (move each to a module and re-export it): {held}"
