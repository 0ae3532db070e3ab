"""Generalized total variation (GTV) minimization by primal-dual message passing.

SarcheshmehPour, Leinonen, Jung, "Federated Learning from Big Data over Networks" (ICASSP 2021) and
"Networked Federated (Multi-Task) Learning / Clustered FL via GTV minimization" (arXiv 2105.12769):

    min_w  sum_{i in M} L_i(w_i) + lam * sum_{e = {i, j}} A_e phi(w_i - w_j)

over the empirical graph, only the nodes in M (``labelled``) having a loss.  Algorithm 1 of the seed is
Chambolle-Pock with diagonal preconditioning, tau_i = 1/|N_i| and sigma_e = 1/2:

    w~_i   = w_i - tau_i sum_e D_ei u_e
    w+_i   = PU_i(w~_i) = argmin_v L_i(v) + ||v - w~_i||^2 / (2 tau_i)    (i in M; else w~_i)
    u_e    = DU_e(u_e + sigma_e (2 (w+_{e+} - w+_{e-}) - (w_{e+} - w_{e-})))

with DU_e the prox of sigma_e (lam A_e phi)^*:
  * phi = l2 norm (network Lasso / TV): projection onto the ball ||u|| <= lam A_e;
  * phi = l1 norm (anisotropic TV): clipping to [-lam A_e, lam A_e];
  * phi = squared l2 norm ``||v||^2`` (Laplacian quadratic, MOCHA-like): u / (1 + sigma_e / (2 lam A_e)).
    (The reference code divides by 1 + 2 sigma_e / (lam A_e), the prox for phi = ||v||^2 / 4 — a wrong
    scaling for the stated penalty; ``squared_scale="reference"`` reproduces it.)

Losses: ``squared`` L_i(w) = ||y_i - X_i w||^2 (a sum over the node's samples, as the reference code; the
``loss_scale="mean"`` option divides by m_i) with the closed-form prox
PU(v) = (I + 2 tau c X^T X)^{-1} (v + 2 tau c X^T y); ``logistic`` L_i(w) = c sum_r log(1 + exp(-y_r x_r^T w))
with labels in {-1, +1}, whose prox is solved by damped Newton steps to a gradient norm of 1e-10.

Everything is vectorized over all nodes and edges (sparse incidence matrix), so graphs with 10^5 nodes run
on a laptop.  Robustness options follow the seed's claims: per-iteration edge failures (a failed edge's dual
keeps its value), node failures (a node that does not update keeps its primal value) and a stochastic
version (a labelled node's prox uses a random mini-batch of its samples).  ``messages`` counts one vector
per live edge direction per iteration (node i sends its w+_i to each neighbour), ``bytes`` their size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..data.federated import DataError, FederatedData
from ..graph import Graph, GraphError

PENALTIES = ("tv", "l1", "squared")
LOSSES = ("squared", "logistic")


@dataclass
class NodeData:
    """Local datasets padded over nodes: X (N, m_max, n), y (N, m_max), counts (N,), labelled (N,) bool; the padded
    view of a regression ``FederatedData`` (``from_federated``), the solver's input."""

    X: np.ndarray
    y: np.ndarray
    counts: np.ndarray
    labelled: np.ndarray

    @classmethod
    def from_federated(cls, data: FederatedData, labelled: Any, split: str = "train") -> NodeData:
        """Node i = seen client i of ``data`` with its ``split`` examples (real-valued targets: ``num_classes == 0``;
        for the logistic loss, labels in {-1, +1}); ``labelled`` are the nodes whose loss enters the problem."""
        if not data.is_regression:
            raise GraphError(f"{data.name}: the GTV solver fits real-valued targets (FederatedData.from_arrays(..., "
                             "regression=True)); class labels are not targets")
        s = data.seen.splits()[split]
        counts = s.counts.numpy().astype(np.int64)
        x = s.x.reshape(len(s.x), -1).to(torch.float64).numpy()
        y = s.y.to(torch.float64).numpy()
        n_nodes, mmax = len(counts), max(int(counts.max()), 1)
        X, Y = np.zeros((n_nodes, mmax, x.shape[1])), np.zeros((n_nodes, mmax))
        rows = np.repeat(np.arange(n_nodes), counts)
        cols = np.arange(len(y)) - np.repeat(s.offsets[:-1].numpy(), counts)
        X[rows, cols] = x
        Y[rows, cols] = y
        lab = np.zeros(n_nodes, dtype=bool)
        lab[np.asarray(labelled, dtype=np.int64)] = True
        if (lab & (counts == 0)).any():
            raise GraphError("a labelled node has no samples")
        return cls(X, Y, counts, lab)

    @classmethod
    def from_lists(cls, xs: list[np.ndarray], ys: list[np.ndarray], labelled: Any) -> NodeData:
        """Per-node (m_i, n) features and targets, validated as a float64 ``FederatedData`` then padded."""
        if len(xs) != len(ys):
            raise GraphError(f"{len(xs)} feature arrays but {len(ys)} label arrays")
        empty = [(np.zeros((0, *np.shape(x)[1:])), np.zeros(0)) for x in xs]
        try:
            fd = FederatedData.from_arrays(list(zip(xs, ys, strict=True)), empty, regression=True, dtype=torch.float64,
                                           name="nodes")
        except DataError as e:
            raise GraphError(str(e)) from e
        return cls.from_federated(fd, labelled)

    @property
    def num_nodes(self) -> int:
        return self.X.shape[0]

    @property
    def dim(self) -> int:
        return self.X.shape[2]

    @property
    def mask(self) -> np.ndarray:
        return np.arange(self.X.shape[1])[None, :] < self.counts[:, None]


