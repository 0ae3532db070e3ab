"""The convex multi-task problem that MOCHA solves, its dual and the losses' conjugates.

Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017, problem (1) with the
reference code's scaling (per-task *mean* loss, so every task weighs the same):

    P(W)    = sum_t (1/n_t) sum_i l(y_ti x_ti^T w_t) + (lam/2) tr(W Omega W^T)
    D(beta) = sum_t (1/n_t) sum_i -phi(beta_ti) - (1/(2 lam)) tr(B^T Sigma B),   Sigma = Omega^{-1}
    b_t     = (1/n_t) sum_i beta_ti y_ti x_ti,     W(beta) = Sigma B / lam   (rows are tasks)

where ``l(m) = max_beta [-beta m - phi(beta)]`` is the loss of the margin m and beta = alpha * y is the
dual variable in label-free form.  Hinge: phi(beta) = -beta on [0, 1].  Squared hinge
l(m) = max(0, 1 - m)^2: phi(beta) = -beta + beta^2 / 4 on [0, inf).  P(W(beta)) - D(beta) >= 0 is the
duality gap.

Arrays are float64 numpy, padded over nodes: X (nodes, n_max, d), y (nodes, n_max) in {-1, +1} (0 = padding); the
padded view of a ``FederatedData`` (``MTLData.from_federated``: one task per client), the reference solver's input.

**Shared tasks** (the paper's Remark 4, Appendix B.3.1): ``MTLData.tasks`` maps each node to the task whose data it
holds, several nodes to one task.  Everything above then reads with the task's data pooled over its nodes: n_t is
the task's total count (every node of task t divides by it), b_t sums its nodes' contributions and W, Omega are
(tasks x d) and (tasks x tasks).  The duals stay per node and per example.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..data.federated import DataError, FederatedData


class Loss:
    name = "loss"

    def primal(self, margin: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def conj(self, beta: np.ndarray) -> np.ndarray:
        """phi(beta) (finite on the dual domain)."""
        raise NotImplementedError

    def coordinate(self, beta: np.ndarray, margin: np.ndarray, curv: np.ndarray) -> np.ndarray:
        """argmax_b -phi(b) - (b - beta) margin - curv (b - beta)^2 / 2 (one SDCA coordinate step)."""
        return self.coordinate_at(beta, margin, self.prepare(curv))

    def prepare(self, curv: np.ndarray) -> np.ndarray:
        """What ``coordinate_at`` needs of the curvatures, computed once for many steps (SDCA's chunks)."""
        raise NotImplementedError

    def coordinate_at(self, beta: np.ndarray, margin: np.ndarray, prepared: np.ndarray) -> np.ndarray:
        """``coordinate`` with the curvatures ``prepare``d."""
        raise NotImplementedError

    def subgradient(self, margin: np.ndarray) -> np.ndarray:
        """dl/dm."""
        raise NotImplementedError


class Hinge(Loss):
    name = "hinge"

    def primal(self, margin: np.ndarray) -> np.ndarray:
        return np.maximum(0.0, 1.0 - margin)

    def conj(self, beta: np.ndarray) -> np.ndarray:
        return -beta

    def prepare(self, curv: np.ndarray) -> np.ndarray:
        return np.where(curv > 0, curv, np.inf)  # no curvature (an all-zero example): no step

    def coordinate_at(self, beta: np.ndarray, margin: np.ndarray, prepared: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(beta + (1.0 - margin) / prepared, 0.0), 1.0)

    def subgradient(self, margin: np.ndarray) -> np.ndarray:
        return -(margin < 1.0).astype(np.float64)


class SquaredHinge(Loss):
    name = "squared_hinge"

    def primal(self, margin: np.ndarray) -> np.ndarray:
        return np.maximum(0.0, 1.0 - margin) ** 2

    def conj(self, beta: np.ndarray) -> np.ndarray:
        return -beta + beta * beta / 4.0

    def prepare(self, curv: np.ndarray) -> np.ndarray:
        return 0.5 + curv

    def coordinate_at(self, beta: np.ndarray, margin: np.ndarray, prepared: np.ndarray) -> np.ndarray:
        return np.maximum(beta + (1.0 - margin - beta / 2.0) / prepared, 0.0)

    def subgradient(self, margin: np.ndarray) -> np.ndarray:
        return -2.0 * np.maximum(0.0, 1.0 - margin)


LOSSES: dict[str, Loss] = {"hinge": Hinge(), "squared_hinge": SquaredHinge()}


def get_loss(name: str) -> Loss:
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]


