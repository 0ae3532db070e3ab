"""MOCHA and the W-step baselines of its experiments: CoCoA, mini-batch SDCA, mini-batch SGD.

Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017 (Algorithm 1).

Each node t keeps its dual variables beta_t (never sent).  A federated round h:

1. the server sends w_t (and, after an Omega-step, Sigma_tt and sigma'_t);
2. node t runs SDCA on its data-local quadratic subproblem (4) — in this scaling
   ``max_d (1/n_t) sum_i -phi(beta_ti + d_i) - db_t^T w_t - (sigma'_t Sigma_tt / (2 lam)) ||db_t||^2``
   with ``db_t = (1/n_t) X_t^T (d * y_t)`` — for as many coordinate steps as its device allows this round
   (the per-node, per-round approximation theta_t^h; a dropped node does none: theta = 1);
3. node t sends db_t; the server sets B += gamma dB and W = Sigma B / lam (nodes set beta += gamma d).

sigma' follows Lemma 9 (``sigma_mode="global"``) or Remark 5 (``"per_task"``).  After ``inner`` rounds the
server runs the regularizer's Omega-step and, as Algorithm 1 does (it keeps v = X alpha), recomputes
W = W(beta) with the new Sigma — after every outer iteration, the last included: Algorithm 1 ends its last
iteration with the Omega update (line 13) and returns W = W(alpha) for the final Omega (line 15); the trace's
last row is then re-recorded at the returned (W, Omega).  An early stop (``tol``, ``stop_subopt``,
``max_time``) ends the whole run, with that final Omega update.  ``reference_w_update=True`` instead keeps
the old W and keeps adding dB Sigma / lam, as the reference MATLAB code does (needed only to reproduce its
exact numbers; there the final Omega update leaves W unchanged).

All nodes run as one vectorized computation: every SDCA step is one numpy operation over the nodes.

**Shared tasks** (Remark 4): with ``MTLData.tasks`` several nodes hold data of one task.  Each node solves the same
data-local subproblem on its own examples (its duals, its w_tau(t), the task's n_t as divisor) and the server adds
the dB of all the nodes of a task into that task's b_t; Omega is tasks x tasks.  sigma' is Lemma 9's bound for the
node-level matrix Sigma[tau(j), tau(k)] (the nodes of one task update one w together, as CoCoA+'s machines do).

Baselines (the paper's Figures 1-2): **CoCoA** solves the same subproblem on every node to a fixed
quality theta (certified by the local duality gap: gap <= theta * progress, checked every 5 steps, at most
``cocoa_max_steps``) and the synchronous round waits for the slowest node; **Mb-SDCA** takes SDCA
coordinate steps on a mini-batch against the stale w_t and applies them scaled by
``min(1, scaling / total batch)``; **Mb-SGD** takes a projected stochastic subgradient step with step size
``scaling / (lam * lambda_min(Omega) * h)`` (Pegasos) onto the ball that contains the optimum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine.systems import SystemsConfig, TimeModel
from .omega import Regularizer, identity, sigma_prime
from .problem import Loss, MTLData, dual, dual_B, get_loss, primal, w_of

METHODS = ("mocha", "cocoa", "mbsdca", "mbsgd")
# FLOP coefficients per local step (times d), as in the reference code's time formulas (8 / 6 / 4 per point).
STEP_COST = {"mocha": 8.0, "cocoa": 8.0, "mbsdca": 6.0, "mbsgd": 4.0}


@dataclass
class MochaConfig:
    lam: float = 1e-4
    loss: str = "hinge"
    method: str = "mocha"  # mocha | cocoa | mbsdca | mbsgd
    outer: int = 1  # Omega-steps (the W-step experiments use 1)
    inner: int = 100  # federated rounds per Omega-step
    local_frac: float = 0.5  # local budget: this fraction of n_t (or of n_min, see budget)
    budget: str = "n_t"  # "n_t" (statistical heterogeneity) | "n_min" (paper's systems experiments)
    gamma: float = 1.0  # aggregation parameter
    sigma_mode: str = "global"  # global (Lemma 9) | per_task (Remark 5)
    theta: float = 0.5  # CoCoA's fixed local accuracy
    cocoa_max_steps: int = 1000
    scaling: float = 1.0  # Mb-SDCA / Mb-SGD step scale
    reference_w_update: bool = False
    seed: int = 0
    record_every: int = 1
    tol: float = 0.0  # stop early once a recorded duality gap is <= tol
    stop_subopt: float = 0.0  # stop early once a recorded primal sub-optimality (needs p_star) is <= this
    max_time: float = 0.0  # stop once the estimated time exceeds this (0 = no limit)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        get_loss(self.loss)
        if self.lam <= 0 or not 0 < self.gamma <= 1 or not 0 < self.local_frac:
            raise ValueError("need lam > 0, gamma in (0, 1] and local_frac > 0")
        if self.budget not in ("n_t", "n_min") or self.sigma_mode not in ("global", "per_task"):
            raise ValueError("budget must be 'n_t' or 'n_min'; sigma_mode 'global' or 'per_task'")
        if not 0 < self.theta < 1:
            raise ValueError(f"theta must be in (0, 1), got {self.theta}")


@dataclass
class MochaResult:
    W: np.ndarray
    beta: np.ndarray
    omega: np.ndarray
    sigma: np.ndarray
    trace: list[dict[str, Any]] = field(default_factory=list)
    messages: int = 0
    bytes: float = 0.0


def _perm(rng: np.random.Generator, data: MTLData) -> np.ndarray:
    keys = rng.random(data.y.shape)
    keys[~data.mask] = np.inf
    return np.argsort(keys, axis=1)


def sdca_local(
    data: MTLData, loss: Loss, beta: np.ndarray, W: np.ndarray, q: np.ndarray, steps: np.ndarray,
    perm: np.ndarray, sq: np.ndarray,
    theta: float | None = None, check_every: int = 5, chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SDCA on every node's subproblem at once; node t takes ``steps[t]`` coordinate steps along
    ``perm[t]`` (cyclically), or, with ``theta``, stops once its local gap certifies theta-accuracy.
    ``q[t] = sigma'_t Sigma_tt / lam``.  Returns (d_beta, dB, steps taken).

    Steps are processed in chunks: at a chunk's start every sampled example's margin against the local
    model is computed at once, and the local model's later changes enter through the chunk's Gram matrix,
    so each coordinate step costs O(m * chunk) instead of O(m * d) numpy work.  A chunk computes only the
    nodes that still have steps in it (with skewed node sizes, after the first chunk only the large nodes);
    everything a step needs that does not change within the chunk (beta's entries, the curvatures, which node
    steps when) is gathered once per chunk."""
    n, den = data.counts, data.denom
    dbeta = np.zeros_like(beta)
    dB = np.zeros_like(W)
    live = steps > 0
    taken = np.zeros(data.nodes, dtype=np.int64)
    total = int(steps.max(initial=0))
    for c0 in range(0, total, chunk):
        r = np.flatnonzero(live & (steps > c0))  # the nodes that step in this chunk
        if not len(r):
            break
        c1 = min(total, c0 + chunk)
        ar = np.arange(len(r))
        idx = perm[r[:, None], np.arange(c0, c1)[None, :] % n[r, None]]  # (k, L)
        xc = data.X[r[:, None], idx]  # (k, L, d)
        yc, sqc = data.y[r[:, None], idx], sq[r[:, None], idx]
        qr, den_r, steps_r = q[r], den[r], steps[r]
        base = (xc @ (W[r] + qr[:, None] * dB[r])[:, :, None])[:, :, 0]  # margins before this chunk's updates
        qgram = qr[:, None, None] * (xc @ xc.transpose(0, 2, 1))
        prep = loss.prepare(qr[:, None] * sqc / den_r[:, None])  # the curvatures
        bet_c = beta[r[:, None], idx]  # beta itself does not move here, only d_beta
        # act[t, j] = 1: node r[t] takes step j of the chunk (its budget not spent, its gap not yet small enough);
        # a node's steps only ever stop, so the chunk runs while its first column holds an active node
        act = (live[r][:, None] & (np.arange(c0, c1)[None, :] < steps_r[:, None])).astype(np.float64)
        end = int(act.any(0).sum())
        coef = np.zeros((len(r), c1 - c0))
        dbet = dbeta[r]
        j = 0
        while j < end:
            i = idx[:, j]
            b_old = bet_c[:, j] + dbet[ar, i]
            delta = (loss.coordinate_at(b_old, yc[:, j] * base[:, j], prep[:, j]) - b_old) * act[:, j]
            dbet[ar, i] += delta
            cj = delta * yc[:, j] / den_r
            coef[:, j] = cj
            base += cj[:, None] * qgram[:, j, :]  # every later margin sees the local model's change
            j += 1
            if theta is not None and (c0 + j) % check_every == 0:
                cur = dB.copy()
                cur[r] += (coef[:, None, :] @ xc)[:, 0]
                dbeta[r] = dbet
                gap, progress = local_gap(data, loss, beta, dbeta, W, cur, q)
                live &= ~((gap <= theta * progress) | (gap <= 1e-12))
                act[~live[r], j:] = 0.0
                end = int(act.any(0).sum())
        taken[r] += act.sum(1).astype(np.int64)
        dbeta[r] = dbet
        dB[r] += (coef[:, None, :] @ xc)[:, 0]
    return dbeta, dB, taken


