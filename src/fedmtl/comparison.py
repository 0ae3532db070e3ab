"""``fedmtl compare RUN_DIR... [--metric seen_test_acc_mean] --out DIR``: results of several runs side by side.

A RUN_DIR is a run directory (``fedmtl run``) or a several-seeds directory (``fedmtl run --seeds``, holding
``seed-<S>/`` run directories).  Written to DIR:

* ``compare.md``: a Markdown table, one row per RUN_DIR (sorted by ``--metric``, best first), one column per
  metric (mean over clients, 10th percentile = bottom decile, mean of the worst 10% of clients, unseen clients,
  participation gap), each ``mean ± std`` over the seeds (a single run: its value), in percent;
* ``compare.json``: the same numbers, with the per-seed values;
* ``curves.png``: ``--metric`` against the round, the mean over seeds with a +-1 std band;
* ``clients.png``: the distribution over clients of their final test accuracy (box plots; for several seeds, each
  client's accuracy averaged over the seeds): personalization is about that spread, not only its mean.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError
from .engine.evaluation import (
    PARTICIPATION_GAP,
    SEEN_TEST_ACC_BOTTOM10_MEAN,
    SEEN_TEST_ACC_MEAN,
    SEEN_TEST_ACC_P10,
    UNSEEN_TEST_ACC_MEAN,
)
from .engine.seeds import history_stats, stats
from .files import read_text
from .report import MAX_WIDTH_IN, atomic, plot_bands, save_figure, write_json

METRICS = [(SEEN_TEST_ACC_MEAN, "avg"), (SEEN_TEST_ACC_P10, "p10 (bottom decile)"),
           (SEEN_TEST_ACC_BOTTOM10_MEAN, "worst 10% mean"), (UNSEEN_TEST_ACC_MEAN, "unseen avg"),
           (PARTICIPATION_GAP, "participation gap")]


MAX_SUMMARY_BYTES = 1 << 24  # a run's summary.json
MAX_CSV_BYTES = 1 << 30  # its metrics.csv and clients.csv (a million clients' rows)


def _read_json(path: Path) -> dict[str, Any]:
    try:  # kind and size before a byte is read (fedmtl.files)
        out = json.loads(read_text(path, MAX_SUMMARY_BYTES, "run summary", ConfigError))
    except FileNotFoundError:
        raise ConfigError(f"{path.parent}: not a run directory (no summary.json; did the run finish?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({str(e)[:200]})") from None
    if not isinstance(out, dict) or not isinstance(out.get("final"), dict):
        raise ConfigError(f"{path}: not a fedmtl summary (no 'final' table)")
    return out


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    with io.StringIO(read_text(path, MAX_CSV_BYTES, "metrics", ConfigError), newline="") as f:
        for row in csv.DictReader(f):
            clean: dict[str, Any] = {}
            for k, v in row.items():
                try:
                    clean[k] = float(v) if v not in ("", None) else None
                except ValueError:
                    clean[k] = v
            if clean.get("round") is not None:
                clean["round"] = int(clean["round"])
                rows.append({k: v for k, v in clean.items() if v is not None})
    return rows


def _client_acc(path: Path) -> dict[int, float]:
    """Final per-client test accuracy of the seen clients (``clients.csv``)."""
    out = {}
    with io.StringIO(read_text(path, MAX_CSV_BYTES, "per-client results", ConfigError), newline="") as f:
        for row in csv.DictReader(f):
            if row["group"] == "seen" and row["split"] == "test" and float(row["n"]) > 0:
                out[int(row["client"])] = float(row["acc"])
    return out


class Run:
    """One RUN_DIR: its single runs (one, or one per seed)."""

    def __init__(self, path: Path):
        self.path = path
        top = _read_json(path / "summary.json")
        if "seeds" in top and isinstance(top.get("runs"), list):
            self.dirs = [path / r for r in top["runs"]]
        else:
            self.dirs = [path]
        self.summaries = [top] if self.dirs == [path] else [_read_json(d / "summary.json") for d in self.dirs]
        self.algorithm = str(top.get("algorithm", "?"))
        data = (self.summaries[0].get("config") or {}).get("data") or {}
        self.dataset = str(data.get("name", "")) if isinstance(data, dict) else ""

    def final(self, key: str) -> dict[str, Any] | None:
        vals = [s["final"].get(key) for s in self.summaries]
        if any(not isinstance(v, int | float) for v in vals):
            return None
        return stats([float(v) for v in vals])

    def history(self) -> list[dict[str, Any]]:
        return history_stats([_read_metrics(d / "metrics.csv") for d in self.dirs if (d / "metrics.csv").exists()])

    def clients(self) -> np.ndarray:
        per = [_client_acc(d / "clients.csv") for d in self.dirs if (d / "clients.csv").exists()]
        if not per:
            return np.zeros(0)
        ids = sorted(set.intersection(*(set(p) for p in per)))
        return np.array([np.mean([p[i] for p in per]) for i in ids])


def _labels(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


#: the files ``compare`` writes into its output folder
OUTPUTS = ("compare.md", "compare.json", "curves.png", "clients.png")


def compare(run_dirs: list[str | Path], out: str | Path, metric: str = SEEN_TEST_ACC_MEAN) -> dict[str, Any]:
    """Finished runs side by side (``fedmtl compare``): writes ``out/compare.md`` (mean ± std over each run's seeds),
    the curves of ``metric`` per round with seed bands, and the per-client accuracy distributions; returns the
    table's rows.  ``run_dirs``: run directories of ``fedmtl.run`` / ``fedmtl run`` (with or without seeds)."""
    if not run_dirs:
        raise ConfigError("compare: give at least one run directory")
    paths = [Path(p) for p in run_dirs]
    runs = [Run(p) for p in paths]
    labels = _labels(paths)
    keys = [k for k, _ in METRICS if any(r.final(k) is not None for r in runs)]
    if metric not in keys and not any(r.final(metric) for r in runs):
        known = sorted({k for r in runs for k in r.summaries[0]["final"]})
        raise ConfigError(f"metric {metric!r} (--metric): not in these runs' summaries; one of {known}")
    if metric not in keys:
        keys.insert(0, metric)
    table = {lbl: {k: r.final(k) for k in keys} for lbl, r in zip(labels, runs, strict=True)}
    order = sorted(labels, key=lambda lbl: -((table[lbl][metric] or {}).get("mean") or float("-inf")))
    names = dict(METRICS)

    def cell(st: dict[str, Any] | None, n: int) -> str:
        if st is None or st["mean"] is None:
            return "–"
        return f"{100 * st['mean']:.2f}" + (f" ± {100 * st['std']:.2f}" if n > 1 else "")

    seeds = {lbl: len(r.dirs) for lbl, r in zip(labels, runs, strict=True)}
    algos = {lbl: r.algorithm for lbl, r in zip(labels, runs, strict=True)}
    header = ["run", "algorithm", "seeds", *(names.get(k, k) for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for lbl in order:
        lines.append("| " + " | ".join([lbl, algos[lbl], str(seeds[lbl]),
                                        *(cell(table[lbl][k], seeds[lbl]) for k in keys)]) + " |")
    md = (f"Final test accuracy (%) across clients; mean ± std over seeds; sorted by {metric}.\n\n"
          + "\n".join(lines) + "\n")
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    with atomic(outd / "compare.md") as f:
        f.write(md)
    write_json(outd / "compare.json", {"metric": metric, "order": order, "seeds": seeds, "algorithms": algos,
                                      "results": table, "runs": {lbl: str(p) for lbl, p in zip(labels, paths,
                                                                                               strict=True)}})
    bands = {}
    for lbl, r in zip(labels, runs, strict=True):
        pts = [h for h in r.history() if h.get(f"{metric}_mean") is not None]
        if pts:
            bands[lbl] = ([h["round"] for h in pts], [100 * h[f"{metric}_mean"] for h in pts],
                          [100 * (h[f"{metric}_std"] or 0.0) for h in pts])
    if bands:
        readable = {SEEN_TEST_ACC_MEAN: "test accuracy, mean over clients", SEEN_TEST_ACC_P10:
                    "test accuracy, 10th percentile over clients", SEEN_TEST_ACC_BOTTOM10_MEAN:
                    "test accuracy, mean of the worst 10% of clients", UNSEEN_TEST_ACC_MEAN:
                    "test accuracy of unseen clients, mean"}.get(metric, metric)
        datasets = sorted({r.dataset for r in runs if r.dataset})
        plot_bands(outd / "curves.png", bands, f"{readable} (%)",
                   f"{', '.join(datasets) or 'runs'}: {', '.join(sorted(set(algos.values())))[:80]} "
                   "(mean over seeds, band = ±1 std)", vector=True)
    dists = {lbl: r.clients() for lbl, r in zip(labels, runs, strict=True)}
    _plot_clients(outd / "clients.png", {k: v for k, v in dists.items() if v.size})
    print(md)
    return {"table": table, "order": order, "markdown": md}


def _plot_clients(path: Path, dists: dict[str, np.ndarray]) -> None:
    if not dists:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(dists)
    fig, ax = plt.subplots(figsize=(min(max(4.0, 0.6 * n + 2), MAX_WIDTH_IN), 4.2 + (0.8 if n > 10 else 0.0)))
    ax.boxplot([100 * v for v in dists.values()], showmeans=True)
    ax.set_xticks(range(1, n + 1), list(dists), rotation=0 if n <= 4 else 30 if n <= 10 else 60,
                  ha="center" if n <= 4 else "right", fontsize=8 if n <= 10 else 6)
    ax.set_ylabel("final test accuracy of a client (%)")
    ax.set_title("accuracy across clients (box: quartiles, whiskers 1.5 IQR, triangle: mean)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path, vector=True)


__all__ = ["OUTPUTS", "compare"]