@dataclass
class MTLData:
    """Binary tasks on nodes, padded.  Build with ``from_tasks`` (then ``shared`` for several nodes per task)."""

    X: np.ndarray  # (nodes, n_max, d)
    y: np.ndarray  # (nodes, n_max) in {-1, 0, +1}
    counts: np.ndarray  # (nodes,) int
    #: (nodes,) the task each node holds (Remark 4); None: node t holds task t alone
    tasks: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.tasks is not None:
            t = np.asarray(self.tasks)
            if t.shape != (self.X.shape[0],) or not np.issubdtype(t.dtype, np.integer):
                raise DataError(f"tasks must map each of the {self.X.shape[0]} nodes to a task id, got shape {t.shape}")
            if t.min(initial=0) < 0 or set(np.unique(t).tolist()) != set(range(int(t.max(initial=-1)) + 1)):
                raise DataError("task ids must be 0..k-1, each held by at least one node")
            self.tasks = t.astype(np.int64)

    @property
    def nodes(self) -> int:
        return self.X.shape[0]

    @property
    def m(self) -> int:
        """The number of tasks (rows of W, the order of Omega)."""
        return self.X.shape[0] if self.tasks is None else int(self.tasks.max()) + 1

    @property
    def task_of(self) -> np.ndarray:
        """(nodes,) each node's task."""
        return np.arange(self.X.shape[0]) if self.tasks is None else self.tasks

    @property
    def task_counts(self) -> np.ndarray:
        """(m,) each task's examples over all its nodes."""
        return np.bincount(self.task_of, weights=self.counts, minlength=self.m).astype(np.int64)

    @property
    def denom(self) -> np.ndarray:
        """(nodes,) n_t of each node's task: the divisor of the task's mean loss on every node that holds it."""
        return self.counts if self.tasks is None else self.task_counts[self.tasks]

    def to_tasks(self, a: np.ndarray) -> np.ndarray:
        """Rows per node -> rows per task (their sum)."""
        if self.tasks is None:
            return a
        out = np.zeros((self.m, *a.shape[1:]), dtype=a.dtype)
        np.add.at(out, self.tasks, a)
        return out

    def node_sigma(self, sigma: np.ndarray) -> np.ndarray:
        """Sigma between nodes: Sigma[tau(j), tau(k)] (rank <= m; W-step quantities per node read it)."""
        return sigma if self.tasks is None else sigma[np.ix_(self.tasks, self.tasks)]

    def shared(self, tasks: np.ndarray | list[int]) -> MTLData:
        """These rows as nodes holding the tasks ``tasks`` (node j holds task ``tasks[j]``)."""
        return MTLData(self.X, self.y, self.counts, np.asarray(tasks))

    @property
    def d(self) -> int:
        return self.X.shape[2]

    @property
    def mask(self) -> np.ndarray:
        return np.arange(self.X.shape[1])[None, :] < self.counts[:, None]

    @property
    def sqnorm(self) -> np.ndarray:
        return np.einsum("tnd,tnd->tn", self.X, self.X)

    @classmethod
    def from_federated(cls, data: FederatedData, split: str = "train") -> MTLData:
        """One task per seen client of ``data`` (2 classes: class 1 -> +1, class 0 -> -1), its ``split`` examples
        padded over tasks; features flattened and taken as float64."""
        if data.num_classes != 2:
            raise DataError(f"MOCHA's tasks are binary; {data.name} has {data.num_classes} classes")
        s = data.seen.splits()[split]
        counts = s.counts.numpy().astype(np.int64)
        if (counts == 0).any():
            raise DataError(f"{data.name}.{split}: tasks {np.flatnonzero(counts == 0)[:5].tolist()} have no examples")
        x = s.x.reshape(len(s.x), -1).to(torch.float64).numpy()
        y = np.where(s.y.numpy() > 0, 1.0, -1.0)
        m, nmax = len(counts), int(counts.max())
        X = np.zeros((m, nmax, x.shape[1]))
        Y = np.zeros((m, nmax))
        rows = np.repeat(np.arange(m), counts)
        cols = np.arange(len(y)) - np.repeat(s.offsets[:-1].numpy(), counts)
        X[rows, cols] = x
        Y[rows, cols] = y
        return cls(X, Y, counts)

    @classmethod
    def from_tasks(cls, xs: list[np.ndarray], ys: list[np.ndarray]) -> MTLData:
        """Tasks as (n_t, d) features and labels in {-1, +1} or {0, 1}: validated as a float64
        ``FederatedData`` (``FederatedData.from_arrays``), then padded (``from_federated``)."""
        if len(xs) != len(ys) or not xs:
            raise DataError(f"need as many label arrays as feature arrays (got {len(xs)} and {len(ys)}), >= 1")
        ys01 = []
        for t, y in enumerate(ys):
            y = np.asarray(y).ravel()
            if not np.isin(y, (-1, 1)).all() and not np.isin(y, (0, 1)).all():
                raise DataError(f"task {t}: labels must be in {{-1, +1}} or {{0, 1}}, found {np.unique(y)[:5]}")
            ys01.append((y > 0).astype(np.int64))
        for t, x in enumerate(xs):
            if np.asarray(x).ndim != 2:
                raise DataError(f"task {t}: features must be (n, d), got shape {np.asarray(x).shape}")
        empty = [(np.zeros((0, *np.asarray(x).shape[1:])), np.zeros(0, dtype=np.int64)) for x in xs]
        fd = FederatedData.from_arrays(list(zip(xs, ys01, strict=True)), empty, num_classes=2, dtype=torch.float64,
                                       name="tasks")
        return cls.from_federated(fd)

    def subset(self, keep: list[np.ndarray]) -> MTLData:
        """Per-node index arrays -> a new MTLData on the same nodes and tasks (used for CV folds and splits)."""
        xs = [self.X[t, k] for t, k in enumerate(keep)]
        out = MTLData.from_tasks(xs, [self.y[t, k] for t, k in enumerate(keep)])
        return out if self.tasks is None else out.shared(self.tasks)


