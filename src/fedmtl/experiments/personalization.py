"""Personalized methods side by side: ``fedmtl reproduce personalization`` (every method against FedAvg on
label-permuted client groups) and ``fedmtl reproduce fmnist-cnn`` (the body/head methods and FedBN on Fashion-MNIST
with a CNN).  The methods and their settings are data: ``personalization.toml`` beside this module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import load
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..resources import config_path
from ..runs.report import markdown_table
from .common import method_overrides, publish, read_tables, run_methods

_TABLES = read_tables("personalization.toml")
#: label -> ``--set`` overrides of every method of ``reproduce personalization``
PERSONALIZATION_METHODS: dict[str, list[str]] = method_overrides(_TABLES["personalization"]["methods"])
PERSONALIZATION_SEEDS: list[int] = list(_TABLES["personalization"]["seeds"])
#: label -> ``--set`` overrides of every method of ``reproduce fmnist-cnn``
FMNIST_CNN_METHODS: dict[str, list[str]] = method_overrides(_TABLES["fmnist_cnn"]["methods"])
FMNIST_CNN_ROUNDS: int = _TABLES["fmnist_cnn"]["rounds"]
FMNIST_CNN_FRACTION: float = _TABLES["fmnist_cnn"]["fraction"]
#: label -> ``--set`` overrides of every method of the comparison on the two federations below
COMPARISON_METHODS: dict[str, list[str]] = method_overrides(_TABLES["comparison"]["methods"])
COMPARISON_SEEDS: list[int] = list(_TABLES["comparison"]["seeds"])
#: the federations of the comparison: bundled config names
COMPARISON_FEDERATIONS: list[str] = list(_TABLES["comparison"]["federations"])


def _personalization_model(overrides: list[str]) -> str:
    """The model column of the personalization table for one method's overrides."""
    if "model.batch_norm=true" in overrides:
        return "mlp-bn"
    return "mlp" if "model.name=mlp" in overrides else "linear"


def personalization(out: Path, quick: bool = False) -> dict[str, Any]:
    """Every method against FedAvg on data that needs personalization (4 client groups with permuted labels), each
    with 3 seeds; writes ``DIR/personalization.md``, ``.json`` and ``summary.json``; then the comparison of every
    personalized method on Fashion-MNIST Dirichlet(0.1) and the synthetic mixture (``comparison``, in
    ``DIR/comparison``)."""
    rows = permuted(out, quick)
    comparison(out / "comparison", quick)
    return rows


def permuted(out: Path, quick: bool = False) -> dict[str, Any]:
    """The label-permuted groups table of ``personalization``."""
    out.mkdir(parents=True, exist_ok=True)
    ov = ["run.rounds=5", "run.eval_every=5"] if quick else []  # --quick: a smoke run of every method, two seeds
    seeds = PERSONALIZATION_SEEDS[:2] if quick else PERSONALIZATION_SEEDS
    res = run_methods(out, config_path("personalization/permuted"), PERSONALIZATION_METHODS, ov, seeds=seeds)
    baseline = {"linear": "fedavg", "mlp": "fedavg (mlp)", "mlp-bn": "fedavg (mlp-bn)"}
    fedavg = {m: 100 * res[n]["final"][SEEN_TEST_ACC_MEAN] for m, n in baseline.items() if n in res}
    rows = {}
    for n, s in res.items():
        model = _personalization_model(PERSONALIZATION_METHODS[n])
        avg = 100 * s["final"][SEEN_TEST_ACC_MEAN]
        rows[n] = {"model": model, "avg": avg, "avg_std": 100 * s["final_std"][SEEN_TEST_ACC_MEAN],
                   "bottom_decile": 100 * s["final"][SEEN_TEST_ACC_P10],
                   "bottom_decile_std": 100 * s["final_std"][SEEN_TEST_ACC_P10],
                   "vs_fedavg_same_model": avg - fedavg[model], "seeds": seeds}
    publish(out, "personalization.md", rows, personalization_markdown)
    return rows