def local_gap(data: MTLData, loss: Loss, beta: np.ndarray, dbeta: np.ndarray, W: np.ndarray, dB: np.ndarray,
              q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the subproblem's duality gap at d_beta (>= G* - G(d_beta)) and its progress G(d) - G(0)
    (``W`` holds each node's w_tau(t), one row per node; n is the task's count).

    The subproblem's primal in v is (1/n) sum_i [l(m_i(w + v)) + beta_i m_i(w + v)] + ||v||^2 / (2 q); at
    v = q dB the gap is the Fenchel-Young sum (1/n) sum_i [l(m_i(u)) + b_i m_i(u) + phi(b_i)], u = w + q dB.
    Since G* - G(d) <= gap, stopping when gap <= theta (G(d) - G(0)) certifies theta_t^h <= theta."""
    u = W + q[:, None] * dB
    mar = data.y * np.einsum("tnd,td->tn", data.X, u)
    b = beta + dbeta
    mask = data.mask
    n = data.denom
    gap = ((loss.primal(mar) + b * mar + loss.conj(b)) * mask).sum(1) / n
    progress = ((loss.conj(beta) - loss.conj(b)) * mask).sum(1) / n - (dB * W).sum(1) - 0.5 * q * (dB * dB).sum(1)
    return gap, progress


def solve(
    data: MTLData, cfg: MochaConfig, reg: Regularizer | None = None, systems: SystemsConfig | None = None,
    time_model: TimeModel | None = None, p_star: float | None = None,
) -> MochaResult:
    """Run ``cfg.method`` for ``cfg.outer`` x ``cfg.inner`` rounds; the trace holds, per recorded round,
    the cumulative estimated time (and its compute part in FLOPs, or units for ``TimeModel.paper``, so the
    time on any other network is ``compute / device_flops + round * (down + up message time)``), primal
    P(W), dual D(beta) and their gap (SDCA methods), and ``subopt = P - p_star`` when ``p_star`` is given."""
    loss = get_loss(cfg.loss)
    reg = reg or identity(data.m, float(data.m))
    systems = systems or SystemsConfig()
    systems = dataclasses.replace(systems, mode="wait" if cfg.method == "cocoa" else "deadline")
    time_model = time_model or systems.time_model
    unit = 1.0 if time_model.network == "paper" else float(data.d)
    step_cost = STEP_COST[cfg.method] * unit
    nbytes = 8.0 * data.d
    lam, m, nodes, tau = cfg.lam, data.m, data.nodes, data.task_of
    omega, sigma = reg.init(m)
    beta = np.zeros(data.y.shape)
    B = np.zeros((m, data.d))
    W = np.zeros((m, data.d))
    sq = data.sqnorm
    rng = np.random.default_rng(cfg.seed)
    base = data.counts if cfg.budget == "n_t" else np.full(nodes, data.counts.min())
    budget = np.maximum(1, np.floor(cfg.local_frac * base + 1e-9)).astype(np.int64)
    res = MochaResult(W, beta, omega, sigma)
    clock = 0.0
    compute_total = 0.0
    h_global = 0

    def record(h: int, outer: int) -> None:
        p = primal(data, W, omega, lam, loss)
        row: dict[str, Any] = {"round": h, "outer": outer, "time": clock, "compute": compute_total, "primal": p}
        if cfg.method != "mbsgd":
            dv = dual(data, beta, sigma, lam, loss)
            row.update(dual=dv, gap=p - dv)
        if p_star is not None:
            row["subopt"] = p - p_star
        res.trace.append(row)

    record(0, 0)
    stop = False
    for o in range(cfg.outer):
        node_sigma = data.node_sigma(sigma)
        sp = sigma_prime(node_sigma, cfg.gamma, cfg.sigma_mode == "per_task")
        q = sp * np.diag(node_sigma) / lam
        lam_min = float(np.linalg.eigvalsh(omega).min())
        radius = np.sqrt(2.0 * float(loss.primal(np.zeros(1))[0]) * m / (lam * lam_min))
        for _ in range(cfg.inner):
            draw = systems.draw(cfg.seed, h_global, np.arange(nodes))
            cap = budget if cfg.method != "cocoa" else np.full(nodes, cfg.cocoa_max_steps)
            steps = systems.steps(draw, cap)
            perm = _perm(rng, data)
            if cfg.method in ("mocha", "cocoa"):
                theta = cfg.theta if cfg.method == "cocoa" else None
                dbeta, dB, taken = sdca_local(data, loss, beta, W[tau], q, steps, perm, sq, theta)
                dB = data.to_tasks(dB)  # Remark 4: the nodes of a task add into its b_t
                beta = beta + cfg.gamma * dbeta
                if cfg.reference_w_update:
                    W = W + cfg.gamma * w_of(dB, sigma, lam)
                    B = B + cfg.gamma * dB
                else:
                    B = B + cfg.gamma * dB
                    W = w_of(B, sigma, lam)
            elif cfg.method == "mbsdca":
                taken = steps
                sel = np.arange(data.y.shape[1])[None, :] < steps[:, None]
                idx = perm
                xb = np.take_along_axis(data.X, idx[:, :, None], 1)
                yb = np.take_along_axis(data.y, idx, 1)
                bb = np.take_along_axis(beta, idx, 1)
                mar = yb * np.einsum("tnd,td->tn", xb, W[tau])
                curv = (np.diag(node_sigma) / lam)[:, None] * np.take_along_axis(sq, idx, 1) / data.denom[:, None]
                delta = np.where(sel, loss.coordinate(bb, mar, curv) - bb, 0.0)
                nu = min(1.0, cfg.scaling / max(int(steps.sum()), 1))
                dbeta = np.zeros_like(beta)
                np.put_along_axis(dbeta, idx, nu * delta, 1)
                beta = beta + dbeta
                B = dual_B(data, beta)
                W = w_of(B, sigma, lam)
            else:  # mbsgd
                taken = steps
                sel = np.arange(data.y.shape[1])[None, :] < steps[:, None]
                xb = np.take_along_axis(data.X, perm[:, :, None], 1)
                yb = np.take_along_axis(data.y, perm, 1)
                mar = yb * np.einsum("tnd,td->tn", xb, W[tau])
                coef = np.where(sel, loss.subgradient(mar) * yb, 0.0) / np.maximum(steps, 1)[:, None]
                share = (data.counts / data.denom)[:, None]  # a task's mean gradient: its nodes' by their share
                G = data.to_tasks(share * np.einsum("tn,tnd->td", coef, xb)) + lam * omega @ W
                eta = cfg.scaling / (lam * lam_min * (h_global + 1))
                W = W - eta * G
                norm = np.linalg.norm(W)
                if norm > radius:
                    W = W * (radius / norm)
            h_global += 1
            answered = int((~draw.dropped).sum())
            res.messages += nodes + answered
            res.bytes += nbytes * (nodes + answered)
            compute = systems.compute_time_steps(draw, cap if cfg.method != "cocoa" else taken, taken) * step_cost
            compute_total += compute
            clock += time_model.round_seconds(compute, nbytes, nbytes)
            if h_global % cfg.record_every == 0 or h_global == cfg.outer * cfg.inner:
                record(h_global, o)
                last = res.trace[-1]
                if (cfg.tol > 0 and last.get("gap", np.inf) <= cfg.tol) or (
                        cfg.stop_subopt > 0 and last.get("subopt", np.inf) <= cfg.stop_subopt):
                    stop = True
                    break
            if cfg.max_time > 0 and clock >= cfg.max_time:
                if res.trace[-1]["round"] != h_global:
                    record(h_global, o)
                stop = True
                break
        if reg.learns:  # Algorithm 1 line 13, after the last outer iteration too
            omega, sigma = reg.step(W, omega)
            if not cfg.reference_w_update and cfg.method != "mbsgd":
                W = w_of(B, sigma, lam)  # line 15: W = W(alpha) for the new Omega
            if o == cfg.outer - 1 or stop:  # the returned (W, Omega): re-record the last row
                if res.trace[-1]["round"] == h_global:
                    res.trace.pop()
                record(h_global, o)
        if stop:
            break
    res.W, res.beta, res.omega, res.sigma = W, beta, omega, sigma
    return res