@dataclass
class GTVConfig:
    lam: float = 0.01
    penalty: str = "tv"  # tv | l1 | squared
    loss: str = "squared"  # squared | logistic
    loss_scale: str = "sum"  # sum (reference code) | mean (divide node i's loss by m_i)
    squared_scale: str = "paper"  # paper | reference (the reference code's DU scaling for "squared")
    iterations: int = 1000
    sigma: float = 0.5
    edge_fail_prob: float = 0.0
    node_fail_prob: float = 0.0
    batch_size: int = 0  # > 0: stochastic prox on a mini-batch of each labelled node's samples
    average: bool = False  # also keep the ergodic average of the primal iterates (the O(1/K) theory's output)
    record_every: int = 0  # > 0: record residuals / objective every this many iterations
    tol: float = 0.0  # stop when the relative iterate change falls below tol
    ref_tol: float = 0.0  # with a reference solution: stop once a recorded relative error is <= ref_tol
    seed: int = 0

    def __post_init__(self) -> None:
        if self.penalty not in PENALTIES or self.loss not in LOSSES:
            raise ValueError(f"penalty must be one of {PENALTIES} and loss one of {LOSSES}")
        if self.lam < 0 or not 0 < self.sigma <= 0.5:
            raise ValueError("need lam >= 0 and sigma in (0, 1/2] (the step-size condition with tau = 1/deg)")
        if self.loss_scale not in ("sum", "mean") or self.squared_scale not in ("paper", "reference"):
            raise ValueError("loss_scale must be sum|mean and squared_scale paper|reference")
        if not (0 <= self.edge_fail_prob < 1 and 0 <= self.node_fail_prob < 1):
            raise ValueError("failure probabilities must be in [0, 1)")


@dataclass
class GTVResult:
    w: np.ndarray  # (N, n) last primal iterate
    u: np.ndarray  # (E, n) dual
    w_avg: np.ndarray | None
    iterations: int
    messages: int
    bytes: float
    trace: list[dict[str, Any]] = field(default_factory=list)


def _loss_coef(data: NodeData, cfg: GTVConfig) -> np.ndarray:
    return 1.0 / np.maximum(data.counts, 1) if cfg.loss_scale == "mean" else np.ones(data.num_nodes)


def objective(graph: Graph, data: NodeData, w: np.ndarray, cfg: GTVConfig) -> float:
    """sum_{i in M} L_i(w_i) + lam sum_e A_e phi(w_{e+} - w_{e-})."""
    c = _loss_coef(data, cfg)
    s = np.einsum("imn,in->im", data.X, w)
    if cfg.loss == "squared":
        per = ((data.y - s) ** 2 * data.mask).sum(1)
    else:
        per = (np.logaddexp(0.0, -data.y * s) * data.mask).sum(1)
    diff = w[graph.edges[:, 0]] - w[graph.edges[:, 1]]
    if cfg.penalty == "tv":
        pen = np.linalg.norm(diff, axis=1)
    elif cfg.penalty == "l1":
        pen = np.abs(diff).sum(1)
    else:
        pen = (diff * diff).sum(1)
    return float((c * per)[data.labelled].sum() + cfg.lam * (graph.weights * pen).sum())