def margins(data: MTLData, W: np.ndarray) -> np.ndarray:
    """(nodes, n_max) y_ti x_ti^T w_tau(t) (0 on padding); W has one row per task."""
    return data.y * np.einsum("tnd,td->tn", data.X, W if data.tasks is None else W[data.tasks])


def primal(data: MTLData, W: np.ndarray, omega: np.ndarray, lam: float, loss: Loss) -> float:
    per = (loss.primal(margins(data, W)) * data.mask).sum(1) / data.denom
    return float(per.sum() + 0.5 * lam * np.sum(omega * (W @ W.T)))


def dual_B(data: MTLData, beta: np.ndarray) -> np.ndarray:
    """(m, d) rows b_t = (1/n_t) X_t^T (beta_t * y_t), summed over the nodes of each task."""
    return data.to_tasks(np.einsum("tn,tnd->td", beta * data.y, data.X) / data.denom[:, None])


def dual(data: MTLData, beta: np.ndarray, sigma: np.ndarray, lam: float, loss: Loss) -> float:
    B = dual_B(data, beta)
    per = (-loss.conj(beta) * data.mask).sum(1) / data.denom
    return float(per.sum() - 0.5 / lam * np.sum(sigma * (B @ B.T)))


def w_of(B: np.ndarray, sigma: np.ndarray, lam: float) -> np.ndarray:
    return sigma @ B / lam


def error_rate(data: MTLData, W: np.ndarray) -> np.ndarray:
    """Per-task 0/1 error of sign(x^T w_t) over all the task's examples (a zero score counts as an error)."""
    wrong = (margins(data, W) <= 0) & data.mask
    return data.to_tasks(wrong.sum(1)) / data.task_counts
