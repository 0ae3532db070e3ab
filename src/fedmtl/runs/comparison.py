"""``fedmtl compare RUN_DIR... [--metric seen_test_acc_mean] --out DIR``: results of several runs side by side.

A RUN_DIR is a run directory (``fedmtl run``) or a several-seeds directory (``fedmtl run --seeds``, holding
``seed-<S>/`` run directories).  Written to DIR:

* ``compare.md``: a Markdown table, one row per RUN_DIR (sorted by ``--metric``, best first), one column per
  metric (mean over clients, 10th percentile = bottom decile, mean of the worst 10% of clients, unseen clients,
  participation gap), each ``mean ± std`` over the seeds (a single run: its value), in percent (a loss, a metric
  whose name ends in "loss": as a number, lowest first);
* ``compare.json``: the same numbers, with the per-seed values;
* ``curves.png``: ``--metric`` against the round, the mean over seeds with a +-1 std band;
* ``clients.png``: the distribution over clients of their final test accuracy (box plots; for several seeds, each
  client's accuracy averaged over the seeds): personalization is about that spread, not only its mean.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import tempfile
import unicodedata
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
    for k, v in out["final"].items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue  # a seeds summary's {mean, std, ...} tables; other values are shown as missing
        if not math.isfinite(v):  # a summary is written with NaN as null: Inf or NaN here was not written by fedmtl
            raise ConfigError(f"{path}: final {shown(k)} is not a finite number")
        _check_value(path, f"final {shown(k)}", k, v)
    if out.get("config") is not None and not isinstance(out["config"], dict):
        raise ConfigError(f"{path}: 'config' must be a table, got {type(out['config']).__name__}")
    return out


def _is_loss(metric: str) -> bool:
    """A loss (lower is better, shown as a number) rather than an accuracy (higher is better, shown in percent)."""
    return metric.endswith("loss")


def _check_value(path: Path, where: str, name: str, v: float) -> None:
    """Refuse a finite value no run writes: an accuracy (a name with the word "acc": ``seen_test_acc_mean``) outside
    [0, 1], a negative loss."""
    if "acc" in name.split("_") and not 0.0 <= v <= 1.0:
        raise ConfigError(f"{path}: {where} = {shown(v)} is not an accuracy (between 0 and 1)")
    if _is_loss(name) and v < 0:
        raise ConfigError(f"{path}: {where} = {shown(v)} is not a loss (a loss is not negative)")


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
                _check_value(path, f"column {shown(k)}", k, x)
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
            if not (row["group"] == "seen" and row["split"] == "test" and float(row["n"]) > 0):
                continue
            client, acc = int(row["client"]), float(row["acc"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ConfigError(f"{path}: not a fedmtl clients.csv (columns group, split, client, n, acc expected)"
                              ) from None
        if not math.isnan(acc) and 0 <= client <= 10**9:
            if not 0.0 <= acc <= 1.0:
                raise ConfigError(f"{path}: client {client}'s acc = {shown(acc)} is not an accuracy (between 0 and 1)")
            out[client] = acc
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
            twice = sorted({r for r in top["runs"] if top["runs"].count(r) > 1})
            if twice:  # one run counted as several seeds
                raise ConfigError(f"{path / 'summary.json'}: 'runs' names {shown(twice[0])} more than once")
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


def _md(text: str) -> str:
    """``text`` as one cell of a Markdown table: ``|`` and ``\\`` escaped, a line break or another control character
    shown as Python writes it in a string (``\\n``), so that a name cannot break the table."""
    out = []
    for ch in text:
        if ch in "\\|":
            out.append("\\" + ch)
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(repr(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def _distinct(paths: list[Path]) -> None:
    """Refuse a run directory given twice (under one name or two): it would be one row, or two of the same run."""
    seen: dict[Path, Path] = {}
    for p in paths:
        try:
            key = p.resolve()
        except (OSError, RuntimeError):  # a symlink loop: Run() names it
            key = p.absolute()
        if key in seen:
            same = "" if str(seen[key]) == str(p) else f" (as {shown(str(seen[key]), bare=True)})"
            raise ConfigError(f"compare: run directory {shown(str(p), bare=True)} is given twice{same}; give each "
                              "run once")
        seen[key] = p


#: the files ``compare`` writes into its output folder
OUTPUTS = ("compare.md", "compare.json", "curves.png", "clients.png")
_PLOTS = ("curves.png", "curves.pdf", "clients.png", "clients.pdf")


def compare(run_dirs: list[str | Path], out: str | Path, metric: str = SEEN_TEST_ACC_MEAN) -> dict[str, Any]:
    """Finished runs side by side (``fedmtl compare``): writes ``out/compare.md`` (mean ± std over each run's seeds),
    the curves of ``metric`` per round with seed bands, and the per-client accuracy distributions; returns the
    table's rows.  ``run_dirs``: run directories of ``fedmtl.run`` / ``fedmtl run`` (with or without seeds).
    Every input is read and checked before anything is written, and the files replace a comparison ``out`` already
    holds only once all of them are made: a comparison that fails leaves ``out`` as it was."""
    if not run_dirs:
        raise ConfigError("compare: give at least one run directory")
    paths = [Path(p) for p in run_dirs]
    _distinct(paths)
    runs = [Run(p) for p in paths]
    labels = _labels(paths)
    keys = [k for k, _ in METRICS if any(r.final(k) is not None for r in runs)]
    if metric not in keys and not any(r.final(metric) for r in runs):
        known = sorted({k for r in runs for k in r.summaries[0]["final"]})
        raise ConfigError(f"metric {shown(metric)} (--metric): not in these runs' summaries; one of {known}")
    if metric not in keys:
        keys.insert(0, metric)
    table = {lbl: {k: r.final(k) for k in keys} for lbl, r in zip(labels, runs, strict=True)}
    lower = _is_loss(metric)  # a loss: lowest first

    def rank(lbl: str) -> tuple[bool, float]:
        mean = (table[lbl][metric] or {}).get("mean")
        return mean is None, (0.0 if mean is None else mean if lower else -mean)

    order = sorted(labels, key=rank)
    names = dict(METRICS)

    def cell(k: str, st: dict[str, Any] | None, n: int) -> str:
        if st is None or st["mean"] is None:
            return "–"
        if _is_loss(k):
            return f"{st['mean']:.4f}" + (f" ± {st['std']:.4f}" if n > 1 else "")
        return f"{100 * st['mean']:.2f}" + (f" ± {100 * st['std']:.2f}" if n > 1 else "")

    seeds = {lbl: len(r.dirs) for lbl, r in zip(labels, runs, strict=True)}
    algos = {lbl: r.algorithm for lbl, r in zip(labels, runs, strict=True)}
    header = ["run", "algorithm", "seeds", *(names.get(k, k) for k in keys)]
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    for lbl in order:
        lines.append("| " + " | ".join([_md(lbl), _md(algos[lbl]), str(seeds[lbl]),
                                        *(cell(k, table[lbl][k], seeds[lbl]) for k in keys)]) + " |")
    losses = [_md(k) for k in keys if _is_loss(k)]
    md = ("Final test accuracy (%) across clients"
          + (f", {', '.join(losses)} as a number" if losses else "")
          + f"; mean ± std over seeds; sorted by {_md(metric)}{', lowest first' if lower else ''}.\n\n"
          + "\n".join(lines) + "\n")
    scale = 1.0 if lower else 100.0
    bands = {}
    for lbl, r in zip(labels, runs, strict=True):  # every metrics.csv and clients.csv is read before any write
        pts = [h for h in r.history() if h.get(f"{metric}_mean") is not None]
        if pts:
            bands[lbl] = ([h["round"] for h in pts], [scale * h[f"{metric}_mean"] for h in pts],
                          [scale * (h[f"{metric}_std"] or 0.0) for h in pts])
    dists = {lbl: r.clients() for lbl, r in zip(labels, runs, strict=True)}
    summary = {"metric": metric, "order": order, "seeds": seeds, "algorithms": algos, "results": table,
               "runs": {lbl: str(p) for lbl, p in zip(labels, paths, strict=True)}}

    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=outd, prefix=".compare-", suffix=".tmp"))
    try:
        with atomic(stage / "compare.md") as f:
            f.write(md)
        write_json(stage / "compare.json", summary)
        if bands:
            readable = {SEEN_TEST_ACC_MEAN: "test accuracy, mean over clients", SEEN_TEST_ACC_P10:
                        "test accuracy, 10th percentile over clients", SEEN_TEST_ACC_BOTTOM10_MEAN:
                        "test accuracy, mean of the worst 10% of clients", UNSEEN_TEST_ACC_MEAN:
                        "test accuracy of unseen clients, mean"}.get(metric, metric)
            datasets = sorted({r.dataset for r in runs if r.dataset})
            plot_bands(stage / "curves.png", bands, readable if lower else f"{readable} (%)",
                       f"{', '.join(datasets) or 'runs'}: {', '.join(sorted(set(algos.values())))[:80]} "
                       "(mean over seeds, band = ±1 std)", vector=True)
        _plot_clients(stage / "clients.png", {k: v for k, v in dists.items() if v.size})
        made = {p.name for p in stage.iterdir()}
        if (outd / "compare.md").exists() or (outd / "compare.json").exists():
            for name in _PLOTS:  # an earlier comparison's plots that this one has not: not left beside it
                if name not in made:
                    (outd / name).unlink(missing_ok=True)
        for name in (*_PLOTS, "compare.json", "compare.md"):
            if name in made:
                os.replace(stage / name, outd / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
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
