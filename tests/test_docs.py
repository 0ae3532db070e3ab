"""The handbook (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (a broken link or anchor, a missing
page, a docstring mkdocstrings cannot render fails), its generated pages (the configuration reference, one page per
benchmark JSON) are in the site and never in the tree, and no page reads like a lab notebook."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import built_once

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _build(out: Path) -> str:
    """``mkdocs build --strict`` into ``out``; what it printed if it failed, else ""."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    return "" if r.returncode == 0 else r.stdout[-3000:] + r.stderr[-5000:]


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The handbook built once per test run (``built_once``: under pytest-xdist the first worker that needs it builds
    it into the run's shared temporary folder while the others wait, then all read the same site)."""
    for mod in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (the 'docs' extra: pip install -e '.[docs]')")

    def build(out: Path) -> str:
        failed = _build(out)
        assert not failed, failed
        return str(out)

    return Path(built_once(tmp_path_factory, "site", build))


def _page(site: Path, path: str) -> str:
    f = site / path / "index.html"
    assert f.is_file(), f"{path}: not in the built site"
    return f.read_text()


@pytest.mark.slow
def test_handbook_builds_strict_with_its_key_pages(site):
    for path in ("", "getting-started", "guide/python-api", "guide/algorithms", "guide/configuration",
                 "guide/flower", "guide/privacy-robustness", "guide/mocha", "guide/networked", "reference/partition",
                 "reference/testing", "results/main-job", "results/speed", "results/scale", "results/robustness",
                 "explanations/evaluation-protocol", "explanations/deviations"):
        _page(site, path)
    # DEPLOY.md is included as it is, not copied
    assert "Deploying fedmtl over Flower" in _page(site, "guide/deploy")
    # figures from benchmarks/results and docs/compare are in the site
    assert (site / "results/data/robustness/robustness.png").is_file()
    assert (site / "compare/curves.png").is_file()


@pytest.mark.slow
def test_api_reference_renders_every_public_name(site):
    import fedmtl

    html = _page(site, "reference/api")
    for name in fedmtl.__all__:
        if not name.startswith("_"):
            assert f'id="fedmtl.{name}"' in html, f"fedmtl.{name} is not in the API reference"
    assert 'id="fedmtl.testing.check_algorithm"' in _page(site, "reference/testing")
    assert 'id="fedmtl.data.partition.dirichlet"' in _page(site, "reference/partition")


@pytest.mark.slow
def test_config_reference_is_generated_from_the_dataclasses(site):
    from fedmtl.config import ALGORITHMS, TABLES
    from fedmtl.registry import field_table

    html = _page(site, "reference/config")
    for table, t in TABLES.items():
        assert f"[{table}]" in html, table
        for name, *_ in field_table(t.cls):
            assert f"<code>{name}</code>" in html, f"[{table}] {name}"
    for name in ALGORITHMS:
        assert f'name = "{name}"' in html.replace("&quot;", '"'), name
    assert "float in (0, 1000]" in html  # optim.lr's declared range
    assert not (ROOT / "docs" / "reference" / "config.md").exists(), "generated pages are built into the site only"


@pytest.mark.slow
def test_every_benchmark_json_has_a_results_page(site):
    files = sorted(RESULTS.rglob("*.json"))
    assert files
    index = _page(site, "results/data")
    for f in files:
        rel = f.relative_to(RESULTS).with_suffix("").as_posix()
        html = _page(site, f"results/data/{rel}")
        data = json.loads(f.read_text())
        if isinstance(data, dict) and "torch" in data:
            assert str(data["torch"]) in html, f"{rel}: the torch version it records"
        assert rel in index
    assert not (ROOT / "docs" / "results" / "data").exists(), "generated pages are built into the site only"


def test_no_page_reads_like_a_lab_notebook():
    """The README and the handbook speak of releases, machines by their hardware and measurements, never of a
    working session or of 'this machine'."""
    pages = [ROOT / "README.md", ROOT / "DEPLOY.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = re.compile(r"\bsessions?\b|this machine|this version|previous version|measured here", re.I)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not found, "\n".join(found)


def test_the_readme_main_job_table_is_the_handbook_s():
    """The README's main-job table and the main-job page's are the same rows (one measurement, shown twice)."""

    def rows(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if re.match(r"\| (local|fedavg|fedem|ifca|scaffold|feddyn|clustered|"
                                                             r"fedprox|fedavg\+|pfedme\S*) ", ln)]

    readme = rows((ROOT / "README.md").read_text())
    page = rows((ROOT / "docs" / "results" / "main-job.md").read_text())
    assert len(readme) == 11 and readme == page


@pytest.mark.slow
def test_the_correctness_record_is_generated_from_the_tests_and_covers_every_method():
    """docs/guide/correctness.md is what ``python -m tests.correctness_page`` writes from the tests marked
    ``@pytest.mark.correctness``, and every registered method and asynchronous mode has at least one check."""
    from fedmtl.algorithms import ALGORITHMS
    from fedmtl.engine.async_config import ASYNC_MODES

    from .correctness_page import PAGE, collect, render

    assert PAGE.read_text() == render(), "run: python -m tests.correctness_page"
    record = collect()
    missing = sorted((set(ALGORITHMS) | set(ASYNC_MODES)) - set(record))
    assert not missing, f"methods without a correctness check: {missing}"
    assert set(record) <= set(ALGORITHMS) | set(ASYNC_MODES), sorted(set(record) - set(ALGORITHMS) - set(ASYNC_MODES))
