"""``fedmtl reproduce mocha-skewed`` (and the last part of ``fedmtl reproduce mocha``): analogues of MOCHA's
Tables 3-4, multi-task learning on highly skewed data (Smith et al., NeurIPS 2017, Appendix E.2).

The paper subsamples its three federations (Human Activity, Google Glass, Vehicle Sensor) "so that the task dataset
sizes differ by at least two orders of magnitude" (Table 3) and reports the average prediction error of Global,
Local and MTL models over 10 random shuffles (Table 4): MTL lowest everywhere, Global "slightly better in this
setting" than on the original data.  Those datasets cannot be downloaded here, so this module builds offline
federations **shaped like Table 3**: the tasks of the synthetic related-task federation and of the Fashion-MNIST
binary federation (``fedmtl.experiments.mocha``), with each shape's number of tasks and task sizes whose minimum,
maximum and standard deviation are the paper's (``skewed_sizes``); the features stay each federation's own.

Per federation and shuffle (75/25 per task, at least one test example per task) it fits

* **Global**, **Local**, **MTL** as Table 1 does (``fedmtl.experiments.mocha.fit``: MOCHA with the learned task
  covariance, 10 Omega-steps);
* **MTL, stragglers**: the same under high systems variability (each node does a U[0.1, 1] fraction of its local
  steps each round, the paper's "high variability");
* **MTL, drops**: the same with every node dropping each round with probability 0.5 (theta = 1);
* **MTL, shared tasks** (Remark 4): each task's training data spread at random over 1-3 nodes, the task's duals
  and W row updated from all its nodes (``MTLData.shared``) — the same problem, solved from more nodes;
* **MTL, nodes as tasks**: the same nodes, but each node its own task (an Omega over nodes, as MOCHA without
  Remark 4 would have to do); a node's model is scored on its task's test examples.

lambda is chosen per method by 3-fold cross-validation on the first shuffle from Table 1's grid (MTL's folds with
10 Omega-steps x 30 rounds), and kept for the other shuffles and for the MTL variants; every reported model trains
10 Omega-steps x 100 rounds, as Table 1's.  Table 1 cross-validates every split and the paper averages 10 shuffles;
on these federations (up to 1,933 examples a task) that would cost ten times as much, so the tables average 5
shuffles.  The federations run in parallel processes (one BLAS thread each).  The orderings of the paper's Table 4
are checked and stored (``orderings``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..data.federated import DataError
from ..data.synthetic import related_task_arrays
from ..data.vision import fmnist_pair_arrays
from ..engine.systems import SystemsConfig
from ..mtl.problem import MTLData, error_rate
from ..runs.report import write_table
from .mocha import Tasks, _split, cv_lambda, fit

log = logging.getLogger("fedmtl")

#: The paper's Table 3: tasks m, features d, min n_t, max n_t, standard deviation of n_t
TABLE3: dict[str, tuple[int, int, int, int, float]] = {
    "HA": (30, 561, 3, 306, 84.41),
    "GG": (38, 180, 6, 581, 111.79),
    "VS": (23, 100, 19, 1933, 486.08),
}
#: The paper's Table 4: average prediction error (%), mean and standard error over 10 shuffles
TABLE4: dict[str, dict[str, tuple[float, float]]] = {
    "HA": {"global": (2.41, 0.30), "local": (3.87, 0.37), "mtl": (1.93, 0.44)},
    "GG": {"global": (5.38, 0.26), "local": (4.96, 0.20), "mtl": (3.28, 0.15)},
    "VS": {"global": (13.58, 0.23), "local": (8.15, 0.19), "mtl": (6.91, 0.21)},
}
METHODS = ("global", "local", "mtl", "mtl_stragglers", "mtl_drops", "mtl_shared", "mtl_nodes_as_tasks")
LABELS = {"global": "Global", "local": "Local", "mtl": "MTL", "mtl_stragglers": "MTL, stragglers (high variability)",
          "mtl_drops": "MTL, drops (p = 0.5)", "mtl_shared": "MTL, shared tasks (Remark 4)",
          "mtl_nodes_as_tasks": "MTL, nodes as tasks"}


def skewed_sizes(m: int, lo: int, hi: int, std: float) -> np.ndarray:
    """m task sizes from ``lo`` to ``hi`` (both taken) whose (population) standard deviation is ``std``:
    n_i = lo (hi / lo)^(u_i^p) on an even grid u of [0, 1], rounded: p -> 0 makes every task but one large,
    p -> inf every task but one small.  Of the p that give ``std``, the largest is taken (most tasks small, as
    subsampling makes them): bracketed on a log grid of p, then bisected.  Ascending; shuffle before use."""
    if not (1 <= lo < hi and m >= 2 and std > 0):
        raise ValueError(f"need 1 <= lo < hi, m >= 2 and std > 0, got m={m}, lo={lo}, hi={hi}, std={std}")
    u = np.linspace(0.0, 1.0, m)

    def excess(p: float) -> float:
        return float(np.rint(lo * (hi / lo) ** (u**p)).std()) - std

    grid = np.geomspace(1e-3, 1e3, 601)
    ex = np.array([excess(p) for p in grid])
    cross = np.flatnonzero(np.sign(ex[:-1]) != np.sign(ex[1:]))
    if not len(cross) and not (ex == 0).any():
        raise ValueError(f"no size profile of {m} tasks in [{lo}, {hi}] has standard deviation {std}")
    if not len(cross):
        best = float(grid[np.flatnonzero(ex == 0)[-1]])
    else:
        a, b = float(grid[cross[-1]]), float(grid[cross[-1] + 1])
        for _ in range(100):
            c = float(np.sqrt(a * b))
            a, b = (c, b) if np.sign(excess(c)) == np.sign(excess(a)) else (a, c)
        best = min((a, b), key=lambda p: abs(excess(p)))
    return np.rint(lo * (hi / lo) ** (u**best)).astype(np.int64)


def datasets(seed: int = 0) -> dict[str, Callable[[], Tasks]]:
    """Federation name -> its builder: synthetic-{HA,GG,VS} always, fmnist-{HA,GG,VS} when the Fashion-MNIST IDX
    files are present."""
    out: dict[str, Callable[[], Tasks]] = {}
    rng = np.random.default_rng(seed)
    shapes = {k: rng.permutation(skewed_sizes(m, lo, hi, sd)).tolist() for k, (m, _, lo, hi, sd) in TABLE3.items()}
    for k, sizes in shapes.items():
        out[f"synthetic-{k}"] = functools.partial(related_task_arrays, m=len(sizes), seed=seed, sizes=sizes)
    try:
        fmnist_pair_arrays(m=3, seed=seed, sizes=[1, 1, 1])
    except (DataError, OSError) as e:
        log.info("mocha skewed: fmnist skipped (%s)", str(e).splitlines()[0])
        return out
    for k, sizes in shapes.items():
        out[f"fmnist-{k}"] = functools.partial(fmnist_pair_arrays, m=len(sizes), seed=seed, sizes=sizes)
    return out


def spread(tasks: Tasks, rng: np.random.Generator, most: int = 3) -> tuple[Tasks, np.ndarray]:
    """Each task's examples cut at random into 1..``most`` nodes (each with one example at least): the nodes'
    arrays and each node's task."""
    xs, ys, owner = [], [], []
    for t, (x, y) in enumerate(zip(*tasks, strict=True)):
        k = int(rng.integers(1, min(most, len(y)) + 1))
        cuts = np.sort(rng.choice(np.arange(1, len(y)), k - 1, replace=False)) if k > 1 else np.array([], int)
        for a, b in zip(np.split(x, cuts), np.split(y, cuts), strict=True):
            xs.append(a)
            ys.append(b)
            owner.append(t)
    return (xs, ys), np.array(owner)


