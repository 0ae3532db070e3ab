"""FedEM (Marfoq et al., NeurIPS 2021): ``fedmtl main`` (``make run``), ``fedmtl reproduce fedem-synthetic`` and
``fedmtl reproduce fmnist``.  The paper's numbers, the row order and the main job's methods and seeds are data:
``fedem.toml`` beside this module.

``fedem-synthetic`` (Table 1 "Synthetic" row): every config of ``configs/synthetic/`` on the legacy generator (the
data the paper measured), then on the corrected generator, with the reference experiments' settings (200 rounds,
batch 128, one local epoch, SGD momentum 0.9, weight decay 5e-4, lr 0.1 x0.1 at rounds 100 and 150, full
participation, M = 3).  Table 1 trains on all 300 clients; a second pass holds the last 20% of clients out of
training (unseen clients, as the paper's generalization experiment) to report unseen-client accuracy.
Writes ``DIR/table.md``, ``DIR/results.json``, ``DIR/summary.json`` ({variant: {method: {"avg",
"bottom_decile", "unseen_avg"}}}) and ``DIR/curves.png`` (test accuracy over rounds).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..config import ConfigError, load
from ..engine.evaluation import (
    PARTICIPATION_GAP,
    SEEN_TEST_ACC,
    SEEN_TEST_ACC_BOTTOM10_MEAN,
    SEEN_TEST_ACC_MEAN,
    SEEN_TEST_ACC_P10,
    UNSEEN_TEST_ACC_MEAN,
)
from ..resources import configs_root
from ..runs.driver import build_data
from ..runs.progress import Progress
from ..runs.report import markdown_table, plot_bands, plot_curves, write_json, write_table
from .common import read_tables, record_figure, run_method_seeds, run_one, show

_TABLES = read_tables("fedem.toml")
#: Marfoq et al. (NeurIPS 2021), Table 1, Synthetic: average / bottom decile test accuracy (%) (``fedem.toml``)
PAPER_SYNTHETIC: dict[str, tuple[float, float]] = {k: (v[0], v[1]) for k, v in _TABLES["paper_synthetic"].items()}
#: the order of the table's rows (configs not listed come after, by name)
ORDER: list[str] = list(_TABLES["order"])
#: the main job: the paper's methods, then the methods added since the paper that run on its linear model
MAIN_METHODS: tuple[str, ...] = tuple(_TABLES["main"]["methods"])
MAIN_EXTRA: tuple[str, ...] = tuple(_TABLES["main"]["extra"])
MAIN_SEEDS: list[int] = list(_TABLES["main"]["seeds"])
#: the rounds of ``fedmtl main --quick`` (the full job: 200)
MAIN_QUICK_ROUNDS = 10


def _configs(config_dir: Path) -> list[Path]:
    files = sorted(config_dir.glob("*.toml"))
    if not files:
        raise ConfigError(f"{config_dir}: no *.toml configs found")
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))


def run_suite(out: Path, config_dir: Path, variant: str, overrides: list[str], unseen_frac: float,
              seeds: list[int] | None = None, methods: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run every config of ``config_dir`` (or those named in ``methods``) on one data setting, each with one seed
    or with ``seeds`` (then ``final`` holds the seeds' means and ``final_std`` their std); {method: summary}."""
    results: dict[str, Any] = {}
    data = None
    data_key = None
    for path in _configs(config_dir):
        if methods is not None and path.stem not in methods:
            continue
        extra = [f"data.unseen_frac={unseen_frac}"] if unseen_frac else []
        cfg = load(path, overrides + extra)
        key = repr(sorted(cfg.data.items()))
        if key != data_key:
            data, data_key = None, key
            data = build_data(cfg, Progress())
        tag = variant + ("-unseen" if unseen_frac else "")
        t0 = time.perf_counter()
        run_dir = out / "runs" / tag / path.stem
        summary = run_method_seeds(cfg, run_dir, data, seeds) if seeds else run_one(cfg, run_dir, data)
        summary["wall_seconds"] = time.perf_counter() - t0
        results[path.stem] = summary  # the config's name: pfedme and pfedme_reference run one algorithm
        f = summary["final"]
        extra_txt = f"  unseen {100 * f[UNSEEN_TEST_ACC_MEAN]:5.1f}" if UNSEEN_TEST_ACC_MEAN in f else ""
        print(f"[{tag}] {path.stem:9s} avg {100 * f[SEEN_TEST_ACC_MEAN]:5.1f}  "
              f"p10 {100 * f[SEEN_TEST_ACC_P10]:5.1f}  worst10 {100 * f[SEEN_TEST_ACC_BOTTOM10_MEAN]:5.1f}"
              f"{extra_txt}{f'  (mean of {len(seeds)} seeds)' if seeds else ''}  ({summary['wall_seconds']:.0f} s)",
              flush=True)
    if results and data is not None:
        record_figure(out, f"{data.name} ({tag})", results)
    return results


