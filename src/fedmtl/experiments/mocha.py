"""``fedmtl reproduce mocha``: analogues of MOCHA's Table 1 and Figures 1-3 (Smith et al., NeurIPS 2017).

(a) **Table 1** — average per-task prediction error (%) of Global (one SVM on the pooled data), Local (one
    SVM per task) and MTL (MOCHA with the learned task covariance, 10 Omega-steps x 100 rounds, local
    fraction 0.5, as the reference driver), lambda chosen per method by 5-fold cross-validation (folds
    interleaved within each task) from the reference grid, over random 75/25 per-task splits: mean and
    standard error.  Datasets: a synthetic federation of related tasks (clusters of tasks sharing a
    separator), Fashion-MNIST binary tasks (one per client, pairs of confusable classes) when the IDX files
    are present, and HAR / Vehicle Sensor / Google Glass when their files are found locally.
(b) **Figures 1-3** — primal sub-optimality versus estimated time (the reference code's time units, see
    ``fedmtl.engine.systems.TimeModel.paper``) for MOCHA, CoCoA, Mb-SDCA, Mb-SGD: statistical heterogeneity on
    WiFi / LTE / 3G, high and low systems variability, and MOCHA under increasing drop probability and
    with one node that never answers (W-step and the full method).
(c) **Tables 3-4** — highly skewed task sizes, with stragglers, drops and shared tasks (Remark 4):
    ``fedmtl.experiments.mocha_skewed`` (``fedmtl reproduce mocha`` runs (a)-(c): ``mocha_skewed.everything``;
    ``fedmtl reproduce mocha-skewed`` (c) alone).

Local SVMs use MOCHA's own solver with the identity coupling (solved to a duality gap of 1e-5); the Global
SVM on the pooled data uses liblinear's dual coordinate ascent (scikit-learn ``LinearSVC``, the same SDCA
algorithm without per-step Python overhead).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..data.federated import DataError
from ..data.synthetic import related_task_arrays as synthetic_tasks
from ..data.vision import fmnist_pair_arrays as fmnist_tasks
from ..engine.systems import SystemsConfig, TimeModel
from ..mtl.mocha import MochaConfig, solve
from ..mtl.omega import TaskCovariance, identity
from ..mtl.problem import MTLData, error_rate
from ..runs.report import save_figure, write_table

log = logging.getLogger("fedmtl")

LAMBDA_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 10.0)  # the reference driver's grid
Tasks = tuple[list[np.ndarray], list[np.ndarray]]


# ------------------------------------------------------------------------------------------- datasets
def available_datasets(quick: bool = False) -> dict[str, Callable[[], Tasks]]:
    """The Table-1 datasets that can be built here (synthetic always; others when their files exist)."""
    from ..data import tabular

    out: dict[str, Callable[[], Tasks]] = {"synthetic": synthetic_tasks}
    probes: dict[str, Callable[[], Tasks]] = {
        "fmnist_binary": fmnist_tasks,
        "har": lambda: tabular.har_tasks(download=False),
        "gleam": lambda: tabular.gleam_tasks(download=False),
    }
    for name, fn in probes.items():
        try:
            fn()
        except (DataError, OSError) as e:
            log.info("mocha table 1: %s skipped (%s)", name, str(e).splitlines()[0])
            continue
        out[name] = fn
    return out


# ------------------------------------------------------------------------------------------- fitting
def _standardize(train: Tasks, test: Tasks) -> tuple[Tasks, Tasks]:
    xs_tr, xs_te = [], []
    for a, b in zip(train[0], test[0], strict=True):
        mu, sd = a.mean(0), a.std(0)
        sd[sd == 0] = 1.0
        xs_tr.append((a - mu) / sd)
        xs_te.append((b - mu) / sd)
    return (xs_tr, train[1]), (xs_te, test[1])


def _split(tasks: Tasks, rng: np.random.Generator, frac: float = 0.75) -> tuple[Tasks, Tasks]:
    """Each task's examples at random: ceil(frac n) to train, the rest (at least one example) to test."""
    tr: Tasks = ([], [])
    te: Tasks = ([], [])
    for x, y in zip(*tasks, strict=True):
        perm = rng.permutation(len(y))
        k = min(int(np.ceil(frac * len(y))), len(y) - 1)
        tr[0].append(x[perm[:k]])
        tr[1].append(y[perm[:k]])
        te[0].append(x[perm[k:]])
        te[1].append(y[perm[k:]])
    return tr, te