def shape_of(tasks: Tasks) -> dict[str, float]:
    n = np.array([len(y) for y in tasks[1]])
    return {"m": len(n), "d": int(tasks[0][0].shape[1]), "min": int(n.min()), "max": int(n.max()),
            "std": float(n.std())}


def table4(tasks: Tasks, splits: int = 5, seed: int = 0, rounds_scale: float = 1.0, folds: int = 3,
           cv_scale: float = 0.3) -> dict[str, Any]:
    """Average per-task test error (%) of every entry of ``METHODS`` over ``splits`` shuffles: mean, standard
    error, the per-shuffle values and the lambdas (cross-validated with ``cv_scale`` times the rounds)."""
    rng = np.random.default_rng(seed)
    errs: dict[str, list[float]] = {k: [] for k in METHODS}
    lams: dict[str, float] = {}
    for s in range(splits):
        tr, te = _split(tasks, rng)
        train, test = MTLData.from_tasks(*tr), MTLData.from_tasks(*te)
        if not lams:
            lams = {k: cv_lambda(k, train, folds, rounds_scale=cv_scale) for k in ("global", "local", "mtl")}
            log.info("mocha skewed: lambdas %s", lams)
        for k in ("global", "local", "mtl"):
            errs[k].append(100.0 * float(error_rate(test, fit(k, train, lams[k], s, rounds_scale)).mean()))
        lam = lams["mtl"]
        for k, systems in (("mtl_stragglers", SystemsConfig(variability="high")),
                           ("mtl_drops", SystemsConfig(drop_prob=0.5))):
            W = fit("mtl", train, lam, s, rounds_scale, systems)
            errs[k].append(100.0 * float(error_rate(test, W).mean()))
        nodes, owner = spread(tr, rng)
        node_data = MTLData.from_tasks(*nodes)
        W = fit("mtl", node_data.shared(owner), lam, s, rounds_scale)
        errs["mtl_shared"].append(100.0 * float(error_rate(test, W).mean()))
        Wn = fit("mtl", node_data, lam, s, rounds_scale)  # one task per node: score each on its task's test set
        per_node = error_rate(MTLData.from_tasks([te[0][t] for t in owner], [te[1][t] for t in owner]), Wn)
        per_task = np.bincount(owner, weights=per_node) / np.bincount(owner)
        errs["mtl_nodes_as_tasks"].append(100.0 * float(per_task.mean()))
    out: dict[str, Any] = {"lambdas": lams, "splits": splits, "per_split": errs}
    for k, v in errs.items():
        a = np.array(v)
        out[k] = float(a.mean())
        out[f"{k}_se"] = float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else 0.0
    return out


