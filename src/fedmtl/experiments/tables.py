"""``fedmtl tables [--check]``: every stored result table regenerated from its stored measurements.

A table in ``benchmarks/results/`` is what its experiment's ``*_markdown`` function makes of the JSON stored beside
it (``TABLES``).  ``fedmtl tables`` rewrites them all; ``--check`` writes nothing and fails naming every table that
differs (the test suite runs it), so a stored table never drifts from its numbers.  The handbook includes these
files rather than copies of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .adapters import adapters_markdown
from .async_clock import async_markdown
from .mocha import table1_markdown
from .mocha_skewed import table4_markdown
from .peer_fedper import peer_fedper_markdown
from .perfedavg import perfedavg_markdown
from .personalization import comparison_markdown, fmnist_cnn_markdown, personalization_markdown
from .robustness import robustness_markdown
from .tuned import tuned_markdown
from .tuned_edges import edges_markdown

#: stored table (relative to the results directory) -> the function that makes it from its directory's JSON
TABLES: dict[str, Callable[[Path], str]] = {
    "adapters/adapters.md": adapters_markdown,
    "async/async.md": async_markdown,
    "mocha/table1.md": table1_markdown,
    "mocha/table4.md": table4_markdown,
    "peer_fedper/peer_fedper.md": peer_fedper_markdown,
    "personalization/personalization.md": personalization_markdown,
    "comparison/comparison.md": comparison_markdown,
    "fmnist_cnn/fmnist_cnn.md": fmnist_cnn_markdown,
    "perfedavg/perfedavg.md": perfedavg_markdown,
    "robustness/robustness.md": robustness_markdown,
    "tuned/quick/tuned.md": tuned_markdown,
    "tuned/fmnist_mlp/tuned.md": tuned_markdown,
    "tuned/synthetic_mixture/tuned.md": tuned_markdown,
    "tuned/synthetic_mixture/edges.md": edges_markdown,
    "tuned/fmnist_mlp/edges.md": edges_markdown,
}


def regenerate(results: Path, check: bool = False) -> list[str]:
    """Rewrite every table of ``TABLES`` under ``results`` (or, with ``check``, only compare); returns the tables
    that differed from their stored file."""
    from ..config import ConfigError
    from ..runs.report import write_table

    if not results.is_dir():
        shown = str(results) if len(str(results)) <= 80 else f"{str(results)[:77]}..."
        raise ConfigError(f"--results {shown!r}: not a results directory (the checkout's benchmarks/results)")
    differ = []
    for rel, make in TABLES.items():
        path = results / rel
        try:
            text = make(path.parent)
        except FileNotFoundError as e:  # a measurement the table is made from: the directory is incomplete
            raise ConfigError(f"{results}: {rel} cannot be made: {e.filename} is missing") from None
        if not path.exists() or path.read_text() != text:
            differ.append(rel)
            if not check:
                write_table(path, text)
    return differ