def fit(method: str, train: MTLData, lam: float, seed: int = 0, rounds_scale: float = 1.0,
        systems: SystemsConfig | None = None) -> np.ndarray:
    """(m, d) models of ``method`` in {"global", "local", "mtl"} trained on ``train`` (``systems``: MTL's
    stragglers and drops)."""
    if method == "local":
        cfg = MochaConfig(lam=lam, inner=max(20, int(100 * rounds_scale)), local_frac=1.0, record_every=10,
                          tol=1e-5, seed=seed)
        return solve(train, cfg, identity(train.m)).W
    if method == "global":  # one hinge SVM on the pooled data: liblinear's dual coordinate ascent (= SDCA)
        from sklearn.svm import LinearSVC

        mask = train.mask
        x, y = train.X[mask], train.y[mask]
        if len(np.unique(y)) < 2:
            return np.zeros((train.m, train.d))
        svc = LinearSVC(C=1.0 / (lam * len(y)), loss="hinge", fit_intercept=False, tol=1e-5, max_iter=20000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.fit(x, y)
        return np.repeat(svc.coef_, train.m, axis=0)
    if method == "mtl":
        cfg = MochaConfig(lam=lam, outer=10, inner=max(1, int(100 * rounds_scale)), local_frac=0.5,
                          record_every=10**9, seed=seed)
        return solve(train, cfg, TaskCovariance(), systems).W
    raise ValueError(method)


def cv_lambda(method: str, train: MTLData, folds: int = 5, grid: tuple[float, ...] = LAMBDA_GRID,
              rounds_scale: float = 1.0) -> float:
    """Lambda with the lowest mean validation error; fold k holds examples k, k + folds, ... of each task."""
    scores = []
    for lam in grid:
        errs = []
        for k in range(folds):
            val = [np.arange(k, n, folds) for n in train.counts]
            if any(len(v) == 0 or len(v) == n for v, n in zip(val, train.counts, strict=True)):
                continue
            tr = [np.setdiff1d(np.arange(n), v) for v, n in zip(val, train.counts, strict=True)]
            W = fit(method, train.subset(tr), lam, k, rounds_scale)
            errs.append(error_rate(train.subset(val), W).mean())
        scores.append(np.mean(errs))
    return grid[int(np.argmin(scores))]


def table1_markdown(results: Path) -> str:
    """Table 1 (average per-task error (%), standard error) from a run directory's ``summary.json``, each row
    replaced by a later re-measurement where one is stored beside it (``remeasure_*.json`` holding
    ``table1_<dataset>``): the stored ``table1.md`` is regenerated from the stored measurements by this function
    (``tests/test_mocha.py`` checks that it is)."""
    detail = dict(json.loads((results / "summary.json").read_text())["table1_detail"])
    remeasured = []
    for f in sorted(results.glob("remeasure_*.json")):
        for key, row in json.loads(f.read_text()).items():
            if key.startswith("table1_") and key.removeprefix("table1_") in detail:
                detail[key.removeprefix("table1_")] = row
                remeasured.append(f"{key.removeprefix('table1_')} ({f.name})")
    lines = ["| dataset | Global | Local | MTL |", "|---|---|---|---|"]
    for name, r in detail.items():
        lines.append(f"| {name} | {r['global']:.2f} ({r['global_se']:.2f}) | {r['local']:.2f} ({r['local_se']:.2f}) "
                     f"| {r['mtl']:.2f} ({r['mtl_se']:.2f}) |")
    if remeasured:
        lines += ["", f"Re-measured rows: {', '.join(remeasured)}; the others are from summary.json."]
    return "\n".join(lines) + "\n"


def table1(tasks: Tasks, splits: int = 10, seed: int = 0, standardize: bool = False,
           rounds_scale: float = 1.0, folds: int = 5) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    errs: dict[str, list[float]] = {"global": [], "local": [], "mtl": []}
    lams: dict[str, list[float]] = {k: [] for k in errs}
    for s in range(splits):
        tr, te = _split(tasks, rng)
        if standardize:
            tr, te = _standardize(tr, te)
        train, test = MTLData.from_tasks(*tr), MTLData.from_tasks(*te)
        for method in errs:
            lam = cv_lambda(method, train, folds, rounds_scale=rounds_scale)
            W = fit(method, train, lam, s, rounds_scale)
            errs[method].append(100.0 * float(error_rate(test, W).mean()))
            lams[method].append(lam)
    out: dict[str, Any] = {}
    for k, v in errs.items():
        a = np.array(v)
        out[k] = float(a.mean())
        out[f"{k}_se"] = float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else 0.0
        out[f"{k}_lambdas"] = lams[k]
    out["splits"] = splits
    return out


# ------------------------------------------------------------------------------------------- figures
def _times(trace: list[dict[str, Any]], network: str, d: int) -> np.ndarray:
    tm = TimeModel.paper(network)
    link = tm.link
    return np.array([r["compute"] / tm.device_flops + r["round"] * 2 * link.seconds(8.0 * d) for r in trace])


def time_to(trace: list[dict[str, Any]], times: np.ndarray, key: str, target: float) -> float | None:
    for r, t in zip(trace, times, strict=True):
        if r.get(key, np.inf) <= target:
            return float(t)
    return None


# Each method's main knob, tuned over a small grid per setting (the paper tunes every method); the best
# setting (least estimated time to sub-optimality 1e-3 on LTE) is reported.  Round caps follow the reference
# driver (CoCoA 500 rounds, others until the time budget).
TUNING: dict[str, tuple[str, tuple[float, ...]]] = {
    "mocha": ("local_frac", (1.0, 4.0, 16.0)),  # local budget in multiples of n_t / n_min
    "cocoa": ("theta", (0.1, 0.5, 0.9)),
    "mbsdca": ("scaling", (1.0, 10.0, 100.0)),
    "mbsgd": ("scaling", (0.1, 1.0, 10.0)),
}


def optimization(data: MTLData, lam: float, scale: float = 1.0, seed: int = 0,
                 max_time: float = 2e6) -> dict[str, Any]:
    """The W-step experiments (Omega = m I fixed), every run limited to the same estimated time (LTE,
    reference units).  Returns the best-tuned trace of each method per setting and the drop experiment."""
    reg = identity(data.m, float(data.m))
    ref = solve(data, MochaConfig(lam=lam, inner=20000, local_frac=4.0, record_every=50, tol=1e-10), reg)
    p_star = min(r["primal"] for r in ref.trace)
    out: dict[str, Any] = {"p_star": p_star, "final_gap_of_reference": ref.trace[-1]["gap"], "settings": {},
                           "max_time": max_time * scale}

    def run(method: str, systems: SystemsConfig, **kw: Any) -> list[dict[str, Any]]:
        cfg = MochaConfig(lam=lam, method=method, inner=500 if method == "cocoa" else 10**6, record_every=1,
                          seed=seed, max_time=max_time * scale, stop_subopt=1e-5, **kw)
        return solve(data, cfg, reg, systems, TimeModel.paper("lte"), p_star=p_star).trace

    settings = {
        "statistical": (SystemsConfig(), "n_t"),
        "high_variability": (SystemsConfig(variability="high"), "n_min"),
        "low_variability": (SystemsConfig(variability="low"), "n_min"),
    }
    for name, (systems, budget) in settings.items():
        res: dict[str, Any] = {}
        for method, (knob, grid) in TUNING.items():
            best: dict[str, Any] | None = None
            tried = {}
            for v in grid:
                kw: dict[str, Any] = {knob: v}
                if method != "cocoa":
                    kw["budget"] = budget
                t0 = time.perf_counter()
                tr = run(method, systems, **kw)
                t = time_to(tr, _times(tr, "lte", data.d), "subopt", 1e-3)
                tried[str(v)] = t
                cand = {"trace": tr, "knob": knob, "value": v, "wall_s": time.perf_counter() - t0, "t": t}
                if best is None or (t is not None and (best["t"] is None or t < best["t"])) or (
                        t is None and best["t"] is None and tr[-1]["subopt"] < best["trace"][-1]["subopt"]):
                    best = cand
            assert best is not None
            best["grid"] = tried
            res[method] = best
        out["settings"][name] = res
    drops: dict[str, Any] = {}
    frac = out["settings"]["statistical"]["mocha"]["value"]
    for label, systems in (
        ("p=0", SystemsConfig()), ("p=0.2", SystemsConfig(drop_prob=0.2)), ("p=0.5", SystemsConfig(drop_prob=0.5)),
        ("p=0.8", SystemsConfig(drop_prob=0.8)), ("never_node0", SystemsConfig(never_respond=[0])),
    ):
        drops[label] = {"trace": run("mocha", systems, local_frac=frac)}
    out["drops"] = drops
    return out


def full_method_drops(train: MTLData, test: MTLData, lam: float, scale: float = 1.0) -> dict[str, Any]:
    """The full method (Omega learned) under drops: final objective and test error per drop setting."""
    out = {}
    for label, systems in (
        ("p=0", SystemsConfig()), ("p=0.5", SystemsConfig(drop_prob=0.5)), ("p=0.8", SystemsConfig(drop_prob=0.8)),
        ("never_node0", SystemsConfig(never_respond=[0])),
    ):
        cfg = MochaConfig(lam=lam, outer=10, inner=max(5, int(100 * scale)), local_frac=0.5, record_every=10)
        res = solve(train, cfg, TaskCovariance(), systems)
        out[label] = {"primal": res.trace[-1]["primal"], "test_error": 100 * float(error_rate(test, res.W).mean()),
                      "trace": [(r["round"], r["primal"]) for r in res.trace]}
    return out


# ------------------------------------------------------------------------------------------- driver
def plot(opt: dict[str, Any], d: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    stat = opt["settings"]["statistical"]
    for ax, net in zip(axes[0], ("wifi", "lte", "3g"), strict=True):
        for method, r in stat.items():
            tr = r["trace"]
            ax.semilogy(_times(tr, net, d), [max(x["subopt"], 1e-12) for x in tr], label=method)
        ax.set_title(f"Statistical heterogeneity ({net.upper() if net != 'wifi' else 'WiFi'})")
    for ax, name in zip(axes[1][:2], ("high_variability", "low_variability"), strict=True):
        for method, r in opt["settings"][name].items():
            tr = r["trace"]
            ax.semilogy(_times(tr, "lte", d), [max(x["subopt"], 1e-12) for x in tr], label=method)
        ax.set_title(name.replace("_", " ").capitalize() + " (LTE)")
    ax = axes[1][2]
    for label, r in opt["drops"].items():
        tr = r["trace"]
        ax.semilogy([x["round"] for x in tr], [max(x["subopt"], 1e-12) for x in tr], label=f"MOCHA {label}",
                    linestyle=":" if label.startswith("never") else "-")
    ax.set_title("Dropped nodes (W-step)")
    ax.set_xlabel("round")
    for row in axes:
        for a in row:
            a.set_ylabel("primal sub-optimality")
            a.legend(fontsize=8)
    for a in list(axes[0]) + list(axes[1][:2]):
        a.set_xlabel("estimated time (reference units)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run(out: str | Path, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    splits, scale = (2, 0.3) if quick else (10, 1.0)
    summary: dict[str, Any] = {"table1": {}, "table1_detail": {}}
    for name, fn in available_datasets().items():
        log.info("mocha table 1: %s", name)
        t1 = time.perf_counter()
        res = table1(fn(), splits, seed, standardize=name in ("har", "gleam", "vehicle"), rounds_scale=scale)
        res["seconds"] = time.perf_counter() - t1
        summary["table1"][name] = {k: res[k] for k in ("global", "local", "mtl")}
        summary["table1_detail"][name] = res
        print(f"table1 {name}: global {res['global']:.2f} ({res['global_se']:.2f})  local {res['local']:.2f} "
              f"({res['local_se']:.2f})  mtl {res['mtl']:.2f} ({res['mtl_se']:.2f})  [{res['seconds']:.0f} s]")
    # figures on the synthetic federation at lambda = 1e-3: cross-validation picks large lambdas there, whose
    # problems every method solves in a handful of rounds; 1e-3 is the harder regime of the paper's 1e-4 runs
    xs, ys = synthetic_tasks(seed=seed)
    data = MTLData.from_tasks(xs, ys)
    lam = 1e-3
    summary["figures_lambda"] = lam
    opt = optimization(data, lam, scale, seed)
    plot(opt, data.d, out / "optimization.png")
    targets: dict[str, Any] = {}
    for name, res in opt["settings"].items():
        targets[name] = {}
        for method, r in res.items():
            tr = r["trace"]
            targets[name][method] = {
                net: time_to(tr, _times(tr, net, data.d), "subopt", 1e-3) for net in ("wifi", "lte", "3g")
            }
            targets[name][method]["gap_1e-3_lte"] = time_to(tr, _times(tr, "lte", data.d), "gap", 1e-3)
            targets[name][method]["tuned"] = {r["knob"]: r["value"], "grid_lte": r["grid"]}
    summary["time_to_subopt_1e-3"] = targets
    summary["drops"] = {
        k: {"final_subopt": v["trace"][-1]["subopt"], "rounds": v["trace"][-1]["round"],
            "rounds_to_subopt_1e-3": next((r["round"] for r in v["trace"] if r["subopt"] <= 1e-3), None)}
        for k, v in opt["drops"].items()
    }
    tr, te = _split((xs, ys), np.random.default_rng(seed))
    summary["full_method_drops"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "trace"}
        for k, v in full_method_drops(MTLData.from_tasks(*tr), MTLData.from_tasks(*te), lam, scale).items()
    }
    summary["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "traces.json").write_text(json.dumps(opt, default=float))
    table = table1_markdown(out)
    write_table(out / "table1.md", table)
    print(table)
    print(json.dumps({"time_to_subopt_1e-3": targets, "drops": summary["drops"],
                      "full_method_drops": summary["full_method_drops"]}, indent=1))
    return summary