def orderings(res: dict[str, Any]) -> dict[str, bool]:
    """The orderings of the paper's Table 4 (MTL below Global and Local) and Remark 4's equivalence (shared tasks
    within two standard errors of MTL)."""
    tol = 2.0 * max(res["mtl_se"], res["mtl_shared_se"], 0.05)
    return {"mtl_below_local": res["mtl"] < res["local"], "mtl_below_global": res["mtl"] < res["global"],
            "shared_tasks_equal_mtl": abs(res["mtl_shared"] - res["mtl"]) <= tol}


def table4_markdown(results: Path) -> str:
    """Tables 3 and 4 (measured, beside the paper's) from ``table4.json`` in ``results``."""
    data = json.loads((results / "table4.json").read_text())
    det = data["detail"]
    names = list(det)
    lines = ["Table 3 analogue: the federations' shapes (the paper's in brackets).", "",
             "| federation | tasks m | features d | min n_t | max n_t | std n_t |", "|---|---|---|---|---|---|"]
    for name in names:
        sh, paper = det[name]["shape"], TABLE3[name.split("-")[-1]]
        lines.append(f"| {name} | {sh['m']} ({paper[0]}) | {sh['d']} ({paper[1]}) | {sh['min']} ({paper[2]}) "
                     f"| {sh['max']} ({paper[3]}) | {sh['std']:.2f} ({paper[4]}) |")
    lines += ["", f"Table 4 analogue: average prediction error (%), mean (standard error) over {data['splits']} "
              "shuffles.", "", "| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in METHODS:
        cells = [f"{det[n][k]:.2f} ({det[n][k + '_se']:.2f})" for n in names]
        lines.append(f"| {LABELS[k]} | " + " | ".join(cells) + " |")
    lines += ["", "The paper's Table 4 (HA-Skew, GG-Skew, VS-Skew):", "", "| model | HA | GG | VS |",
              "|---|---|---|---|"]
    for k in ("global", "local", "mtl"):
        lines.append(f"| {LABELS[k]} | " + " | ".join(f"{TABLE4[s][k][0]:.2f} ({TABLE4[s][k][1]:.2f})"
                                                      for s in TABLE4) + " |")
    lines += ["", "| ordering | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in next(iter(det.values()))["orderings"]:
        lines.append(f"| {key} | " + " | ".join("yes" if det[n]["orderings"][key] else "**no**" for n in names)
                     + " |")
    return "\n".join(lines) + "\n"


def _federation(job: tuple[str, int, int, float, float]) -> tuple[str, dict[str, Any]]:
    """One federation's Table 4 column (a worker process: one BLAS thread)."""
    from threadpoolctl import threadpool_limits

    name, seed, splits, scale, cv_scale = job
    with threadpool_limits(1):
        t1 = time.perf_counter()
        tasks = datasets(seed)[name]()
        res = table4(tasks, splits, seed, rounds_scale=scale, cv_scale=cv_scale)
        res["shape"] = shape_of(tasks)
        res["orderings"] = orderings(res)
        res["seconds"] = time.perf_counter() - t1
    return name, res


def run(out: str | Path, quick: bool = False, seed: int = 0, workers: int = 0) -> dict[str, Any]:
    """Tables 3-4 analogues into ``out`` (``table4.json``, ``table4.md``); the federations in ``workers``
    processes (0: one per CPU core)."""
    import multiprocessing as mp
    import os
    from collections.abc import Iterator
    from concurrent.futures import ProcessPoolExecutor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits, scale, cv_scale = (2, 0.1, 0.1) if quick else (5, 1.0, 0.3)
    t0 = time.perf_counter()
    names = sorted(datasets(seed), key=lambda n: (not n.startswith("fmnist"), n))  # the slowest first
    if quick:
        names = ["synthetic-HA"]
    jobs = [(n, seed, splits, scale, cv_scale) for n in names]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    detail: dict[str, Any] = {}
    results: Iterator[tuple[str, dict[str, Any]]]
    if workers == 1:
        results = map(_federation, jobs)
    else:
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
        results = pool.map(_federation, jobs)
    for name, res in results:
        detail[name] = res
        print(f"table4 {name}: " + "  ".join(f"{k} {res[k]:.2f} ({res[k + '_se']:.2f})" for k in METHODS)
              + f"  [{res['seconds']:.0f} s]", flush=True)
    if workers > 1:
        pool.shutdown()
    order = [n for n in sorted(detail) if n.startswith("synthetic")] + [n for n in sorted(detail)
                                                                         if n.startswith("fmnist")]
    summary = {"splits": splits, "rounds": f"10 Omega-steps x {max(1, int(100 * scale))} rounds",
               "cv_rounds": f"10 Omega-steps x {max(1, int(100 * cv_scale))} rounds", "seed": seed,
               "workers": workers, "seconds": time.perf_counter() - t0, "detail": {n: detail[n] for n in order}}
    (out / "table4.json").write_text(json.dumps(summary, indent=2))
    table = table4_markdown(out)
    write_table(out / "table4.md", table)
    print(table)
    return summary


def everything(out: str | Path, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """``fedmtl reproduce mocha``: Table 1 and Figures 1-3 (``fedmtl.experiments.mocha.run``), then Tables 3-4."""
    from .mocha import run as table1_and_figures

    summary = table1_and_figures(out, quick=quick, seed=seed)
    summary["table4"] = run(out, quick=quick, seed=seed)
    return summary
