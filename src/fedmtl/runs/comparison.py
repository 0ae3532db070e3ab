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
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from ..engine.evaluation import (
    PARTICIPATION_GAP,
    SEEN_TEST_ACC_BOTTOM10_MEAN,
    SEEN_TEST_ACC_MEAN,
    SEEN_TEST_ACC_P10,
    UNSEEN_TEST_ACC_MEAN,
)
from ..files import atomic, read_json, read_text
from ..schema import shown
from .report import MAX_WIDTH_IN, plot_bands, save_figure, write_json
from .seeds import history_stats, stats

METRICS = [(SEEN_TEST_ACC_MEAN, "avg"), (SEEN_TEST_ACC_P10, "p10 (bottom decile)"),
           (SEEN_TEST_ACC_BOTTOM10_MEAN, "worst 10% mean"), (UNSEEN_TEST_ACC_MEAN, "unseen avg"),
           (PARTICIPATION_GAP, "participation gap")]


MAX_SUMMARY_BYTES = 1 << 24  # a run's summary.json
MAX_CSV_BYTES = 1 << 30  # its metrics.csv and clients.csv (a million clients' rows)


def _read_json(path: Path) -> dict[str, Any]:
    try:  # kind and size first: a FIFO, a device or a huge file given as summary.json is refused, not read
        out = read_json(path, MAX_SUMMARY_BYTES, "run summary", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{path.parent}: not a run directory (no summary.json; did the run finish?)") from None
    except OSError as e:
        raise ConfigError(f"{path}: unreadable ({e.strerror or e})") from None
    if not isinstance(out, dict) or not isinstance(out.get("final"), dict):
        raise ConfigError(f"{path}: not a fedmtl summary (no 'final' table)")
    bad = [k for k, v in out["final"].items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:  # a summary is written with NaN as null: Inf or NaN here was not written by fedmtl
        raise ConfigError(f"{path}: final {str(bad[0])[:80]} is not a finite number")
    return out


def _rows(path: Path, what: str) -> list[dict[str, Any]]:
    """The rows of a run's CSV file, read defensively (``fedmtl.files``): errors name the file."""
    try:
        text = read_text(path, MAX_CSV_BYTES, what, ConfigError)
    except OSError as e:
        raise ConfigError(f"{path}: unreadable ({e.strerror or e})") from None
    try:
        return list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise ConfigError(f"{path}: not a readable CSV file ({e})") from None


def _finite(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """``metrics.csv``'s rows with a whole round number: numbers as floats (NaN and Inf left out), other text as is."""
    rows = []
    for row in _rows(path, "metrics"):
        clean: dict[str, Any] = {}
        for k, v in row.items():
            if not isinstance(k, str) or not isinstance(v, str) or not v:
                continue
            try:
                x = float(v)
            except ValueError:
                clean[k] = v
                continue
            if math.isfinite(x):
                clean[k] = x
        rnd = clean.get("round")
        if isinstance(rnd, float) and rnd.is_integer() and 0 <= rnd <= 10**9:
            clean["round"] = int(rnd)
            rows.append(clean)
    return rows


def _client_acc(path: Path) -> dict[int, float]:
    """Final per-client test accuracy of the seen clients (``clients.csv``)."""
    out = {}
    for row in _rows(path, "per-client results"):
        try:
            if row["group"] == "seen" and row["split"] == "test" and float(row["n"]) > 0:
                client, acc = int(row["client"]), _finite(row["acc"])
                if acc is not None and 0 <= client <= 10**9:
                    out[client] = acc
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ConfigError(f"{path}: not a fedmtl clients.csv (columns group, split, client, n, acc expected)"
                              ) from None
    return out


class Run:
    """One RUN_DIR: its single runs (one, or one per seed)."""

    def __init__(self, path: Path):
        self.path = path
        top = _read_json(path / "summary.json")
        if "seeds" in top and isinstance(top.get("runs"), list):
            bad = [r for r in top["runs"] if not (isinstance(r, str) and re.fullmatch(r"seed-\d{1,20}", r))]
            if bad or not top["runs"]:  # a seed folder of this directory, never a path elsewhere
                raise ConfigError(f"{path / 'summary.json'}: 'runs' must name its seed-<S> folders, got "
                                  f"{str(bad[:3] or top['runs'])[:80]}")
            self.dirs = [path / r for r in top["runs"]]
        else:
            self.dirs = [path]
        self.summaries = [top] if self.dirs == [path] else [_read_json(d / "summary.json") for d in self.dirs]
        self.algorithm = str(top.get("algorithm", "?"))
        data = (self.summaries[0].get("config") or {}).get("data") or {}
        self.dataset = str(data.get("name", "")) if isinstance(data, dict) else ""

    def final(self, key: str) -> dict[str, Any] | None:
        vals = [s["final"].get(key) for s in self.summaries]
        if any(isinstance(v, bool) or not isinstance(v, int | float) or _finite(v) is None for v in vals):
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
        raise ConfigError(f"metric {shown(metric)} (--metric): not in these runs' summaries; one of {known}")
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
