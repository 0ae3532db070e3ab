"""No import cycle anywhere in ``src/fedmtl``: the module graph is built from the source (every ``import`` and
``from ... import`` statement, at module level or inside functions; those under ``if TYPE_CHECKING:`` are left out,
as they never run) and must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(root: Path = SRC, package: str = "fedmtl") -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` at any depth, but not the body of an ``if TYPE_CHECKING:`` (its ``else``
    branch runs, so it counts)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append(child)
            if isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            visit(child)

    visit(tree)
    return out


def import_graph(root: Path = SRC, package: str = "fedmtl") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports.  ``from X import name`` is an import of the module ``X.name``
    where there is one (``from .. import tree`` imports ``fedmtl.tree``, not the package's ``__init__``), else of
    ``X``; ``import a.b.c`` is an import of ``a.b.c`` (of its longest prefix that is a module of the package)."""
    mods = modules(root, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_package) in mods.items():
        here = name if is_package else name.rpartition(".")[0]
        for node in import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w):], w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "fedmtl.tree" in graph["fedmtl.engine.clients"] and "fedmtl" not in graph["fedmtl.engine.clients"]
    assert "fedmtl.experiments.common" in graph["fedmtl.experiments.fedem"]
    assert "fedmtl.experiments.fedem" in graph["fedmtl.cli"]  # imported inside _cmd_main
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_src():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_test_the_suite_starts_first_exists():
    """``tests/conftest.py`` LONGEST orders the suite's long tests by name: a renamed or removed test would silently
    lose its place, so each entry must name a test function of its file."""
    from pathlib import Path

    from .conftest import LONGEST

    here = Path(__file__).parent
    for entry in LONGEST:
        file, name = entry.split("::")
        assert f"def {name}(" in (here / file).read_text(), entry


def test_model_keeps_what_a_model_is():
    """``Model`` (``models/base.py``) stays a description of a network: under 300 lines, with execution (the stacked
    value-and-grad families, the clients form) in ``models.stacking`` / ``models.clientstack`` and its helpers in
    ``models.parts``."""
    src = (SRC / "fedmtl" / "models" / "base.py").read_text()
    assert len(src.splitlines()) < 300, "models/base.py has grown to 300 lines: move helpers out (models.parts)"
    tree = ast.parse(src)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    methods = {n.name for n in model.body if isinstance(n, ast.FunctionDef)}
    assert not {m for m in methods if "stacked" in m or m.endswith("_clients")}, methods
