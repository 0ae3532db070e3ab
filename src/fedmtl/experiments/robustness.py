"""``fedmtl reproduce robustness``: every robust aggregator against every attack, and a privacy-utility curve
(``configs/robust/*.toml``).

The core is the synthetic FedAvg matrix (``configs/robust/synthetic.toml``: FedEM's mixture data, 30 clients, a
linear model, 30 rounds, every client in every round): the aggregators ``mean``, ``median``, ``trimmed_mean``
(``trim`` = the attacker fraction), ``krum`` and ``multi_krum`` (``num_byzantine`` = the number of attackers f),
``bulyan`` (``num_byzantine`` = f, lowered to the largest value its ``4f + 3`` rule allows), ``centered_clip``
(automatic tau, 3 iterations) and bucketing with s = 2 in front of ``centered_clip``, ``median`` and ``krum``,
each clean and against every attack of ``ATTACKS`` at 20% and 30% attackers.  FedAvg runs 3 seeds (the mean is
reported; the per-seed spread is in the JSON); FedEM (M = 3) and Ditto (lambda 0.1) run the same matrix with one
seed, and Fashion-MNIST (``configs/robust/fmnist.toml``) runs it for FedAvg with one seed.  An aggregator *fails*
an attack where its accuracy is more than ``FAIL_POINTS`` below the clean run (the plain mean, no attack).

Privacy (unchanged from the earlier study): Poisson sampling of 20% of the clients per round, ``clip_norm`` 1,
noise multipliers 0.5 / 1 / 2 / 4, epsilon at delta = 1e-5 against accuracy, for FedAvg, FedEM and Ditto on both
datasets.

The methods, attacks, aggregators, fractions, noise levels and seeds are data: ``robustness.toml`` beside this
module.

Every number is the final round's mean test accuracy over all clients, attackers included (never a best round).
Writes ``robustness.md``, ``robustness.json`` (= ``summary.json``), ``robustness.png`` (the FedAvg matrices as
heat maps) and ``privacy.png`` into the output folder; runs are kept under ``runs/`` and a re-run continues from
them.  ``quick``: 6 rounds, FedAvg only, one seed, IPM (0.1) at 20% attackers against every aggregator, and two
noise levels.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..config import load
from ..engine.evaluation import SEEN_TEST_ACC_MEAN
from ..engine.sampling import clients_per_round
from ..resources import configs_root
from ..robust.aggregators import RobustConfig
from ..runs.report import markdown_table, plot_curves, save_figure, write_json, write_table
from .common import method_overrides, overrides, read_tables, run_methods, show

_TABLES = read_tables("robustness.toml")
#: method -> ``--set`` overrides (``robustness.toml``, as every table below)
METHODS: dict[str, list[str]] = method_overrides(_TABLES["methods"])
#: attack key -> (column title, overrides): each attack's strength as the study runs it
ATTACKS: dict[str, tuple[str, list[str]]] = {
    key: (a["title"], overrides({t: v for t, v in a.items() if t != "title"})) for key, a in _TABLES["attacks"].items()}
BUCKET: int = _TABLES["bucket"]
AGGREGATORS: tuple[str, ...] = (*_TABLES["aggregators"], *(f"{a}+b{BUCKET}" for a in _TABLES["bucketed"]))
FRACTIONS: tuple[float, ...] = tuple(_TABLES["fractions"])
FAIL_POINTS: float = _TABLES["fail_points"]
NOISE: tuple[float, ...] = tuple(_TABLES["noise"])
#: dataset -> {method: seeds (None: the config's one seed)} of the attack matrix
MATRIX: dict[str, dict[str, tuple[int, ...] | None]] = {
    ds: {m: tuple(seeds) or None for m, seeds in plan.items()} for ds, plan in _TABLES["matrix"].items()}


def aggregator_overrides(agg: str, frac: float, num_clients: int, per_round: int) -> list[str]:
    """``--set`` overrides of aggregator ``agg`` (``name`` or ``name+bS``) against ``frac`` attackers."""
    name, _, s = agg.partition("+b")
    f = int(round(frac * num_clients))
    sets = [f"robust.aggregator={name}"]
    if s:
        sets.append(f"robust.bucketing={s}")
    if name == "trimmed_mean":
        sets.append(f"robust.trim={frac}")
    if name in ("krum", "multi_krum"):
        sets.append(f"robust.num_byzantine={f}")
    if name == "bulyan":  # the largest f its 4f + 3 rule allows
        rows = RobustConfig(bucketing=int(s or 0)).inputs_per_round(per_round)
        sets.append(f"robust.num_byzantine={min(f, max(0, (rows - 3) // 4))}")
    return sets


def _frac_dependent(agg: str) -> bool:
    return agg.split("+")[0] in ("trimmed_mean", "krum", "multi_krum", "bulyan")


def clean_label(agg: str, frac: float) -> str:
    """The label of ``agg``'s run without attackers (per fraction where its settings depend on it)."""
    return f"clean/{int(round(100 * frac))}%/{agg}" if _frac_dependent(agg) else f"clean/{agg}"


