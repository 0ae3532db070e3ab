"""Run outputs: per-round CSV, per-client CSV, summary JSON, accuracy plot, Markdown tables."""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10, SEEN_TRAIN_ACC_MEAN, UNSEEN_TEST_ACC_MEAN
from ..files import atomic

# a context variable (set by ``quick_mode`` for its block), not process-wide state
_QUICK: ContextVar[bool] = ContextVar("fedmtl_quick_mode", default=False)


# whether each run draws its own accuracy.png (a reproduction's runs do not: it draws one summary figure)
_RUN_FIGURES: ContextVar[bool] = ContextVar("fedmtl_run_figures", default=True)


@contextlib.contextmanager
def run_figures(on: bool = True) -> Iterator[None]:
    """Within: every run writes (``on``) or skips its per-run figures (``accuracy.png``)."""
    token = _RUN_FIGURES.set(on)
    try:
        yield
    finally:
        _RUN_FIGURES.reset(token)


def run_figures_on() -> bool:
    return _RUN_FIGURES.get()


@contextlib.contextmanager
def quick_mode(on: bool = True) -> Iterator[None]:
    """Within: every table (``write_table``) and figure (``save_figure``) is marked as a quick smoke run, so a
    ``--quick`` result can never pass for a real one."""
    token = _QUICK.set(on)
    try:
        yield
    finally:
        _QUICK.reset(token)


def write_table(path: Path, text: str) -> None:
    """Write a Markdown report atomically; in quick mode its first heading says "(QUICK run ...)"."""
    if _QUICK.get():
        note = "(QUICK run: a shortened smoke test, not the result)"
        lines = text.split("\n")
        at = next((i for i, ln in enumerate(lines) if ln.startswith("#")), None)
        if at is None:
            lines.insert(0, f"# {note}\n")
        else:
            lines[at] = f"{lines[at]} {note}"
        text = "\n".join(lines)
    with atomic(Path(path)) as f:
        f.write(text)


#: a colour-blind-safe palette (Okabe & Ito); beyond its 8 colours the curves change line style
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
LINESTYLES = ("-", "--", ":", "-.")
MAX_WIDTH_IN = 12.0  # figures never grow wider than this (inches; 1440 px at the PNG's 120 dpi)