def fedem_synthetic(out: Path, quick: bool = False, config_dir: Path | None = None,
                    unseen: bool = True) -> dict[str, Any]:
    config_dir = config_dir or configs_root() / "synthetic"
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["run.rounds=20", "run.eval_every=5", "run.checkpoint_every=10"] if quick else ["run.eval_every=10"]
    t_start = time.perf_counter()
    summary: dict[str, dict[str, Any]] = {}
    full: dict[str, Any] = {}
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for variant, legacy in (("legacy", True), ("correct", False)):
        ov = [*overrides, f"data.legacy={'true' if legacy else 'false'}"]
        table1 = run_suite(out, config_dir, variant, ov, 0.0)
        unseen_runs = run_suite(out, config_dir, variant, ov, 0.2) if unseen else {}
        summary[variant] = {}
        for name, s in table1.items():
            f = s["final"]
            u = unseen_runs.get(name, {}).get("final", {})
            summary[variant][name] = {
                "avg": 100 * f[SEEN_TEST_ACC_MEAN],
                "bottom_decile": 100 * f[SEEN_TEST_ACC_P10],
                "unseen_avg": 100 * u[UNSEEN_TEST_ACC_MEAN] if UNSEEN_TEST_ACC_MEAN in u else None,
            }
            full.setdefault(variant, {})[name] = {
                **summary[variant][name],
                "bottom10_mean": 100 * f[SEEN_TEST_ACC_BOTTOM10_MEAN],
                "seen_avg_unseen_run": 100 * u[SEEN_TEST_ACC_MEAN] if SEEN_TEST_ACC_MEAN in u else None,
                "participation_gap": 100 * u[PARTICIPATION_GAP] if PARTICIPATION_GAP in u else None,
                "seconds_per_round": s["seconds_per_round"],
                "rounds": s["rounds"],
                "paper": PAPER_SYNTHETIC.get(name),
            }
            hist = [r for r in s["history"] if SEEN_TEST_ACC_MEAN in r]
            if name in ("fedem", "fedavg", "local") or variant == "legacy":
                curves[f"{name} ({variant})"] = (
                    [r["round"] for r in hist], [100 * r[SEEN_TEST_ACC_MEAN] for r in hist]
                )
    md = [f"# FedEM synthetic data: test accuracy (%) across clients, final round "
          f"({'quick: 20 rounds' if quick else '200 rounds'})\n",
          "`avg` = mean over clients; `p10` = 10th percentile over clients (our bottom decile); `worst10` = "
          "mean of the worst 10% of clients; `unseen` = mean accuracy of the 20% of clients held out of "
          "training (second run). Paper = Marfoq et al. 2021, Table 1, Synthetic (measured on the legacy data).\n"]
    for variant, rows in full.items():
        md.append(f"\n## {variant} generator\n")
        body = [[n, r["avg"], r["bottom_decile"], r["bottom10_mean"], r["unseen_avg"],
                 (r["paper"] or (None, None))[0], (r["paper"] or (None, None))[1],
                 f"{1000 * r['seconds_per_round']:.0f} ms" if r["seconds_per_round"] else "–"]
                for n, r in rows.items()]
        md.append(markdown_table(["method", "avg", "p10", "worst10", "unseen", "paper avg", "paper bottom",
                                  "time/round"], body))
    text = "\n".join(md)
    write_table(out / "table.md", text)
    write_json(out / "summary.json", summary)
    write_json(out / "results.json", {"results": full, "paper": PAPER_SYNTHETIC,
                                      "total_seconds": time.perf_counter() - t_start, "quick": quick})
    plot_curves(out / "curves.png", curves, "test accuracy (%), mean over clients", "FedEM synthetic data")
    show(text)
    print(f"written: {out}/table.md, summary.json, results.json, curves.png ({time.perf_counter() - t_start:.0f} s)")
    return summary


def fmnist_table(out: Path, quick: bool = False, config_dir: Path | None = None) -> dict[str, Any] | None:
    """Local / FedAvg / FedAvg+ / FedEM on Fashion-MNIST (FedEM-style label-group split) when the data is
    installed; writes ``OUT/fmnist.md`` and ``OUT/fmnist.json``.  Returns None without the data."""
    config_dir = config_dir or configs_root() / "fmnist"
    from ..data.federated import DataError

    overrides = ["run.rounds=5", "run.eval_every=5"] if quick else []
    try:
        cfg0 = load(_configs(config_dir)[0], [*overrides, "data.download=false"])
        cfg0.build_data()
    except DataError as e:
        print(f"Fashion-MNIST table skipped: {e}")
        return None
    t0 = time.perf_counter()
    res = run_suite(out, config_dir, "fmnist", [*overrides, "data.download=false"], 0.0)
    rows = {n: {"avg": 100 * s["final"][SEEN_TEST_ACC_MEAN], "bottom_decile": 100 * s["final"][SEEN_TEST_ACC_P10],
                "weighted": 100 * s["final"][SEEN_TEST_ACC], "seconds_per_round": s["seconds_per_round"],
                "rounds": s["rounds"]} for n, s in res.items()}
    md = ("# Fashion-MNIST, 100 clients, 3 label groups spread by Dirichlet(0.4), MLP 784-200-10: test accuracy (%)\n\n"
          + markdown_table(["method", "avg", "p10", "weighted", "rounds", "time/round"],
                           [[n, r["avg"], r["bottom_decile"], r["weighted"], r["rounds"],
                             f"{1000 * r['seconds_per_round']:.0f} ms"] for n, r in rows.items()]))
    write_table(out / "fmnist.md", md)
    write_json(out / "fmnist.json", {"results": rows, "seconds": time.perf_counter() - t0})
    show(md)
    return rows