def attack_label(attack: str, frac: float, agg: str) -> str:
    return f"{attack}/{int(round(100 * frac))}%/{agg}"


def _settings(num_clients: int, per_round: int, quick: bool) -> dict[str, list[str]]:
    """label -> --set overrides of every run of the attack matrix."""
    out: dict[str, list[str]] = {}
    attacks = {"ipm0.1": ATTACKS["ipm0.1"]} if quick else ATTACKS
    fractions = FRACTIONS[:1] if quick else FRACTIONS
    for frac in fractions:
        for agg in AGGREGATORS:
            sets = aggregator_overrides(agg, frac, num_clients, per_round)
            out[clean_label(agg, frac)] = sets
            for key, (_, asets) in attacks.items():
                out[attack_label(key, frac, agg)] = [*asets, f"attack.fraction={frac}", *sets]
    return out


def run(out: Path, quick: bool = False, datasets: tuple[str, ...] = ("synthetic", "fmnist"),
        config_dir: Path | None = None, privacy: bool = True) -> dict[str, Any]:
    """The study (``datasets`` of ``config_dir``, default ``configs/robust``); ``privacy``: also the
    privacy-utility part.  A dataset not in ``MATRIX`` runs the matrix for FedAvg with one seed."""
    config_dir = config_dir or configs_root() / "robust"
    out.mkdir(parents=True, exist_ok=True)
    quick_ov = ["run.rounds=6", "run.eval_every=3", "run.checkpoint_every=3"] if quick else []
    result: dict[str, Any] = {"quick": quick, "fail_points": FAIL_POINTS, "wall_s": {}}
    for ds in datasets:
        base = config_dir / f"{ds}.toml"
        cfg = load(base, [])
        n = int(cfg.data.get("num_clients", 100))
        settings = _settings(n, clients_per_round(cfg.run, n), quick)
        plan = {"fedavg": None} if quick else MATRIX.get(ds, {"fedavg": None})
        table: dict[str, dict[str, float | None]] = {}
        spread: dict[str, dict[str, float]] = {}
        seeds_of: dict[str, list[int]] = {}
        for method, seeds in plan.items():
            t0 = time.perf_counter()
            labels = {f"{method}:{label}": [*METHODS[method], *sets] for label, sets in settings.items()}
            res = run_methods(out / ds, base, labels, quick_ov, allow_diverged=True,
                              seeds=list(seeds) if seeds else None)
            for label, s in res.items():
                key = label.split(":", 1)[1]
                acc = s["final"][SEEN_TEST_ACC_MEAN]
                table.setdefault(key, {})[method] = None if s.get("diverged") else 100 * acc
                sd = s.get("final_std", {}).get(SEEN_TEST_ACC_MEAN)
                if sd is not None:
                    spread.setdefault(key, {})[method] = 100 * sd
            seeds_of[method] = list(seeds) if seeds else [cfg.run.seed]
            result["wall_s"][f"{ds} {method} matrix"] = round(time.perf_counter() - t0, 1)
        r = result.setdefault(ds, {})
        r.update({"accuracy": table, "seed_std": spread, "seeds": seeds_of, "num_clients": n,
                  "rounds": 6 if quick else cfg.run.rounds})
        r["fails"] = failures(table, list(plan))
        if privacy:
            t0 = time.perf_counter()
            for method, msets in METHODS.items():
                noise = NOISE[:2] if quick else NOISE
                priv = {f"{method}:dp{z}": [*msets, "privacy.clip_norm=1.0", f"privacy.noise_multiplier={z}",
                                            "run.sampling_rate=0.2"] for z in noise}
                pres = run_methods(out / ds, base, priv, quick_ov, allow_diverged=True)
                pts = sorted((float(s["epsilon"]), 100 * s["final"][SEEN_TEST_ACC_MEAN]) for s in pres.values()
                             if not s.get("diverged"))
                r[f"{method}_privacy"] = [{"epsilon": e, "acc": a} for e, a in pts]
            result["wall_s"][f"{ds} privacy"] = round(time.perf_counter() - t0, 1)
    write_report(out, result)
    return result