def personalization_markdown(results: Path) -> str:
    """``personalization.md`` from the run's stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    rows: dict[str, Any] = json.loads((results / "summary.json").read_text())
    seeds = next(iter(rows.values()))["seeds"] if rows else PERSONALIZATION_SEEDS
    title = "Label-permuted client groups (40 clients, 4 groups, 10 classes)"
    return (f"# {title}: test accuracy (%), final round, mean ± std over seeds {seeds}"
            "\n\n"
            + markdown_table(["method", "model", "avg", "p10", "minus FedAvg (same model)"],
                             [[n, r["model"], f"{r['avg']:.1f} ± {r['avg_std']:.1f}",
                               f"{r['bottom_decile']:.1f} ± {r['bottom_decile_std']:.1f}",
                               f"{r['vs_fedavg_same_model']:+.1f}"] for n, r in rows.items()]))


def comparison(out: Path, quick: bool = False) -> dict[str, Any]:
    """Every personalized method, each with the same MLP, on each federation of ``COMPARISON_FEDERATIONS``, with the
    seeds ``COMPARISON_SEEDS``: the final round's mean and bottom decile over clients, mean ± std over seeds; writes
    ``DIR/comparison.md`` and ``summary.json`` (runs in ``DIR/<federation>/runs``)."""
    from ..data.federated import DataError

    out.mkdir(parents=True, exist_ok=True)
    ov = ["run.rounds=2", "run.eval_every=2", "run.checkpoint_every=2"] if quick else []
    seeds = COMPARISON_SEEDS[:1] if quick else COMPARISON_SEEDS  # --quick: a smoke run of every method, one seed
    table: dict[str, Any] = {}
    for fed in COMPARISON_FEDERATIONS:
        base = config_path(fed)
        extra = ["data.download=false", "data.fraction=0.02"] if quick and "fmnist" in fed else []
        extra += ["data.num_clients=10"] if quick else []
        try:
            res = run_methods(out / fed.split("/")[-1], base, COMPARISON_METHODS, [*ov, *extra],
                              seeds=seeds)
        except DataError as e:
            print(f"{fed} skipped: {e}")
            continue
        cfg = load(base, [*ov, *extra])
        table[fed.split("/")[-1]] = {
            "config": fed, "rounds": cfg.run.rounds, "clients": int(cfg.data.get("num_clients", 0)),
            "methods": {n: {"avg": 100 * r["final"][SEEN_TEST_ACC_MEAN],
                            "avg_std": 100 * r["final_std"][SEEN_TEST_ACC_MEAN],
                            "bottom_decile": 100 * r["final"][SEEN_TEST_ACC_P10],
                            "bottom_decile_std": 100 * r["final_std"][SEEN_TEST_ACC_P10],
                            "overrides": COMPARISON_METHODS[n]} for n, r in res.items()}}
    publish(out, "comparison.md", {"federations": table, "seeds": seeds, "quick": quick},
            comparison_markdown)
    comparison_figure(out)
    return table


def comparison_figure(results: Path) -> Path | None:
    """``summary.png`` / ``.pdf`` of the comparison from its stored ``summary.json`` (one panel per federation: every
    method's average and bottom decile, mean ± std over seeds), its numbers in ``figure.json``."""
    from ..runs.report import write_json
    from .common import AVG, FIGURE, P10, summary_figure

    s = json.loads((results / "summary.json").read_text())
    panels = {f"{fed} ({t['clients']} clients, {t['rounds']} rounds)":
              {n: {AVG: [r["avg"], r["avg_std"]], P10: [r["bottom_decile"], r["bottom_decile_std"]]}
               for n, r in t["methods"].items()} for fed, t in s["federations"].items()}
    write_json(results / FIGURE, {"panels": panels})
    for sub in results.glob(f"*/{FIGURE}"):  # the runs' own panels say the same: the stored summary's are drawn
        sub.unlink()
    seeds = ", ".join(str(x) for x in s["seeds"])
    return summary_figure(results, f"Every personalized method, the same MLP: final test accuracy, seeds {seeds}")


def comparison_markdown(results: Path) -> str:
    """``comparison.md`` from the run's stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    stored = json.loads((results / "summary.json").read_text())
    feds: dict[str, Any] = stored["federations"]
    names = list(feds)
    methods: list[str] = []
    for f in feds.values():
        methods += [m for m in f["methods"] if m not in methods]
    titles = {"fmnist_dirichlet": "Fashion-MNIST, Dirichlet(0.1)", "synthetic_mixture": "synthetic mixture"}
    header = ["method"]
    for n in names:
        t = titles.get(n, n)
        header += [f"{t}: avg", f"{t}: p10"]
    rows = []
    for m in methods:
        row: list[Any] = [m]
        for n in names:
            r = feds[n]["methods"].get(m)
            row += (["—", "—"] if r is None else [f"{r['avg']:.1f} ± {r['avg_std']:.1f}",
                                                  f"{r['bottom_decile']:.1f} ± {r['bottom_decile_std']:.1f}"])
        rows.append(row)
    detail = "; ".join(f"{titles.get(n, n)}: {feds[n]['clients']} clients, {feds[n]['rounds']} rounds" for n in names)
    return (f"# Personalized methods: test accuracy (%) of the final round, mean over clients (avg) and 10th "
            f"percentile (p10), mean ± std over seeds {stored['seeds']}\n\n{detail}; every method with the same MLP."
            "\n\n"
            + markdown_table(header, rows)
            + ("\n\n—: not measured in the stored run (" + ", ".join(stored["not_run"]) + ")"
               if stored.get("not_run") else ""))


def fmnist_cnn(out: Path, quick: bool = False) -> dict[str, Any] | None:
    """Body/head methods (FedPer, FedRep, FedRoD, FedBABU, kNN-Per) and FedBN against Local and FedAvg on Fashion-MNIST
    (100 clients, 3 label groups by Dirichlet(0.4)) with the FEMNIST CNN, one seed (a CNN round takes seconds on a
    CPU); writes ``DIR/fmnist_cnn.md`` and ``summary.json``.  Returns None without the data."""
    from ..data.federated import DataError

    out.mkdir(parents=True, exist_ok=True)
    base = config_path("fmnist_cnn/fedavg")
    ov = (["run.rounds=2", "run.eval_every=1", "data.num_clients=10", "data.fraction=0.02"] if quick
          else [f"run.rounds={FMNIST_CNN_ROUNDS}", "run.eval_every=5", f"data.fraction={FMNIST_CNN_FRACTION}"])
    ov += ["data.download=false", "run.checkpoint_every=10"]
    try:
        load(base, ov).build_data()
    except DataError as e:
        print(f"Fashion-MNIST CNN table skipped: {e}")
        return None
    res = run_methods(out, base, FMNIST_CNN_METHODS, ov)
    local = 100 * res["local"]["final"][SEEN_TEST_ACC_MEAN]
    rows = {}
    for n, s in res.items():
        model = "cnn_bn" if "model.name=cnn_bn" in FMNIST_CNN_METHODS[n] else "cnn_femnist"
        avg = 100 * s["final"][SEEN_TEST_ACC_MEAN]
        rows[n] = {"model": model, "avg": avg, "bottom_decile": 100 * s["final"][SEEN_TEST_ACC_P10],
                   "minus_local": avg - local, "rounds": s["rounds"], "seconds_per_round": s["seconds_per_round"]}
    publish(out, "fmnist_cnn.md", {"results": rows, "quick": quick, "methods": FMNIST_CNN_METHODS}, fmnist_cnn_markdown)
    return rows


def fmnist_cnn_markdown(results: Path) -> str:
    """``fmnist_cnn.md`` from the run's stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    stored = json.loads((results / "summary.json").read_text())
    rows: dict[str, Any] = stored["results"]
    frac, clients = (0.02, 10) if stored.get("quick") else (FMNIST_CNN_FRACTION, 100)
    title = (f"Fashion-MNIST ({100 * frac:.0f}% of the images), {clients} clients, 3 label groups by "
             "Dirichlet(0.4), FEMNIST CNN")
    return (f"# {title}: test accuracy (%) after the last round, seed 1234\n\n"
            + markdown_table(["method", "model", "avg", "p10", "minus Local", "rounds", "time/round"],
                             [[n, r["model"], r["avg"], r["bottom_decile"], f"{r['minus_local']:+.1f}", r["rounds"],
                               f"{r['seconds_per_round']:.1f} s"] for n, r in rows.items()]))


__all__ = ["COMPARISON_FEDERATIONS", "COMPARISON_METHODS", "COMPARISON_SEEDS", "FMNIST_CNN_FRACTION",
           "FMNIST_CNN_METHODS", "FMNIST_CNN_ROUNDS", "PERSONALIZATION_METHODS", "PERSONALIZATION_SEEDS", "comparison",
           "fmnist_cnn", "permuted", "personalization"]
