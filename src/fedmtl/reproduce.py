"""Paper reproductions: ``fedmtl reproduce NAME [--quick] --out DIR``; the main job is one of them.

``fedem-synthetic`` (Marfoq et al., NeurIPS 2021, Table 1 "Synthetic" row): every config of
``configs/synthetic/`` on the legacy generator (the data the paper measured), then on the corrected
generator, with the reference experiments' settings (200 rounds, batch 128, one local epoch, SGD
momentum 0.9, weight decay 5e-4, lr 0.1 x0.1 at rounds 100 and 150, full participation, M = 3).
Table 1 trains on all 300 clients; a second pass holds the last 20% of clients out of training
(unseen clients, as the paper's generalization experiment) to report unseen-client accuracy.
Writes ``DIR/table.md``, ``DIR/results.json``, ``DIR/summary.json`` ({variant: {method: {"avg",
"bottom_decile", "unseen_avg"}}}) and ``DIR/curves.png`` (test accuracy over rounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ConfigError, load
from .engine.checkpoint import CheckpointError
from .engine.driver import build_data, run_experiment
from .engine.round import TrainingDiverged
from .engine.rundir import RunDirError
from .progress import Progress
from .report import markdown_table, plot_bands, plot_curves, write_json, write_table
from .resources import config_path, configs_root

#: Marfoq et al. (NeurIPS 2021), Table 1, Synthetic: average / bottom decile test accuracy (%).  Its pFedMe column
#: comes from the reference code's PersonalizedAggregator (``configs/synthetic/pfedme_reference.toml``), not from
#: Dinh et al.'s pFedMe (``pfedme.toml``), which the paper did not run.
PAPER_SYNTHETIC: dict[str, tuple[float, float]] = {
    "local": (65.7, 58.4),
    "fedavg": (68.2, 58.9),
    "fedprox": (68.2, 59.0),
    "fedavg+": (68.9, 60.2),
    "clustered": (69.1, 59.0),
    "pfedme_reference": (69.2, 61.2),
    "fedem": (74.7, 66.7),
}
ORDER = ["local", "fedavg", "fedprox", "fedavg+", "clustered", "pfedme", "pfedme_reference", "fedem", "dfedem"]


def _configs(config_dir: Path) -> list[Path]:
    files = sorted(config_dir.glob("*.toml"))
    if not files:
        raise ConfigError(f"{config_dir}: no *.toml configs found")
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))


def _run(cfg: Any, run_dir: Path, data: Any) -> dict[str, Any]:
    """One run (continued if its directory holds a checkpoint of the same config): its summary, history and
    per-client metrics."""
    has_ckpt = (run_dir / "checkpoint.pt").exists()
    try:
        res = run_experiment(cfg, run_dir, resume=has_ckpt, overwrite=not has_ckpt, data=data)
    except (ConfigError, CheckpointError, RunDirError):  # an older run with another config or format: start over
        res = run_experiment(cfg, run_dir, overwrite=True, data=data)
    return {**res.summary, "history": res.history, "per_client": res.per_client}


def _run_seeds(cfg: Any, run_dir: Path, data: Any, seeds: list[int]) -> dict[str, Any]:
    """One config with several seeds (batched; seeds with a checkpoint continue): the seeds' mean as ``final``,
    their std as ``final_std``, the per-round means as ``history`` (with ``*_std``)."""
    from .engine.seeds import history_stats, run_seeds

    try:  # the seeds with a checkpoint continue, the others start
        res = run_seeds(cfg, seeds, run_dir, resume=True, data=data)
    except (ConfigError, CheckpointError, RunDirError):  # an older run with another config or format: start over
        res = run_seeds(cfg, seeds, run_dir, overwrite=True, data=data)
    hist = []
    for h in history_stats([r.history for r in res.runs]):
        row = {"round": h["round"]}
        row.update({k[:-5]: v for k, v in h.items() if k.endswith("_mean") and v is not None})
        row.update({k: v for k, v in h.items() if k.endswith("_std")})
        hist.append(row)
    return {**res.summary, "final": {k: st["mean"] for k, st in res.final.items()},
            "final_std": {k: st["std"] for k, st in res.final.items()},
            "final_values": {k: st["values"] for k, st in res.final.items()}, "history": hist}


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
        summary = _run_seeds(cfg, run_dir, data, seeds) if seeds else _run(cfg, run_dir, data)
        summary["wall_seconds"] = time.perf_counter() - t0
        results[path.stem] = summary  # the config's name: pfedme and pfedme_reference run one algorithm
        f = summary["final"]
        extra_txt = f"  unseen {100 * f['unseen_test_acc_mean']:5.1f}" if "unseen_test_acc_mean" in f else ""
        print(f"[{tag}] {path.stem:9s} avg {100 * f['seen_test_acc_mean']:5.1f}  "
              f"p10 {100 * f['seen_test_acc_p10']:5.1f}  worst10 {100 * f['seen_test_acc_bottom10_mean']:5.1f}"
              f"{extra_txt}{f'  (mean of {len(seeds)} seeds)' if seeds else ''}  ({summary['wall_seconds']:.0f} s)",
              flush=True)
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
                "avg": 100 * f["seen_test_acc_mean"],
                "bottom_decile": 100 * f["seen_test_acc_p10"],
                "unseen_avg": 100 * u["unseen_test_acc_mean"] if "unseen_test_acc_mean" in u else None,
            }
            full.setdefault(variant, {})[name] = {
                **summary[variant][name],
                "bottom10_mean": 100 * f["seen_test_acc_bottom10_mean"],
                "seen_avg_unseen_run": 100 * u["seen_test_acc_mean"] if "seen_test_acc_mean" in u else None,
                "participation_gap": 100 * u["participation_gap"] if "participation_gap" in u else None,
                "seconds_per_round": s["seconds_per_round"],
                "rounds": s["rounds"],
                "paper": PAPER_SYNTHETIC.get(name),
            }
            hist = [r for r in s["history"] if "seen_test_acc_mean" in r]
            if name in ("fedem", "fedavg", "local") or variant == "legacy":
                curves[f"{name} ({variant})"] = (
                    [r["round"] for r in hist], [100 * r["seen_test_acc_mean"] for r in hist]
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
    print()
    print(text)
    print(f"written: {out}/table.md, summary.json, results.json, curves.png ({time.perf_counter() - t_start:.0f} s)")
    return summary


def fmnist_table(out: Path, quick: bool = False, config_dir: Path | None = None) -> dict[str, Any] | None:
    """Local / FedAvg / FedAvg+ / FedEM on Fashion-MNIST (FedEM-style label-group split) when the data is
    installed; writes ``OUT/fmnist.md`` and ``OUT/fmnist.json``.  Returns None without the data."""
    config_dir = config_dir or configs_root() / "fmnist"
    from .data.federated import DataError

    overrides = ["run.rounds=5", "run.eval_every=5"] if quick else []
    try:
        cfg0 = load(_configs(config_dir)[0], [*overrides, "data.download=false"])
        cfg0.build_data()
    except DataError as e:
        print(f"Fashion-MNIST table skipped: {e}")
        return None
    t0 = time.perf_counter()
    res = run_suite(out, config_dir, "fmnist", [*overrides, "data.download=false"], 0.0)
    rows = {n: {"avg": 100 * s["final"]["seen_test_acc_mean"], "bottom_decile": 100 * s["final"]["seen_test_acc_p10"],
                "weighted": 100 * s["final"]["seen_test_acc"], "seconds_per_round": s["seconds_per_round"],
                "rounds": s["rounds"]} for n, s in res.items()}
    md = ("# Fashion-MNIST, 100 clients, 3 label groups spread by Dirichlet(0.4), MLP 784-200-10: test accuracy (%)\n\n"
          + markdown_table(["method", "avg", "p10", "weighted", "rounds", "time/round"],
                           [[n, r["avg"], r["bottom_decile"], r["weighted"], r["rounds"],
                             f"{1000 * r['seconds_per_round']:.0f} ms"] for n, r in rows.items()]))
    write_table(out / "fmnist.md", md)
    write_json(out / "fmnist.json", {"results": rows, "seconds": time.perf_counter() - t0})
    print(md)
    return rows


MAIN_METHODS = ("local", "fedavg", "fedprox", "fedavg+", "clustered", "pfedme", "pfedme_reference", "fedem")
#: the methods added since the paper that run on its linear model (the body/head methods need a model with a body:
#: ``reproduce personalization`` and ``fmnist-cnn``), below the paper's rows
MAIN_EXTRA = ("feddyn", "ifca", "scaffold")
MAIN_SEEDS = [1, 2, 3]


def main_job(out: Path, quick: bool = False) -> dict[str, Any]:
    """``make run``: FedEM's Table 1, Synthetic row (the paper's seven methods on the legacy data it measured),
    each method run with 3 seeds as one batched computation, reported as mean ± std over the seeds beside the
    paper's numbers.  ``fedmtl reproduce fedem-synthetic`` adds the corrected generator, unseen clients and the
    other methods; ``fedmtl reproduce fmnist`` the Fashion-MNIST table."""
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    ov = (["run.rounds=20", "run.eval_every=5", "run.checkpoint_every=10"] if quick else ["run.eval_every=20"])
    res = run_suite(out, configs_root() / "synthetic", "legacy", [*ov, "data.legacy=true"], 0.0, MAIN_SEEDS,
                    MAIN_METHODS + MAIN_EXTRA)
    summary: dict[str, Any] = {}
    body = []
    bands = {}
    for name, s in res.items():
        f, sd = s["final"], s["final_std"]
        row = {k: {"mean": 100 * f[key], "std": 100 * sd[key]} for k, key in
               (("avg", "seen_test_acc_mean"), ("bottom_decile", "seen_test_acc_p10"),
                ("bottom10_mean", "seen_test_acc_bottom10_mean"))}
        summary[name] = {**row, "paper": PAPER_SYNTHETIC.get(name), "seeds": MAIN_SEEDS,
                         "avg_per_seed": [100 * v for v in s["final_values"]["seen_test_acc_mean"]],
                         "seconds_per_round": s["seconds_per_round"]}
        paper = PAPER_SYNTHETIC.get(name, (None, None))
        body.append([name, *(f"{row[k]['mean']:.1f} ± {row[k]['std']:.1f}" for k in row), paper[0], paper[1]])
        hist = [h for h in s["history"] if "seen_test_acc_mean" in h]
        if name in ("fedem", "fedavg", "local"):
            bands[name] = ([h["round"] for h in hist], [100 * h["seen_test_acc_mean"] for h in hist],
                           [100 * (h.get("seen_test_acc_mean_std") or 0.0) for h in hist])
    rounds = 20 if quick else 200
    text = (f"# FedEM synthetic data (legacy generator), Table 1: final test accuracy (%), {rounds} rounds, "
            f"mean ± std over seeds {MAIN_SEEDS}\n\n"
            "`avg` = mean over clients; `p10` = 10th percentile over clients (our bottom decile); `worst10` = mean "
            "of the worst 10% of clients. Paper = Marfoq et al. 2021, Table 1, Synthetic. The paper's pFedMe column is "
            "its reference code's PersonalizedAggregator (clients keep their own models, trained with a prox term "
            "towards the average): `pfedme_reference` reproduces it; `pfedme` is Dinh et al.'s method, which the "
            "paper did not run. The rows after `fedem` (FedDyn, IFCA with k = 3, SCAFFOLD) are methods the paper did "
            "not compare, run with the same settings (SCAFFOLD without momentum).\n\n"
            + markdown_table(["method", "avg", "p10", "worst10", "paper avg", "paper bottom decile"], body))
    write_table(out / "table.md", text)
    write_json(out / "summary.json", summary)
    write_json(out / "results.json", {"results": res, "paper": PAPER_SYNTHETIC, "seeds": MAIN_SEEDS,
                                      "total_seconds": time.perf_counter() - t_start, "quick": quick})
    plot_bands(out / "curves.png", bands, "test accuracy (%), mean over clients",
               f"FedEM synthetic data: mean over seeds {MAIN_SEEDS}, band = +-1 std")
    print()
    print(text)
    print(f"written: {out}/table.md, summary.json, results.json, curves.png ({time.perf_counter() - t_start:.0f} s)")
    return summary


def fmnist(out: Path, quick: bool = False) -> dict[str, Any] | None:
    """Local / FedAvg / FedAvg+ / FedEM on Fashion-MNIST (``fmnist_table``)."""
    out.mkdir(parents=True, exist_ok=True)
    return fmnist_table(out, quick)


def run_methods(out: Path, base: Path, methods: dict[str, list[str]], overrides: list[str],
                allow_diverged: bool = False, seeds: list[int] | None = None) -> dict[str, Any]:
    """Run one base config with per-method overrides (label -> ``--set`` list); {label: summary}.
    ``seeds``: each method with these seeds as one batched run (``final`` the seeds' mean, ``final_std`` their std).
    ``allow_diverged``: a run whose training diverges (``TrainingDiverged``: every update NaN/Inf for 3 rounds,
    e.g. under an attack no aggregator stops) is a result, ``{"diverged": True}`` with NaN accuracies."""
    results: dict[str, Any] = {}
    data, data_key = None, None
    for label, sets in methods.items():
        cfg = load(base, [*sets, *overrides])
        key = repr(sorted(cfg.data.items()))
        if key != data_key:
            data, data_key = build_data(cfg, Progress()), key
        t0 = time.perf_counter()
        try:
            results[label] = (_run_seeds(cfg, out / "runs" / label, data, seeds) if seeds
                              else _run(cfg, out / "runs" / label, data))
        except TrainingDiverged as e:
            if not allow_diverged:
                raise
            nan = float("nan")
            results[label] = {"diverged": True, "reason": str(e), "history": [],
                              "final": {"seen_test_acc_mean": nan, "seen_test_acc_p10": nan}}
            print(f"{label:14s} diverged ({time.perf_counter() - t0:.0f} s)", flush=True)
            continue
        f = results[label]["final"]
        sd = results[label].get("final_std", {}).get("seen_test_acc_mean")
        spread = f" ± {100 * sd:4.1f}" if sd is not None else ""
        print(f"{label:14s} avg {100 * f['seen_test_acc_mean']:5.1f}{spread}  p10 {100 * f['seen_test_acc_p10']:5.1f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


#: every personalized method on label-permuted client groups (hyper-parameters for this data).  Methods that split
#: the model into a body and a head need a model with a body: they (and a FedAvg and a Local row for comparison) run
#: an MLP with one hidden layer of 32 units; the others the linear model of the config.
_MLP = ["model.name=mlp", "model.hidden=[32]"]
_MLP_BN = [*_MLP, "model.batch_norm=true"]
PERSONALIZATION_METHODS: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg"],
    "local": ["algorithm.name=local"],
    "fedavg+": ["algorithm.name=fedavg+", "algorithm.finetune_lr=0.05", "algorithm.finetune_epochs=2"],
    "fedem": ["algorithm.name=fedem", "algorithm.num_components=4"],
    "clustered": ["algorithm.name=clustered", "algorithm.eps1=0.4", "algorithm.eps2=0.8", "algorithm.warmup_rounds=10"],
    "pfedme": ["algorithm.name=pfedme", "algorithm.lam=0.1", "algorithm.personal_lr=0.1"],
    "perfedavg": ["algorithm.name=perfedavg", "algorithm.alpha=0.1", "algorithm.beta=0.05", "algorithm.variant=hf",
                  "algorithm.eval_steps=20"],
    "ditto": ["algorithm.name=ditto", "algorithm.lam=0.1"],
    "apfl": ["algorithm.name=apfl"],
    "scaffold": ["algorithm.name=scaffold", "optim.momentum=0.0"],  # option II assumes plain local SGD
    "feddyn": ["algorithm.name=feddyn"],
    "ifca": ["algorithm.name=ifca", "algorithm.num_clusters=4", *_MLP],  # linear: the initial models tie (tests)
    "fedavg (mlp)": ["algorithm.name=fedavg", *_MLP],
    "local (mlp)": ["algorithm.name=local", *_MLP],
    "fedper": ["algorithm.name=fedper", *_MLP],
    "fedrep": ["algorithm.name=fedrep", "algorithm.head_epochs=2", *_MLP],
    "lgfedavg": ["algorithm.name=lgfedavg", *_MLP],
    "fedbabu": ["algorithm.name=fedbabu", "algorithm.finetune_lr=0.05", *_MLP],
    "fedrod": ["algorithm.name=fedrod", *_MLP],
    "fedala": ["algorithm.name=fedala", *_MLP],
    "pfedhn": ["algorithm.name=pfedhn", *_MLP],
    "knnper": ["algorithm.name=knnper", "algorithm.interpolation=0.5", *_MLP],
    "moon": ["algorithm.name=moon", *_MLP],
    # one gradient query per round: 4x the rounds, a larger step
    "omnifedge": ["algorithm.name=omnifedge", "algorithm.lam=0.5", "run.rounds=400", "optim.lr=0.3", *_MLP],
    # FedBN keeps batch-norm layers local: it and its FedAvg baseline run the MLP + BatchNorm
    "fedavg (mlp-bn)": ["algorithm.name=fedavg", *_MLP_BN],
    "fedbn": ["algorithm.name=fedbn", *_MLP_BN],
}
PERSONALIZATION_SEEDS = [1, 2, 3]


def _personalization_model(overrides: list[str]) -> str:
    """The model column of the personalization table for one method's overrides."""
    if "model.batch_norm=true" in overrides:
        return "mlp-bn"
    return "mlp" if "model.name=mlp" in overrides else "linear"


def personalization(out: Path, quick: bool = False) -> dict[str, Any]:
    """Every method against FedAvg on data that needs personalization (4 client groups with permuted labels), each
    with 3 seeds; writes ``DIR/personalization.md``, ``.json`` and ``summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    ov = ["run.rounds=10", "run.eval_every=5"] if quick else []
    res = run_methods(out, config_path("personalization/permuted"), PERSONALIZATION_METHODS, ov,
                      seeds=PERSONALIZATION_SEEDS)
    baseline = {"linear": "fedavg", "mlp": "fedavg (mlp)", "mlp-bn": "fedavg (mlp-bn)"}
    fedavg = {m: 100 * res[n]["final"]["seen_test_acc_mean"] for m, n in baseline.items() if n in res}
    rows = {}
    for n, s in res.items():
        model = _personalization_model(PERSONALIZATION_METHODS[n])
        avg = 100 * s["final"]["seen_test_acc_mean"]
        rows[n] = {"model": model, "avg": avg, "avg_std": 100 * s["final_std"]["seen_test_acc_mean"],
                   "bottom_decile": 100 * s["final"]["seen_test_acc_p10"],
                   "bottom_decile_std": 100 * s["final_std"]["seen_test_acc_p10"],
                   "vs_fedavg_same_model": avg - fedavg[model], "seeds": PERSONALIZATION_SEEDS}
    title = "Label-permuted client groups (40 clients, 4 groups, 10 classes)"
    md = (f"# {title}: test accuracy (%), final round, mean ± std over seeds {PERSONALIZATION_SEEDS}"
          "\n\n"
          + markdown_table(["method", "model", "avg", "p10", "minus FedAvg (same model)"],
                           [[n, r["model"], f"{r['avg']:.1f} ± {r['avg_std']:.1f}",
                             f"{r['bottom_decile']:.1f} ± {r['bottom_decile_std']:.1f}",
                             f"{r['vs_fedavg_same_model']:+.1f}"] for n, r in rows.items()]))
    write_table(out / "personalization.md", md)
    write_json(out / "summary.json", rows)
    print(md)
    return rows


#: the body/head methods against Local and FedAvg on Fashion-MNIST's label-skewed split with FedEM's FEMNIST CNN
#: (``configs/fmnist_cnn/fedavg.toml``); FedBN and its FedAvg baseline with the batch-norm variant ``cnn_bn``.
#: FedRep trains its head for 2 epochs per round (the paper's 10 would make its rounds ~4x FedAvg's on this CPU).
#: 15% of the 70,000 images (``data.fraction = 0.15``, ~84 training images per client) keeps a CNN round under 20 s on
#: one CPU thread; few samples per client is the regime the body/head papers target.
_BN = ["model.name=cnn_bn"]
FMNIST_CNN_METHODS: dict[str, list[str]] = {
    "local": ["algorithm.name=local"],
    "fedavg": ["algorithm.name=fedavg"],
    "fedper": ["algorithm.name=fedper"],
    "fedrep": ["algorithm.name=fedrep", "algorithm.head_epochs=2"],
    "fedrod": ["algorithm.name=fedrod"],
    "fedbabu": ["algorithm.name=fedbabu", "algorithm.finetune_epochs=2"],
    "knnper": ["algorithm.name=knnper", "algorithm.interpolation=0.5"],
    "fedavg (cnn_bn)": ["algorithm.name=fedavg", *_BN],
    "fedbn": ["algorithm.name=fedbn", *_BN],
}
FMNIST_CNN_ROUNDS = 25
FMNIST_CNN_FRACTION = 0.15


def fmnist_cnn(out: Path, quick: bool = False) -> dict[str, Any] | None:
    """Body/head methods (FedPer, FedRep, FedRoD, FedBABU, kNN-Per) and FedBN against Local and FedAvg on Fashion-MNIST
    (100 clients, 3 label groups by Dirichlet(0.4)) with the FEMNIST CNN, one seed (a CNN round takes seconds on a
    CPU); writes ``DIR/fmnist_cnn.md`` and ``summary.json``.  Returns None without the data."""
    from .data.federated import DataError

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
    local = 100 * res["local"]["final"]["seen_test_acc_mean"]
    rows = {}
    for n, s in res.items():
        model = "cnn_bn" if "model.name=cnn_bn" in FMNIST_CNN_METHODS[n] else "cnn_femnist"
        avg = 100 * s["final"]["seen_test_acc_mean"]
        rows[n] = {"model": model, "avg": avg, "bottom_decile": 100 * s["final"]["seen_test_acc_p10"],
                   "minus_local": avg - local, "rounds": s["rounds"], "seconds_per_round": s["seconds_per_round"]}
    frac, clients = (0.02, 10) if quick else (FMNIST_CNN_FRACTION, 100)
    title = (f"Fashion-MNIST ({100 * frac:.0f}% of the images), {clients} clients, 3 label groups by "
             "Dirichlet(0.4), FEMNIST CNN")
    md = (f"# {title}: test accuracy (%) after the last round, seed 1234\n\n"
          + markdown_table(["method", "model", "avg", "p10", "minus Local", "rounds", "time/round"],
                           [[n, r["model"], r["avg"], r["bottom_decile"], f"{r['minus_local']:+.1f}", r["rounds"],
                             f"{r['seconds_per_round']:.1f} s"] for n, r in rows.items()]))
    write_table(out / "fmnist_cnn.md", md)
    write_json(out / "summary.json", {"results": rows, "quick": quick, "methods": FMNIST_CNN_METHODS})
    print(md)
    return rows


def omnifedge_fmnist(out: Path, quick: bool = False) -> dict[str, Any]:
    """Omni-Fedge vs FedSGD and FedAvg on 5 Fashion-MNIST nodes (non-IID class fractions): accuracy against
    communication rounds (``DIR/omnifedge.png``) and the final table (``DIR/omnifedge.md``, ``summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    ov = ["run.rounds=20", "run.eval_every=5", "data.download=false"] if quick else ["data.download=false"]
    methods = {
        "omnifedge": [],
        "fedsgd": ["algorithm.name=fedavg", "run.batch_size=100000"],  # one full-batch gradient step per round
        "fedavg": ["algorithm.name=fedavg"],
        "local": ["algorithm.name=local"],
    }
    res = run_methods(out, config_path("omnifedge/fmnist"), methods, ov)
    curves = {}
    for n, s in res.items():
        hist = [r for r in s["history"] if "seen_test_acc_mean" in r]
        curves[n] = ([r["round"] for r in hist], [100 * r["seen_test_acc_mean"] for r in hist])
    plot_curves(out / "omnifedge.png", curves, "test accuracy (%), mean over the 5 nodes",
                "Fashion-MNIST, 5 nodes, non-IID (Omni-Fedge setting)", xlabel="communication round")
    rows = {n: {"avg": 100 * s["final"]["seen_test_acc_mean"], "rounds": s["rounds"]} for n, s in res.items()}
    md = ("# Omni-Fedge setting: 5 Fashion-MNIST nodes, test accuracy (%) after the last round\n\n"
          + markdown_table(["method", "avg", "rounds"], [[n, r["avg"], r["rounds"]] for n, r in rows.items()]))
    write_table(out / "omnifedge.md", md)
    write_json(out / "summary.json", rows)
    print(md)
    return rows


def mocha(out: Path, quick: bool = False) -> dict[str, Any]:
    """MOCHA's Table 1 and Figures 1-3 analogues (``fedmtl.mtl.reproduce``)."""
    from .mtl.reproduce import run

    return run(out, quick=quick)


def networked(out: Path, quick: bool = False) -> dict[str, Any]:
    """Networked FL by GTV minimization: the seed's SBM toy experiments (``fedmtl.networked.reproduce``)."""
    from .networked.reproduce import run

    return run(out, quick=quick)


def robustness(out: Path, quick: bool = False) -> dict[str, Any]:
    """FedAvg, FedEM and Ditto under attacks with each robust aggregator, and privacy-utility curves
    (``fedmtl.robust.reproduce``)."""
    from .robust.reproduce import run

    return run(out, quick=quick)


REPRODUCTIONS: dict[str, Callable[..., Any]] = {
    "robustness": robustness,
    "mocha": mocha,
    "networked": networked,
    "fedem-synthetic": fedem_synthetic,
    "personalization": personalization,
    "omnifedge-fmnist": omnifedge_fmnist,
    "fmnist": fmnist,
    "fmnist-cnn": fmnist_cnn,
}