def main_job(out: Path, quick: bool = False) -> dict[str, Any]:
    """``make run``: FedEM's Table 1, Synthetic row (the paper's seven methods on the legacy data it measured),
    each method run with 3 seeds as one batched computation, reported as mean ± std over the seeds beside the
    paper's numbers.  ``fedmtl reproduce fedem-synthetic`` adds the corrected generator, unseen clients and the
    other methods; ``fedmtl reproduce fmnist`` the Fashion-MNIST table."""
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    # --quick: a smoke run of every method, 10 rounds (the schedule's two decays included) and two seeds (a spread
    # all the same)
    ov = ([f"run.rounds={MAIN_QUICK_ROUNDS}", "run.eval_every=5", "run.checkpoint_every=5"] if quick
          else ["run.eval_every=20"])
    seeds = MAIN_SEEDS[:2] if quick else MAIN_SEEDS
    res = run_suite(out, configs_root() / "synthetic", "legacy", [*ov, "data.legacy=true"], 0.0, seeds,
                    MAIN_METHODS + MAIN_EXTRA)
    summary: dict[str, Any] = {}
    body = []
    bands = {}
    for name, s in res.items():
        f, sd = s["final"], s["final_std"]
        row = {k: {"mean": 100 * f[key], "std": 100 * sd[key]} for k, key in
               (("avg", SEEN_TEST_ACC_MEAN), ("bottom_decile", SEEN_TEST_ACC_P10),
                ("bottom10_mean", SEEN_TEST_ACC_BOTTOM10_MEAN))}
        summary[name] = {**row, "paper": PAPER_SYNTHETIC.get(name), "seeds": seeds,
                         "avg_per_seed": [100 * v for v in s["final_values"][SEEN_TEST_ACC_MEAN]],
                         "seconds_per_round": s["seconds_per_round"]}
        paper = PAPER_SYNTHETIC.get(name, (None, None))
        body.append([name, *(f"{row[k]['mean']:.1f} ± {row[k]['std']:.1f}" for k in row), paper[0], paper[1]])
        hist = [h for h in s["history"] if SEEN_TEST_ACC_MEAN in h]
        if name in ("fedem", "fedavg", "local"):
            bands[name] = ([h["round"] for h in hist], [100 * h[SEEN_TEST_ACC_MEAN] for h in hist],
                           [100 * (h.get("seen_test_acc_mean_std") or 0.0) for h in hist])
    rounds = MAIN_QUICK_ROUNDS if quick else 200
    text = (f"# FedEM synthetic data (legacy generator), Table 1: final test accuracy (%), {rounds} rounds, "
            f"mean ± std over seeds {seeds}\n\n"
            "`avg` = mean over clients; `p10` = 10th percentile over clients (our bottom decile); `worst10` = mean "
            "of the worst 10% of clients. Paper = Marfoq et al. 2021, Table 1, Synthetic. The paper's pFedMe column is "
            "its reference code's PersonalizedAggregator (clients keep their own models, trained with a prox term "
            "towards the average): `pfedme_reference` reproduces it; `pfedme` is Dinh et al.'s method, which the "
            "paper did not run. The rows after `fedem` (FedDyn, IFCA with k = 3, SCAFFOLD) are methods the paper did "
            "not compare, run with the same settings (SCAFFOLD and FedDyn with plain local SGD, as their papers; IFCA "
            "averaging its clusters' models by client, as its paper). FedAvg+ fine-tunes at optim.lr, the schedule's "
            "initial rate.\n\n"
            + markdown_table(["method", "avg", "p10", "worst10", "paper avg", "paper bottom decile"], body))
    write_table(out / "table.md", text)
    write_json(out / "summary.json", summary)
    write_json(out / "results.json", {"results": res, "paper": PAPER_SYNTHETIC, "seeds": seeds,
                                      "total_seconds": time.perf_counter() - t_start, "quick": quick})
    plot_bands(out / "curves.png", bands, "test accuracy (%), mean over clients",
               f"FedEM synthetic data: mean over seeds {seeds}, band = +-1 std")
    show(text)
    print(f"written: {out}/table.md, summary.json, results.json, curves.png ({time.perf_counter() - t_start:.0f} s)")
    return summary


def fmnist(out: Path, quick: bool = False) -> dict[str, Any] | None:
    """Local / FedAvg / FedAvg+ / FedEM on Fashion-MNIST (``fmnist_table``)."""
    out.mkdir(parents=True, exist_ok=True)
    return fmnist_table(out, quick)


__all__ = ["MAIN_EXTRA", "MAIN_METHODS", "MAIN_QUICK_ROUNDS", "MAIN_SEEDS", "ORDER", "PAPER_SYNTHETIC",
           "fedem_synthetic", "fmnist", "fmnist_table", "main_job", "run_suite"]
