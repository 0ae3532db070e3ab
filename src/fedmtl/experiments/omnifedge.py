"""``fedmtl reproduce omnifedge-fmnist``: Omni-Fedge against FedSGD, FedAvg and Local on 5 Fashion-MNIST nodes with
non-IID class fractions (``configs/omnifedge/fmnist.toml``); the methods are data: ``omnifedge.toml`` beside this
module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.evaluation import SEEN_TEST_ACC_MEAN
from ..resources import config_path
from ..runs.report import markdown_table, plot_curves, write_json, write_table
from .common import method_overrides, read_tables, run_methods, show

#: label -> ``--set`` overrides of every method
METHODS: dict[str, list[str]] = method_overrides(read_tables("omnifedge.toml")["methods"])


def omnifedge_fmnist(out: Path, quick: bool = False) -> dict[str, Any]:
    """Omni-Fedge vs FedSGD and FedAvg on 5 Fashion-MNIST nodes (non-IID class fractions): accuracy against
    communication rounds (``DIR/omnifedge.png``) and the final table (``DIR/omnifedge.md``, ``summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    ov = ["run.rounds=20", "run.eval_every=5", "data.download=false"] if quick else ["data.download=false"]
    res = run_methods(out, config_path("omnifedge/fmnist"), METHODS, ov)
    curves = {}
    for n, s in res.items():
        hist = [r for r in s["history"] if SEEN_TEST_ACC_MEAN in r]
        curves[n] = ([r["round"] for r in hist], [100 * r[SEEN_TEST_ACC_MEAN] for r in hist])
    plot_curves(out / "omnifedge.png", curves, "test accuracy (%), mean over the 5 nodes",
                "Fashion-MNIST, 5 nodes, non-IID (Omni-Fedge setting)", xlabel="communication round")
    rows = {n: {"avg": 100 * s["final"][SEEN_TEST_ACC_MEAN], "rounds": s["rounds"]} for n, s in res.items()}
    md = ("# Omni-Fedge setting: 5 Fashion-MNIST nodes, test accuracy (%) after the last round\n\n"
          + markdown_table(["method", "avg", "rounds"], [[n, r["avg"], r["rounds"]] for n, r in rows.items()]))
    write_table(out / "omnifedge.md", md)
    write_json(out / "summary.json", rows)
    show(md)
    return rows


__all__ = ["METHODS", "omnifedge_fmnist"]