def _parse(label: str) -> tuple[str, str | None, str]:
    """label -> (attack or "clean", "20%" or None, aggregator)."""
    parts = label.split("/")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def failures(table: dict[str, dict[str, float | None]], methods: list[str]) -> dict[str, dict[str, list[str]]]:
    """method -> ``"20%/aggregator"`` -> the attacks (and ``clean``) where it is more than ``FAIL_POINTS`` below the
    clean run (the plain mean without attackers), or diverged."""
    out: dict[str, dict[str, list[str]]] = {}
    for m in methods:
        ref = table.get("clean/mean", {}).get(m)
        if ref is None:
            continue
        fails: dict[str, list[str]] = {}
        for label, row in table.items():
            if m not in row:
                continue
            attack, pct, agg = _parse(label)
            v = row[m]
            if v is None or v < ref - FAIL_POINTS:
                pcts = [pct] if pct else [f"{int(round(100 * f))}%" for f in FRACTIONS]
                for p in pcts:
                    fails.setdefault(f"{p}/{agg}", []).append(attack)
        out[m] = fails
    return out


def matrix(table: dict[str, dict[str, float | None]], method: str, frac: float, attacks: list[str]
           ) -> tuple[list[str], list[list[float | None]]]:
    """The aggregators present (rows) and their accuracies: the clean run, then each attack (columns)."""
    rows, values = [], []
    for agg in AGGREGATORS:
        c = table.get(clean_label(agg, frac), {})
        if method not in c:
            continue
        rows.append(agg)
        values.append([c[method], *(table.get(attack_label(a, frac, agg), {}).get(method) for a in attacks)])
    return rows, values


def matrix_markdown(table: dict[str, dict[str, float | None]], method: str, frac: float, attacks: list[str]) -> str:
    """One fraction's matrix for ``method``: rows aggregators, columns clean and each attack; a cell more than
    ``FAIL_POINTS`` below the clean run (plain mean, no attack) is marked ✗, a diverged run ``diverged ✗``."""
    ref = table.get("clean/mean", {}).get(method)
    rows, values = matrix(table, method, frac, attacks)

    def cell(v: float | None) -> str:
        if v is None:
            return "diverged ✗"
        return f"{v:.1f}" + (" ✗" if ref is not None and v < ref - FAIL_POINTS else "")

    body = []
    for agg, vals in zip(rows, values, strict=True):
        fails = sum(1 for v in vals[1:] if v is None or (ref is not None and v < ref - FAIL_POINTS))
        finite = [v for v in vals[1:] if v is not None]
        worst = min(finite) if len(finite) == len(vals) - 1 and finite else None
        body.append([agg, *(cell(v) for v in vals), fails, "diverged" if worst is None else f"{worst:.1f}"])
    header = ["aggregator", "clean", *(ATTACKS[a][0] for a in attacks), "fails", "worst"]
    return markdown_table(header, body)


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``robustness.md``, ``robustness.json``, ``summary.json``, ``robustness.png`` and ``privacy.png`` from a
    study's results."""
    quick = bool(result.get("quick"))
    md, curves, heat = _report(result)
    if curves:
        plot_curves(out / "privacy.png", curves, "final mean test accuracy (%)",
                    f"privacy-utility{' (quick)' if quick else ''}: epsilon at delta = 1e-5 (RDP)", xlabel="epsilon")
    if heat:
        plot_matrices(out / "robustness.png", heat)
    write_table(out / "robustness.md", md)
    write_json(out / "robustness.json", result)
    write_json(out / "summary.json", result)
    show(md)


