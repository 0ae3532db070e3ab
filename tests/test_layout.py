"""The source layout page (``docs/reference/layout.md``) names every module and package of ``src/fedmtl`` and
nothing that does not exist: a module added, moved or removed without the page is a failure here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "fedmtl"
#: packages whose modules are one per algorithm or reproduction: the page names the package, ``fedmtl list`` and
#: ``fedmtl reproduce --help`` the modules
BY_NAME = ("algorithms", "experiments")


def _block() -> str:
    text = (ROOT / "docs" / "reference" / "layout.md").read_text(encoding="utf-8")
    match = re.search(r"```\nsrc/fedmtl/\n(.*?)\n\S", text, re.S)  # up to the next top-level entry
    assert match, "layout.md: no src/fedmtl/ block"
    return match.group(1)


def _modules() -> tuple[set[str], set[str]]:
    files: set[str] = set()
    packages = {d.name for d in PACKAGE.rglob("*") if (d / "__init__.py").is_file()} | {"configs"}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        if rel.name in ("__init__.py", "__main__.py") or rel.parts[0] in BY_NAME:
            continue
        files.add(rel.name)
    return files, packages


def test_the_layout_page_names_every_module_and_nothing_else():
    block = _block()
    files, packages = _modules()
    named = {n for n in re.findall(r"\b[\w]+\.py\b", block) if not n.startswith("test_")}
    assert not files - named, f"modules missing from docs/reference/layout.md: {sorted(files - named)}"
    named -= {"__init__.py", "__main__.py"}
    assert not named - files, f"layout.md names modules that do not exist: {sorted(named - files)}"
    dirs = set(re.findall(r"(?<![\w/])(\w+)/(?=\s)", block))  # "engine/ ", "steps/ (", not "body/head"
    assert not packages - dirs, f"packages missing from docs/reference/layout.md: {sorted(packages - dirs)}"
    assert not dirs - packages, f"layout.md names packages that do not exist: {sorted(dirs - packages)}"