def style(i: int) -> dict[str, Any]:
    """Colour and line style of curve ``i``: distinct for 32 curves."""
    return {"color": PALETTE[i % len(PALETTE)], "linestyle": LINESTYLES[(i // len(PALETTE)) % len(LINESTYLES)]}


def save_figure(fig: Any, path: Path, dpi: int = 120, vector: bool = False) -> None:
    """Save a matplotlib figure as PNG atomically and close it (``vector``: a PDF beside it, for papers); in quick
    mode every axes title starts "QUICK:"."""
    import matplotlib.pyplot as plt

    if _QUICK.get():
        for ax in fig.get_axes():
            ax.set_title("QUICK: " + ax.get_title(), fontsize=9)
        fig.tight_layout()
    with atomic(Path(path), "wb") as f:
        fig.savefig(f, dpi=dpi, format="png", bbox_inches="tight")
    if vector:
        with atomic(Path(path).with_suffix(".pdf"), "wb") as f:
            fig.savefig(f, format="pdf", bbox_inches="tight")
    plt.close(fig)


# metrics.csv's leading columns, in this order, then every other column sorted by name: one order for every
# executor (a Flower run's evaluation arrives node by node, a resumed run's history from its checkpoint); "runs":
# the seeds a row of a run with several seeds averages
HISTORY_COLUMNS = ("round", "runs", "lr", "clients", "dropped", "excluded", "train_loss", "est_time_s", "epsilon")


def history_columns(history: list[dict[str, Any]]) -> list[str]:
    """The columns of ``metrics.csv`` for ``history``: ``HISTORY_COLUMNS`` present, then the rest by name."""
    seen = {k for row in history for k in row}
    return [k for k in HISTORY_COLUMNS if k in seen] + sorted(seen - set(HISTORY_COLUMNS))


def write_history_csv(path: Path, history: list[dict[str, Any]]) -> None:
    keys = history_columns(history)
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


def plot_curves(path: Path, curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], ylabel: str,
                title: str, xlabel: str = "round") -> None:
    """Line plot of several (x, y) curves, written as PNG."""
    plot_bands(path, {label: (x, y, None) for label, (x, y) in curves.items()}, ylabel, title, xlabel)


def plot_bands(path: Path, bands: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
               ylabel: str, title: str, xlabel: str = "round", vector: bool = False) -> None:
    """Curves (x, mean, std) each drawn as a line with a shaded mean +- std band (none where std is None),
    written as PNG (and PDF with ``vector``).  Colour-blind-safe colours, line styles beyond 8 curves, the legend
    outside the axes beyond 6, the width capped at ``MAX_WIDTH_IN``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outside = len(bands) > 6
    columns = 1 + len(bands) // 24
    fig, ax = plt.subplots(figsize=(min(6.4 + (2.2 * columns if outside else 0.0), MAX_WIDTH_IN), 4.2))
    for i, (label, (x, m, s)) in enumerate(bands.items()):
        xa, ma = np.asarray(x, dtype=np.float64), np.asarray(m, dtype=np.float64)
        (line,) = ax.plot(xa, ma, marker="o" if len(xa) < 30 else None, ms=3, label=label, **style(i))
        if s is not None:
            sa = np.asarray(s, dtype=np.float64)
            ax.fill_between(xa, ma - sa, ma + sa, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=columns, frameon=False)
        fig.tight_layout()  # the axes shrink to make room for the legend: the width stays within the cap
    else:  # no tight_layout: with the legend inside the axes it only repeats what save_figure's bbox_inches="tight"
        # does (every artist kept, the margins trimmed), and its extra draw was a third of each run's figure
        ax.legend(fontsize=8)
    save_figure(fig, path, vector=vector)


HATCHES = ("", "//", "..", "xx")  # bar series beyond the palette's colours change hatch


def plot_bars(path: Path, panels: Mapping[str, Mapping[str, Mapping[str, tuple[float, float | None]]]],
              value_label: str, title: str, horizontal: bool = False, vector: bool = True) -> None:
    """Grouped bars with error bars: per panel (side by side, e.g. one per dataset), per category (a method, a
    swept value), one bar per series (e.g. average and bottom-decile accuracy) of height ``mean`` and error bar
    ``std`` (none where None).  ``horizontal``: categories down the y axis (for many methods).  Colour-blind-safe
    colours, the legend above the panels, the width capped at ``MAX_WIDTH_IN``; PNG and (``vector``) PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(c for p in panels.values() for c in p))
    series = list(dict.fromkeys(s for p in panels.values() for c in p.values() for s in c))
    n, k = len(panels), max(len(series), 1)
    long = 0.32 * len(cats) * max(1.0, k / 2) + 1.5
    if horizontal:
        size = (min(3.2 * n + 2.0, MAX_WIDTH_IN), max(3.0, long))
    else:
        size = (min(max(4.0, long) * n, MAX_WIDTH_IN), 4.2)
    fig, axes = plt.subplots(1, n, figsize=size, sharey=horizontal, squeeze=False)
    width = 0.8 / k
    for ax, (ptitle, panel) in zip(axes[0], panels.items(), strict=True):
        for j, sname in enumerate(series):
            pos = np.arange(len(cats)) + (j - (k - 1) / 2) * width
            vals = np.array([panel.get(c, {}).get(sname, (np.nan, None))[0] for c in cats], dtype=np.float64)
            errs = np.array([np.nan if (e := panel.get(c, {}).get(sname, (np.nan, None))[1]) is None else e
                             for c in cats], dtype=np.float64)
            kw = {"color": PALETTE[j % len(PALETTE)], "hatch": HATCHES[(j // len(PALETTE)) % len(HATCHES)],
                  "label": sname, "edgecolor": "white", "linewidth": 0.5}
            err = errs if np.isfinite(errs).any() else None
            if horizontal:
                ax.barh(pos, vals, height=width, xerr=err, capsize=2, **kw)
            else:
                ax.bar(pos, vals, width=width, yerr=err, capsize=2, **kw)
        ticks = (np.arange(len(cats)), [str(c) for c in cats])
        if horizontal:
            ax.set_yticks(*ticks)
            ax.set_ylim(len(cats) - 0.5, -0.5)  # the first category on top (the axes share y: set, not inverted)
            ax.set_xlabel(value_label)
            ax.grid(axis="x", alpha=0.3)
        else:
            ax.set_xticks(*ticks, rotation=30 if len(cats) > 6 else 0, ha="right" if len(cats) > 6 else "center")
            ax.set_ylabel(value_label)
            ax.grid(axis="y", alpha=0.3)
        ax.set_title(ptitle, fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=min(k, 4), fontsize=8,
               frameon=False)
    fig.tight_layout()
    save_figure(fig, path, vector=vector)


def plot_history(path: Path, history: list[dict[str, Any]], title: str, x: str = "round") -> None:
    """Accuracy curves of a run against ``x``: ``round``, or ``est_time_s`` (the simulated clock, in seconds)."""
    curves = {}
    for key, label in ((SEEN_TEST_ACC_MEAN, "test (seen, mean)"), (SEEN_TEST_ACC_P10, "test (seen, 10th pct)"),
                       (SEEN_TRAIN_ACC_MEAN, "train (seen, mean)"), (UNSEEN_TEST_ACC_MEAN, "test (unseen, mean)")):
        rows = [r for r in history if isinstance(r.get(key), float)]
        if rows:
            curves[label] = ([r[x] for r in rows], [100 * r[key] for r in rows])
    if curves:
        plot_curves(path, curves, "accuracy (%)", title, "simulated time (s)" if x == "est_time_s" else x)


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