def robustness_markdown(results: Path) -> str:
    """``robustness.md`` from the stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    return _report(json.loads((results / "summary.json").read_text()))[0]


def _report(result: dict[str, Any]) -> tuple[str, dict[str, tuple[list[float], list[float]]],
                                              dict[str, tuple[list[str], list[str], list[list[float | None]],
                                                              float | None]]]:
    """The report's Markdown, the privacy curves and the FedAvg matrices of a study's results."""
    quick = bool(result.get("quick"))
    md = [f"# Robustness{' (quick: 6 rounds, IPM 0.1 at 20% attackers only)' if quick else ''}: final-round mean "
          "test accuracy (%) over all clients (attackers included)\n\n"
          f"Rows: aggregators (`+b{BUCKET}`: bucketing with s = {BUCKET} in front); columns: the aggregator without "
          "attackers, then each attack. ✗: more than "
          f"{FAIL_POINTS:g} points below the clean run (plain mean, no attack); `fails`: attacks failed; `worst`: "
          "the lowest accuracy under attack.\n"]
    curves: dict[str, tuple[list[float], list[float]]] = {}
    heat: dict[str, tuple[list[str], list[str], list[list[float | None]], float | None]] = {}
    for ds, r in result.items():
        if not isinstance(r, dict) or "accuracy" not in r:
            continue
        table = r["accuracy"]
        methods = [m for m in METHODS if any(m in v for v in table.values())]
        attacks = [a for a in ATTACKS if any(lbl.startswith(a + "/") for lbl in table)]
        fractions = sorted({float(pct[:-1]) / 100 for pct in (_parse(lbl)[1] for lbl in table) if pct})
        md.append(f"\n## {ds} ({r.get('num_clients')} clients, {r.get('rounds')} rounds)\n")
        for m in methods:
            seeds = r.get("seeds", {}).get(m, [])
            ref = table.get("clean/mean", {}).get(m)
            md.append(f"\n### {m} ({'mean of seeds ' + ', '.join(map(str, seeds)) if len(seeds) > 1 else 'one seed'}"
                      f"; clean run {'–' if ref is None else f'{ref:.1f}'})\n")
            for frac in fractions:
                md.append(f"\n{int(round(100 * frac))}% attackers:\n\n" + matrix_markdown(table, m, frac, attacks))
                if m == "fedavg":
                    rows, values = matrix(table, m, frac, attacks)
                    heat[f"{ds} {m} {int(round(100 * frac))}%"] = (rows, ["clean", *attacks], values, ref)
            sds = [v[m] for v in r.get("seed_std", {}).values() if m in v]
            if sds:
                md.append(f"\nStandard deviation over the seeds: median {float(np.median(sds)):.2f}, largest "
                          f"{max(sds):.2f} points.\n")
        for method in METHODS:
            pts = r.get(f"{method}_privacy", [])
            if pts:
                curves[f"{ds} {method}"] = ([p["epsilon"] for p in pts], [p["acc"] for p in pts])
    if result.get("wall_s"):
        md.append("\nWall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["wall_s"].items()) + "\n")
    return "\n".join(md) + "\n", curves, heat


def plot_matrices(path: Path, heat: dict[str, tuple[list[str], list[str], list[list[float | None]], float | None]]
                  ) -> None:
    """Heat maps of accuracy minus the clean run (points), one per matrix, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(2, len(heat))
    nrows = -(-len(heat) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(heat):]:
        ax.set_visible(False)
    for ax, (title, (rows, cols, values, ref)) in zip(axes.flat, heat.items(), strict=False):
        arr = np.array([[np.nan if v is None or ref is None else v - ref for v in row] for row in values])
        im = ax.imshow(arr, cmap="RdYlGn", vmin=-20, vmax=5, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        for i in range(arr.shape[0]):
            for j in range(arr.shape[1]):
                text = "div" if np.isnan(arr[i, j]) else f"{arr[i, j]:.0f}"
                ax.text(j, i, "0" if text == "-0" else text, ha="center", va="center", fontsize=6)
        ax.set_title(f"{title}: accuracy - clean (points)", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["AGGREGATORS", "ATTACKS", "BUCKET", "FAIL_POINTS", "FRACTIONS", "MATRIX", "METHODS", "NOISE",
           "aggregator_overrides", "attack_label", "clean_label", "failures", "matrix", "matrix_markdown",
           "plot_matrices", "run", "write_report"]