def dual_prox(
    u: np.ndarray, radius: np.ndarray, penalty: str, sigma: float, squared_scale: str = "paper"
) -> np.ndarray:
    """prox of sigma g_e^* for g_e = radius_e * phi (radius_e = lam A_e), rows are edges."""
    if penalty == "tv":
        norm = np.linalg.norm(u, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(norm > radius, radius / norm, 1.0)
        return u * scale[:, None]
    if penalty == "l1":
        return np.clip(u, -radius[:, None], radius[:, None])
    with np.errstate(divide="ignore"):
        if squared_scale == "paper":
            return u / (1.0 + sigma / (2.0 * radius))[:, None]
        return u / (1.0 + 2.0 * sigma / radius)[:, None]


class _SquaredProx:
    """Closed-form prox of c ||y - X w||^2 with step tau for every labelled node at once."""

    def __init__(self, data: NodeData, tau: np.ndarray, coef: np.ndarray):
        lab = np.flatnonzero(data.labelled)
        self.lab = lab
        X, y = data.X[lab], data.y[lab] * data.mask[lab]
        k = (2.0 * tau[lab] * coef[lab])[:, None, None]
        n = data.dim
        self.inv = np.linalg.inv(np.eye(n)[None] + k * np.einsum("imn,imk->ink", X, X))
        self.rhs = k[:, :, 0] * np.einsum("imn,im->in", X, y)

    def __call__(self, v: np.ndarray) -> np.ndarray:
        return np.einsum("ink,ik->in", self.inv, v + self.rhs)


def _squared_prox_batch(X: np.ndarray, y: np.ndarray, m: np.ndarray, v: np.ndarray, k: np.ndarray) -> np.ndarray:
    n = X.shape[2]
    Xm = X * m[:, :, None]
    a = np.eye(n)[None] + k[:, None, None] * np.einsum("imn,imk->ink", Xm, X)
    b = v + k[:, None] * np.einsum("imn,im->in", Xm, y)
    return np.linalg.solve(a, b[:, :, None])[:, :, 0]


def _logistic_prox(X: np.ndarray, y: np.ndarray, m: np.ndarray, v: np.ndarray, tau: np.ndarray, c: np.ndarray,
                   start: np.ndarray, max_iter: int = 50) -> np.ndarray:
    """argmin_w c sum_r m_r log(1 + exp(-y_r x_r^T w)) + ||w - v||^2 / (2 tau), per node, damped Newton."""
    n = X.shape[2]
    w = start.copy()

    def obj(w_: np.ndarray) -> np.ndarray:
        s = np.einsum("imn,in->im", X, w_)
        return c * (np.logaddexp(0.0, -y * s) * m).sum(1) + ((w_ - v) ** 2).sum(1) / (2 * tau)

    f = obj(w)
    for _ in range(max_iter):
        s = np.einsum("imn,in->im", X, w)
        p = 0.5 * (1.0 - np.tanh(0.5 * y * s))  # sigmoid(-y s), stable
        g = -c[:, None] * np.einsum("im,imn->in", p * y * m, X) + (w - v) / tau[:, None]
        if np.abs(g).max(initial=0.0) < 1e-10:
            break
        h = c[:, None, None] * np.einsum("im,imn,imk->ink", p * (1 - p) * m, X, X)
        h = h + np.eye(n)[None] / tau[:, None, None]
        step = np.linalg.solve(h, g[:, :, None])[:, :, 0]
        t = np.ones(len(w))
        for _ in range(30):  # backtracking where the full step does not decrease the objective
            cand = w - t[:, None] * step
            fc = obj(cand)
            bad = fc > f + 1e-14 * np.abs(f)
            if not bad.any():
                break
            t = np.where(bad, t / 2, t)
        w, f = cand, fc
    return w


def solve(graph: Graph, data: NodeData, cfg: GTVConfig, w_ref: np.ndarray | None = None) -> GTVResult:
    """Run Algorithm 1 for ``cfg.iterations`` iterations (or until ``cfg.tol``).  With ``w_ref`` the trace
    records the relative error ||w - w_ref|| / ||w_ref||."""
    if data.num_nodes != graph.num_nodes:
        raise GraphError(f"graph has {graph.num_nodes} nodes but the data {data.num_nodes}")
    if cfg.loss == "logistic" and not np.isin(data.y[data.mask & data.labelled[:, None]], (-1.0, 1.0)).all():
        raise GraphError("logistic loss needs labels in {-1, +1} on the labelled nodes")
    rng = np.random.default_rng(cfg.seed)
    D = graph.incidence()
    Dt = D.T.tocsr()
    deg = graph.degree()
    tau = 1.0 / np.maximum(deg, 1.0)
    coef = _loss_coef(data, cfg)
    radius = cfg.lam * graph.weights
    N, n, E = data.num_nodes, data.dim, graph.num_edges
    w = np.zeros((N, n))
    u = np.zeros((E, n))
    w_sum = np.zeros((N, n)) if cfg.average else None
    lab = np.flatnonzero(data.labelled)
    stochastic = cfg.batch_size > 0
    prox = _SquaredProx(data, tau, coef) if cfg.loss == "squared" and not stochastic else None
    res = GTVResult(w, u, None, 0, 0, 0.0)
    ref_norm = float(np.linalg.norm(w_ref)) if w_ref is not None else 0.0
    k = 0
    for k in range(1, cfg.iterations + 1):
        w_t = w - tau[:, None] * (Dt @ u)
        w_new = w_t.copy()
        if len(lab):
            v = w_t[lab]
            if stochastic:
                m = data.mask[lab].astype(np.float64)
                keys = rng.random(m.shape) + (1 - m) * 2.0  # padding sorts last
                rank = np.argsort(np.argsort(keys, 1), 1)
                m = m * (rank < cfg.batch_size)
                scale = data.counts[lab] / np.minimum(data.counts[lab], cfg.batch_size)  # unbiased loss estimate
                cb = coef[lab] * scale
            else:
                m = data.mask[lab].astype(np.float64)
                cb = coef[lab]
            if cfg.loss == "squared":
                w_new[lab] = prox(v) if prox is not None else _squared_prox_batch(
                    data.X[lab], data.y[lab], m, v, 2.0 * tau[lab] * cb)
            else:
                w_new[lab] = _logistic_prox(data.X[lab], data.y[lab], m, v, tau[lab], cb, w[lab])
        if cfg.node_fail_prob > 0:
            asleep = rng.random(N) < cfg.node_fail_prob
            w_new[asleep] = w[asleep]
        z = 2.0 * w_new - w
        u_new = dual_prox(u + cfg.sigma * (D @ z), radius, cfg.penalty, cfg.sigma, cfg.squared_scale)
        live = E
        if cfg.edge_fail_prob > 0:
            fail = rng.random(E) < cfg.edge_fail_prob
            u_new[fail] = u[fail]
            live = int(E - fail.sum())
        res.messages += 2 * live
        change = np.linalg.norm(w_new - w) + np.linalg.norm(u_new - u)
        scale_now = np.linalg.norm(w_new) + np.linalg.norm(u_new) + 1e-300
        w, u = w_new, u_new
        if w_sum is not None:
            w_sum += w
        if cfg.record_every and (k % cfg.record_every == 0 or k == cfg.iterations):
            row: dict[str, Any] = {"iteration": k, "residual": float(change / scale_now),
                                   "objective": objective(graph, data, w, cfg)}
            if w_ref is not None:
                row["rel_error"] = float(np.linalg.norm(w - w_ref) / max(ref_norm, 1e-300))
            res.trace.append(row)
            if cfg.ref_tol > 0 and row.get("rel_error", np.inf) <= cfg.ref_tol:
                break
        if cfg.tol > 0 and change / scale_now < cfg.tol:
            break
    res.w, res.u, res.iterations = w, u, k
    res.bytes = float(res.messages) * n * 8.0
    res.w_avg = w_sum / max(k, 1) if w_sum is not None else None
    return res


def cvxpy_solution(graph: Graph, data: NodeData, cfg: GTVConfig) -> tuple[np.ndarray, float, float]:
    """The same problem solved centrally by CVXPY (Clarabel): (w, optimal value, seconds)."""
    import time

    import cvxpy as cp

    N, n = data.num_nodes, data.dim
    W = cp.Variable((N, n))
    coef = _loss_coef(data, cfg)
    terms = []
    lab = np.flatnonzero(data.labelled)
    if len(lab):
        Xl = data.X[lab] * data.mask[lab][:, :, None]
        rows = Xl.reshape(-1, n)
        node = np.repeat(np.arange(len(lab)), data.X.shape[1])
        keep = data.mask[lab].reshape(-1)
        import scipy.sparse as sp

        # scores s_r = x_r^T w_{node(r)} as one sparse linear map of vec(W[lab])
        R = int(keep.sum())
        rr = np.repeat(np.arange(R), n)
        cc = (node[keep][:, None] * n + np.arange(n)[None]).reshape(-1)
        S = sp.csr_matrix((rows[keep].reshape(-1), (rr, cc)), shape=(R, len(lab) * n))
        scores = S @ cp.reshape(W[lab], (len(lab) * n,), order="C")
        yv = data.y[lab].reshape(-1)[keep]
        cw = np.repeat(coef[lab], data.X.shape[1])[keep]
        if cfg.loss == "squared":
            terms.append(cp.sum(cp.multiply(cw, cp.square(yv - scores))))
        else:
            terms.append(cp.sum(cp.multiply(cw, cp.logistic(-cp.multiply(yv, scores)))))
    D = graph.incidence()
    diff = D @ W
    a = graph.weights
    if cfg.penalty == "tv":
        pen = cp.sum(cp.multiply(a, cp.norm(diff, 2, axis=1)))
    elif cfg.penalty == "l1":
        pen = cp.sum(cp.multiply(a, cp.sum(cp.abs(diff), axis=1)))
    else:
        pen = cp.sum(cp.multiply(a, cp.sum(cp.square(diff), axis=1)))
    prob = cp.Problem(cp.Minimize(cp.sum(terms) + cfg.lam * pen) if terms else cp.Minimize(cfg.lam * pen))
    t0 = time.perf_counter()
    prob.solve(solver=cp.CLARABEL)
    return np.asarray(W.value), float(prob.value), time.perf_counter() - t0
