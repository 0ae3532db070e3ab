"""The correctness record, ``docs/guide/correctness.md``, generated from the tests marked
``@pytest.mark.correctness(methods, checks, guards=...)``: per method, what is checked and the implementation mistake
the check would catch.  ``python -m tests.correctness_page`` rewrites the page; ``tests/test_docs.py`` checks that it
is current and that every registered method and asynchronous mode has at least one check."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "correctness.md"


def _is_mark(node: ast.expr) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "correctness" and isinstance(f.value, ast.Attribute)
            and f.value.attr == "mark")


def collect() -> dict[str, list[tuple[str, str, str]]]:
    """method -> [(what is checked, the mistake it catches, "file::test")], read from the tests' source (nothing is
    imported or run)."""
    record: dict[str, list[tuple[str, str, str]]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and _is_mark(dec):
                    methods = ast.literal_eval(dec.args[0])
                    checks = ast.literal_eval(dec.args[1])
                    guards = ast.literal_eval(next(k.value for k in dec.keywords if k.arg == "guards"))
                    for m in methods:
                        record.setdefault(m, []).append((checks, guards, f"{path.name}::{node.name}"))
    return record


def render() -> str:
    record = collect()
    lines = [
        "# Correctness record",
        "",
        "Every registered method passes the contract suite (`fedmtl.testing.check_algorithm`: the loop and vmap",
        "executors agree, inputs are never mutated, the same seed gives the same run, the loss falls on a toy task, a",
        "checkpoint round trip resumes exactly, NaN updates are excluded, private releases are noised, and everything",
        "works together). Beyond it, each method has checks that would catch the mistakes its implementations are",
        "prone to: a reduction to another method where the paper says they coincide, a closed form or a hand",
        "computation on a small problem, equality to a reference solver. This page is generated from those tests",
        "(`python -m tests.correctness_page`; the test suite fails when it is out of date).",
        "",
        "| method | what is checked | the mistake it would catch | test |",
        "|---|---|---|---|",
    ]
    for method in sorted(record):
        for checks, guards, test in record[method]:
            cells = [c.replace("|", "\\|") for c in (checks, guards)]  # a | inside a cell would end it
            lines.append(f"| `{method}` | {cells[0]} | {cells[1]} | `{test}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
