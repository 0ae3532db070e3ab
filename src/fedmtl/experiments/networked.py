"""``fedmtl reproduce networked``: the toy experiments of networked FL by GTV minimization.

Setting of the seed (and the GTV notebooks of the reference code): a two-cluster stochastic block model,
piecewise-constant true weights w = (2, 2) on cluster 1 and (-2, 2) on cluster 2, m = 5 samples of n = 2
Gaussian features per node, y = x^T w + noise, a random 40% of the nodes labelled, squared-error loss.

* estimation error (mean ||w_i - w_true_i||^2 over all nodes, and over unlabelled ones) against lambda, for
  phi = TV (l2), l1 and squared l2, with pooled least squares on the labelled nodes as the baseline;
* "Statistical error vs connectivity": the error against p_out / p_in at fixed lambda;
* the clustering recovered from the learned weights (2-means on w, accuracy up to relabelling) and a
  scatter plot of the learned weights;
* robustness: error after a fixed number of iterations with edges failing, nodes not updating and
  mini-batch (stochastic) prox steps;
* node classification with the logistic loss (labels sign(x^T w_true)): accuracy on the unlabelled
  nodes against pooled logistic regression on the labelled ones;
* ``fedmtl reproduce networked-flow`` (``flow``): the slides' scalar toy (y_i = w_i + sigma eps_i on S labelled
  nodes per cluster, w = +1 / -1 on the two clusters, squared loss, TV): the error on the unlabelled nodes and the
  flow connectivity rho (``fedmtl.networked.flow``) against S p_in / p_out, the quantity whose threshold decides,
  with high probability, whether the clustering assumption (rho >= 2) holds.

Each figure averages ``reps`` random graphs; every number in summary.json is measured by this run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..graph import Graph, sbm
from ..networked.gtv import GTVConfig, NodeData, solve
from ..runs.report import save_figure

W_TRUE = np.array([[2.0, 2.0], [-2.0, 2.0]])


def sbm_problem(sizes: tuple[int, int] = (100, 100), p_in: float = 0.5, p_out: float = 0.01, m: int = 5,
                noise: float = 0.1, frac: float = 0.4, seed: int = 0, classification: bool = False
                ) -> tuple[Graph, NodeData, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    g = sbm(list(sizes), p_in, p_out, seed=seed + 1000)
    assert g.clusters is not None
    wbar = W_TRUE[g.clusters]
    xs = [rng.normal(size=(m, 2)) for _ in range(g.num_nodes)]
    ys = [x @ w + noise * rng.normal(size=m) for x, w in zip(xs, wbar, strict=True)]
    if classification:
        ys = [np.where(y >= 0, 1.0, -1.0) for y in ys]
    lab = rng.permutation(g.num_nodes)[: int(round(frac * g.num_nodes))]
    return g, NodeData.from_lists(xs, ys, lab), wbar, xs, ys


def weight_error(w: np.ndarray, wbar: np.ndarray, nodes: np.ndarray | None = None) -> float:
    d = ((w - wbar) ** 2).sum(1)
    return float(d.mean() if nodes is None else d[nodes].mean())


def pooled(xs: list[np.ndarray], ys: list[np.ndarray], lab: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(np.concatenate([xs[i] for i in lab]), np.concatenate([ys[i] for i in lab]), rcond=None)[0]


def cluster_accuracy(w: np.ndarray, truth: np.ndarray, seed: int = 0) -> float:
    from sklearn.cluster import KMeans

    pred = KMeans(2, n_init=10, random_state=seed).fit_predict(w)
    acc = float((pred == truth).mean())
    return max(acc, 1.0 - acc)


def labelled_sweep(out: Path, quick: bool, seed: int, reps: int, sizes: tuple[int, int] = (100, 100),
                   p_in: float = 0.2, p_out: float = 0.02, sigma: float = 0.1, lam: float = 0.01) -> dict[str, Any]:
    """The scalar toy against S, the labelled nodes per cluster: for each S and graph, GTV (TV penalty) on the
    labelled nodes' noisy values, its squared error and sign recovery on the unlabelled nodes, and the flow
    connectivity rho (the smaller of the two clusters').  Figure ``labelled.png``."""
    import matplotlib.pyplot as plt

    from ..networked.flow import boundary_flow

    S_values = [1, 3, 20] if quick else [1, 2, 3, 5, 8, 13, 20, 30]
    iters = 1000 if quick else 4000
    wbar_c = np.array([1.0, -1.0])
    mse, sign, rho = (np.zeros((reps, len(S_values))) for _ in range(3))
    for r in range(reps):
        g = sbm(list(sizes), p_in, p_out, seed=seed + 300 + r)
        assert g.clusters is not None
        rng = np.random.default_rng(seed + 400 + r)
        wbar = wbar_c[g.clusters]
        xs = [np.ones((1, 1)) for _ in range(g.num_nodes)]
        ys = [np.array([w + sigma * rng.normal()]) for w in wbar]
        order = [rng.permutation(np.flatnonzero(g.clusters == c)) for c in range(2)]
        for j, S in enumerate(S_values):
            lab = np.concatenate([o[:S] for o in order])
            unl = np.setdiff1d(np.arange(g.num_nodes), lab)
            data = NodeData.from_lists(xs, ys, lab)
            w = solve(g, data, GTVConfig(lam=lam, penalty="tv", iterations=iters)).w[:, 0]
            mse[r, j] = float(((w[unl] - wbar[unl]) ** 2).mean())
            sign[r, j] = float((np.sign(w[unl]) == np.sign(wbar[unl])).mean())
            rho[r, j] = float(boundary_flow(g, g.clusters, lab).min())
    x = np.array(S_values) * p_in / p_out
    holds = [bool((rho[:, j] >= 2).all()) for j in range(len(S_values))]
    first = next((float(x[j]) for j, h in enumerate(holds) if h), None)
    recovered = next((float(x[j]) for j in range(len(S_values)) if (sign[:, j] >= 0.99).all()), None)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.loglog(x, mse.mean(0), marker="o", label="GTV (TV), unlabelled nodes")
    a1.loglog(x, (1 - sign.mean(0)) + 1e-4, marker="s", label="fraction of signs wrong (+1e-4)")
    a2.semilogx(x, rho.mean(0), marker="o", label="flow connectivity rho (mean over graphs)")
    a2.semilogx(x, rho.min(0), marker="v", linestyle=":", label="rho, worst graph")
    a2.axhline(2.0, color="k", linestyle="--", label="rho = 2 (clustering assumption)")
    a2.axhline(1.0, color="k", linestyle=":", label="rho = 1")
    if first is not None:
        for a in (a1, a2):
            a.axvline(first, color="tab:gray", linestyle="--")
    a1.set_xlabel("S p_in / p_out")
    a1.set_ylabel("mean squared error / wrong signs")
    a1.legend(fontsize=8)
    a2.set_xlabel("S p_in / p_out")
    a2.set_ylabel("rho")
    a2.legend(fontsize=8)
    fig.suptitle(f"Scalar toy, two SBM clusters of {sizes[0]} (p_in {p_in}, p_out {p_out}), S labelled per cluster")
    fig.tight_layout()
    save_figure(fig, out / "labelled.png", dpi=110)
    return {"S": S_values, "S_pin_over_pout": x.tolist(), "p_in": p_in, "p_out": p_out, "sigma": sigma,
            "lambda": lam, "iterations": iters, "reps": reps,
            "mse_unlabelled": mse.mean(0).tolist(), "sign_recovery_unlabelled": sign.mean(0).tolist(),
            "rho_mean": rho.mean(0).tolist(), "rho_min": rho.min(0).tolist(), "rho_at_least_2_in_every_graph": holds,
            "first_S_pin_over_pout_with_rho_at_least_2": first,
            "first_S_pin_over_pout_recovered_in_every_graph": recovered,
            "rho_min_where_first_recovered": (float(rho[:, [float(v) for v in x].index(recovered)].min())
                                              if recovered is not None else None)}


def flow(out: str | Path, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """``fedmtl reproduce networked-flow``: ``labelled_sweep`` over 5 graphs (2 with ``quick``) into ``out``
    (``summary.json``, ``labelled.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary = labelled_sweep(out, quick, seed, 2 if quick else 5)
    summary["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=1))
    return summary


def run(out: str | Path, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reps = 2 if quick else 5
    iters = 500 if quick else 2000
    lams = np.logspace(-3, 1, 5 if quick else 9)
    penalties = ("tv", "l1", "squared")
    summary: dict[str, Any] = {"setting": {"sizes": [100, 100], "p_in": 0.5, "p_out": 0.01, "m": 5, "noise": 0.1,
                                           "labelled": 0.4, "iterations": iters, "reps": reps}}

    # ---- error vs lambda
    err = {p: np.zeros((reps, len(lams))) for p in penalties}
    err_unl = {p: np.zeros((reps, len(lams))) for p in penalties}
    base = np.zeros(reps)
    for r in range(reps):
        g, data, wbar, xs, ys = sbm_problem(seed=seed + r)
        lab = np.flatnonzero(data.labelled)
        unl = np.flatnonzero(~data.labelled)
        base[r] = weight_error(np.repeat(pooled(xs, ys, lab)[None], g.num_nodes, 0), wbar)
        for p in penalties:
            for j, lam in enumerate(lams):
                w = solve(g, data, GTVConfig(lam=float(lam), penalty=p, iterations=iters)).w
                err[p][r, j] = weight_error(w, wbar)
                err_unl[p][r, j] = weight_error(w, wbar, unl)
    best = {p: float(lams[int(np.argmin(err[p].mean(0)))]) for p in penalties}
    summary["lambda_sweep"] = {
        "lambdas": lams.tolist(),
        "mse": {p: err[p].mean(0).tolist() for p in penalties},
        "mse_unlabelled": {p: err_unl[p].mean(0).tolist() for p in penalties},
        "pooled_mse": float(base.mean()),
        "best_lambda": best,
        "best_mse": {p: float(err[p].mean(0).min()) for p in penalties},
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in penalties:
        ax.loglog(lams, err[p].mean(0), marker="o", label=f"GTV {p}")
    ax.axhline(base.mean(), color="k", linestyle="--", label="pooled least squares")
    ax.set_xlabel("lambda")
    ax.set_ylabel("mean squared weight error")
    ax.set_title("Two-cluster SBM: estimation error vs lambda")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "lambda.png", dpi=110)

    # ---- error vs connectivity
    ratios = np.array([0.002, 0.01, 0.05, 0.2, 0.5, 1.0]) if not quick else np.array([0.002, 0.05, 0.5])
    conn = {p: np.zeros((reps, len(ratios))) for p in penalties}
    for r in range(reps):
        for j, ratio in enumerate(ratios):
            g, data, wbar, xs, ys = sbm_problem(p_out=0.5 * float(ratio), seed=seed + 100 + r)
            for p in penalties:
                w = solve(g, data, GTVConfig(lam=best[p], penalty=p, iterations=iters)).w
                conn[p][r, j] = weight_error(w, wbar)
    summary["connectivity"] = {"p_out_over_p_in": ratios.tolist(),
                               "mse": {p: conn[p].mean(0).tolist() for p in penalties}}
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in penalties:
        ax.loglog(ratios, conn[p].mean(0), marker="o", label=f"GTV {p} (lambda={best[p]:.3g})")
    ax.set_xlabel("p_out / p_in")
    ax.set_ylabel("mean squared weight error")
    ax.set_title("Statistical error vs connectivity")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "connectivity.png", dpi=110)

    # ---- clustering recovered
    g, data, wbar, xs, ys = sbm_problem(seed=seed)
    res = solve(g, data, GTVConfig(lam=best["tv"], penalty="tv", iterations=iters))
    assert g.clusters is not None
    summary["clustering"] = {
        "kmeans_accuracy_all": cluster_accuracy(res.w, g.clusters, seed),
        "kmeans_accuracy_unlabelled": cluster_accuracy(res.w[~data.labelled], g.clusters[~data.labelled], seed),
        "messages": res.messages, "bytes": res.bytes, "edges": g.num_edges, "iterations": res.iterations,
    }
    fig, ax = plt.subplots(figsize=(5, 5))
    for c, col in ((0, "tab:blue"), (1, "tab:red")):
        sel = g.clusters == c
        ax.scatter(res.w[sel & data.labelled, 0], res.w[sel & data.labelled, 1], c=col, marker="o", s=18,
                   label=f"cluster {c + 1}, labelled")
        ax.scatter(res.w[sel & ~data.labelled, 0], res.w[sel & ~data.labelled, 1], c=col, marker="x", s=18,
                   label=f"cluster {c + 1}, unlabelled")
    ax.scatter(W_TRUE[:, 0], W_TRUE[:, 1], c="k", marker="*", s=200, label="true weights")
    ax.set_xlabel("w_1")
    ax.set_ylabel("w_2")
    ax.set_title("Learned node weights (GTV TV)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out / "clusters.png", dpi=110)

    # ---- robustness: iterations to reach the failure-free solution, and the error after a short budget
    probs = [0.0, 0.1, 0.3, 0.5]
    ref = solve(g, data, GTVConfig(lam=best["tv"], iterations=20 * iters, tol=1e-13)).w
    short = max(20, iters // 20)

    def degrade(**kw: Any) -> dict[str, Any]:
        tr = solve(g, data, GTVConfig(lam=best["tv"], iterations=iters, record_every=1, seed=seed, **kw), w_ref=ref)
        hit = next((x["iteration"] for x in tr.trace if x["rel_error"] <= 1e-3), None)
        return {"iterations_to_rel_1e-3": hit, f"rel_error_after_{short}": tr.trace[short - 1]["rel_error"],
                "messages": tr.messages}

    rob: dict[str, Any] = {
        "probabilities": probs,
        "edge_failures": [degrade(edge_fail_prob=q) for q in probs],
        "node_failures": [degrade(node_fail_prob=q) for q in probs],
        "stochastic": {},
        "exact_mse": weight_error(ref, wbar),
    }
    for b in (4, 2, 1):
        rr = solve(g, data, GTVConfig(lam=best["tv"], iterations=iters, batch_size=b, average=True, seed=seed))
        assert rr.w_avg is not None
        rob["stochastic"][f"batch_{b}"] = {"mse_last": weight_error(rr.w, wbar),
                                           "mse_average": weight_error(rr.w_avg, wbar)}
    summary["robustness"] = rob
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, mk in (("edge_failures", "o"), ("node_failures", "s")):
        its = [x["iterations_to_rel_1e-3"] or np.nan for x in rob[key]]
        ax.plot(probs, its, marker=mk, label=key.replace("_", " "))
    ax.set_xlabel("failure probability per iteration")
    ax.set_ylabel("iterations to relative error 1e-3")
    ax.set_title("Robustness of primal-dual message passing")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "robustness.png", dpi=110)

    # ---- node classification (logistic loss)
    from sklearn.linear_model import LogisticRegression

    accs, pooled_accs = [], []
    for r in range(reps):
        g, data, wbar, xs, ys = sbm_problem(seed=seed + 200 + r, classification=True)
        lab, unl = np.flatnonzero(data.labelled), np.flatnonzero(~data.labelled)
        w = solve(g, data, GTVConfig(lam=best["tv"], penalty="tv", loss="logistic", iterations=iters)).w
        xu, yu = np.concatenate([xs[i] for i in unl]), np.concatenate([ys[i] for i in unl])
        node = np.repeat(unl, [len(ys[i]) for i in unl])
        accs.append(float((np.sign(np.einsum("rn,rn->r", xu, w[node])) == yu).mean()))
        lr = LogisticRegression(fit_intercept=False).fit(np.concatenate([xs[i] for i in lab]),
                                                        np.concatenate([ys[i] for i in lab]))
        pooled_accs.append(float((lr.predict(xu) == yu).mean()))
    summary["classification"] = {"gtv_logistic_accuracy_unlabelled": float(np.mean(accs)),
                                 "pooled_logistic_accuracy_unlabelled": float(np.mean(pooled_accs)),
                                 "lambda": best["tv"]}
    summary["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=1))
    return summary
