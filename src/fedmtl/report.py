"""Run outputs: per-round CSV, per-client CSV, summary JSON, accuracy plot, Markdown tables."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np


@contextlib.contextmanager
def atomic(path: Path, mode: str = "w", private: bool = False) -> Iterator[IO[Any]]:
    """Open a unique temporary file beside ``path``; on success fsync it and rename it over ``path`` (readers see
    the old file or the new one, never a part); on failure (a full disk, Ctrl-C) delete it.  ``private``: the
    file stays 0600 (mkstemp's mode) from its first byte, for keys."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({"newline": ""} if "b" not in mode else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if not private:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_history_csv(path: Path, history: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    with atomic(path) as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for row in history:
            w.writerow({k: row.get(k, "") for k in keys})


def write_clients_csv(path: Path, per_client: dict[str, Any]) -> None:
    with atomic(path) as f:
        w = csv.writer(f)
        w.writerow(["group", "client", "split", "n", "acc", "loss"])
        for g, splits in per_client.items():
            for s, m in splits.items():
                ids = m.get("client", range(len(m["n"])))
                for i, n, a, l in zip(ids, m["n"], m["acc"], m["loss"], strict=True):
                    w.writerow([g, int(i), s, int(n), f"{a:.6f}", f"{l:.6f}"])


def write_json(path: Path, obj: Any) -> None:
    def clean(o: Any) -> Any:
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [clean(v) for v in o]
        if isinstance(o, np.generic):
            o = o.item()
        if isinstance(o, float) and not math.isfinite(o):
            return None
        return o

    with atomic(path) as f:
        f.write(json.dumps(clean(obj), indent=2) + "\n")


def plot_curves(path: Path, curves: dict[str, tuple[Sequence[float], Sequence[float]]], ylabel: str,
                title: str, xlabel: str = "round") -> None:
    """Line plot of several (x, y) curves, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (x, y) in curves.items():
        ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic(path, "wb") as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def plot_bands(path: Path, bands: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float]]], ylabel: str,
               title: str, xlabel: str = "round") -> None:
    """Curves (x, mean, std) each drawn as a line with a shaded mean +- std band, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (x, m, s) in bands.items():
        xa, ma, sa = (np.asarray(v, dtype=np.float64) for v in (x, m, s))
        (line,) = ax.plot(xa, ma, marker="o" if len(xa) < 30 else None, ms=3, label=label)
        ax.fill_between(xa, ma - sa, ma + sa, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic(path, "wb") as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def plot_history(path: Path, history: list[dict[str, Any]], title: str) -> None:
    curves = {}
    for key, label in (("seen_test_acc_mean", "test (seen, mean)"), ("seen_test_acc_p10", "test (seen, 10th pct)"),
                       ("seen_train_acc_mean", "train (seen, mean)"), ("unseen_test_acc_mean", "test (unseen, mean)")):
        rows = [r for r in history if isinstance(r.get(key), float)]
        if rows:
            curves[label] = ([r["round"] for r in rows], [100 * r[key] for r in rows])
    if curves:
        plot_curves(path, curves, "accuracy (%)", title)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
