"""MOCHA on the round engine: federated multi-task learning with a task-relationship matrix Omega.

Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017, Algorithm 1, in the scaling
of ``fedmtl.mtl.problem`` (per-task mean hinge or squared-hinge loss + (lam/2) tr(W Omega W^T)); one task per
client, binary labels (class 1 = +1, class 0 = -1), a linear model without bias (``[model] name = "linear"``,
``bias = false``; add a constant feature for an intercept).

* **W-step** (``client_update``, one node): node t keeps its dual variables beta_t (never sent) and receives
  w_t and q_t = sigma'_t Sigma_tt / lam.  It runs SDCA coordinate steps on its data-local quadratic
  subproblem, visiting its examples in the round's random order, for as many steps as its device allows
  (``local_frac * n_t``; a straggler of ``[systems]`` does a fraction, a dropped node none: theta = 1) and
  sends db_t = (1/n_t) X_t^T (d_beta_t * y_t).  Steps are processed in chunks whose Gram matrix carries the
  local model's change, as ``fedmtl.mtl.mocha.sdca_local`` does.  The node keeps beta_t + gamma d_beta_t.
* **Aggregation** (``aggregate``): B += gamma dB over the nodes that answered, W = Sigma B / lam
  (``reference_w_update = true``: W += gamma Sigma dB / lam, the reference MATLAB code's stale update).
* **Omega-step** (server, every ``omega_every`` rounds and after the last round, as Algorithm 1 and
  ``fedmtl.mtl.mocha.solve``): the regularizer's closed form or, for ``graphical`` (eq. 15), scikit-learn's
  graphical lasso (``fedmtl.mtl.omega``), then sigma' (Lemma 9, or per task: Remark 5) and W = W(beta) with
  the new Sigma.  The last round's Omega-step needs the run's length (``ctx.rounds``); a run of unknown
  length steps only every ``omega_every`` rounds.

``fedmtl.mtl`` keeps the float64 reference solver (and the CoCoA / Mb-SDCA / Mb-SGD baselines); this module is
the same method on the engine (executors, systems, checkpoints, Flower), tested to reach the reference
solver's primal objective.  Unseen clients (not part of MOCHA's problem) predict with the mean of the tasks'
models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mtl.omega import build as build_regularizer
from ..mtl.omega import sigma_prime
from ..optim import Batches, first_epoch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, row


class MochaServer(NamedTuple):
    """B (m, d): rows b_t = (1/n_t) X_t^T (beta_t y_t); W = Sigma B / lam; Omega, Sigma = Omega^-1; q (m,)."""

    B: Tensor
    W: Tensor
    omega: Tensor
    sigma: Tensor
    q: Tensor
    round: Tensor  # () long


class MochaPayload(NamedTuple):
    W: Tensor  # (m, d): node t reads row t
    q: Tensor  # (m,) sigma'_t Sigma_tt / lam


class MochaClient(NamedTuple):
    id: Tensor  # () long: the node's task
    beta: Tensor  # (n_max,) float64 duals (label-free form), indexed by the node's example index


def _coordinate(loss: str, beta: Tensor, margin: Tensor, curv: Tensor) -> Tensor:
    """argmax_b -phi(b) - (b - beta) margin - curv (b - beta)^2 / 2: one SDCA step (``mtl.problem.Loss``)."""
    if loss == "hinge":
        step = torch.where(curv > 0, (1.0 - margin) / torch.where(curv > 0, curv, torch.ones_like(curv)),
                           torch.zeros_like(margin))
        return torch.clamp(beta + step, 0.0, 1.0)
    return torch.clamp_min(beta + (1.0 - margin - beta / 2.0) / (0.5 + curv), 0.0)


def _primal_loss(loss: str, margin: Tensor) -> Tensor:
    hinge = torch.clamp_min(1.0 - margin, 0.0)
    return hinge if loss == "hinge" else hinge * hinge


@dataclass(frozen=True)
class Mocha(Algorithm[MochaServer, MochaClient]):
    name: ClassVar[str] = "mocha"
    toy: ClassVar[Toy] = Toy({"lam": 0.01, "omega_every": 2}, model="linear_nobias")
    averages_updates: ClassVar[bool] = False
    keeps_client_state: ClassVar[bool] = True
    #: lambda, the weight of the task-relationship regularizer
    lam: Annotated[float, Range(0, 1e6, lo_open=True)] = 1e-3
    #: hinge or squared_hinge (the SDCA dual form of each)
    loss: Literal["hinge", "squared_hinge"] = "hinge"
    #: Omega's form: identity, mean (shared mean), task_covariance (learned, eq. 14), cluster, graphical (eq. 15)
    regularizer: Literal["identity", "mean", "task_covariance", "cluster", "graphical"] = "task_covariance"
    #: mean: the ridge eta; cluster: the relaxation's eta; graphical: eq. 15's 1/sigma^2 ridge on W
    eta: Annotated[float, Range(0, 1e6)] = 0.1
    #: graphical: the graphical lasso's l1 weight alpha (eq. 15's lambda_2 = alpha lam d / 2)
    sparsity: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.1
    #: cluster: the number of task clusters k
    clusters: Annotated[int, Range(1, 1000)] = 2
    #: W-step rounds between two Omega steps
    omega_every: Annotated[int, Range(1, 10**7)] = 100
    #: SDCA coordinate steps per round, as a fraction of the node's examples
    local_frac: Annotated[float, Range(0, 100, lo_open=True)] = 0.5
    #: the aggregation parameter gamma of the dual update (1 = adding)
    gamma: Annotated[float, Range(0, 1, lo_open=True)] = 1.0
    #: sigma' of the local subproblems: global (one for all tasks) or per_task
    sigma_mode: Literal["global", "per_task"] = "global"
    #: W += gamma Sigma dB / lam, the reference MATLAB code's stale update (the paper: W = Sigma B / lam)
    reference_w_update: bool = False
    #: SDCA steps per Gram-matrix chunk (speed only, results unchanged)
    chunk: Annotated[int, Range(1, 10**5)] = 64

    def _reg(self, m: int):  # type: ignore[no-untyped-def]
        return build_regularizer(self.regularizer, m, self.eta, self.clusters, alpha=self.sparsity)

    def _q(self, sigma: Tensor) -> Tensor:
        sp = sigma_prime(sigma.cpu().numpy(), self.gamma, self.sigma_mode == "per_task")
        return torch.as_tensor(sp, dtype=torch.float64) * torch.diagonal(sigma).cpu() / self.lam

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> MochaServer:
        w = params.get("weight")
        if w is None or w.dim() != 2 or w.shape[0] != 1:
            raise ValueError("algorithm 'mocha' trains binary linear models: use [model] name = \"linear\" "
                             "(bias = false) on data with 2 classes")
        m, d = ctx.num_clients, w.shape[1]
        omega, sigma = (torch.as_tensor(a, dtype=torch.float64) for a in self._reg(m).init(m))
        dev = w.device
        zeros = torch.zeros(m, d, dtype=torch.float64, device=dev)
        return MochaServer(zeros, zeros.clone(), omega.to(dev), sigma.to(dev), self._q(sigma).to(dev),
                           torch.zeros((), dtype=torch.long, device=dev))

    def payload(self, server: MochaServer) -> MochaPayload:
        return MochaPayload(server.W, server.q)

    def aggregate(self, ctx: Context, server: MochaServer, updates: Tensor, weights: Tensor,
                  clients: Tensor) -> MochaServer:
        ok = torch.nonzero(weights > 0).flatten()
        ids = clients.to(ok.device)[ok]
        dB = updates.index_select(0, ok).to(torch.float64)
        B = server.B.index_add(0, ids, self.gamma * dB)
        if self.reference_w_update:  # the reference code: W += gamma Sigma dB / lam, kept across Omega-steps
            W = server.W + self.gamma * (server.sigma[:, ids] @ dB) / self.lam
        else:
            W = server.sigma @ B / self.lam
        rnd = int(server.round) + 1
        omega, sigma, q = server.omega, server.sigma, server.q
        reg = self._reg(ctx.num_clients)
        if reg.learns and (rnd % self.omega_every == 0 or rnd == ctx.rounds):  # Algorithm 1: and after the last
            o, s = reg.step(W.cpu().numpy(), omega.cpu().numpy())
            omega, sigma = (torch.as_tensor(a, dtype=torch.float64, device=W.device) for a in (o, s))
            q = self._q(sigma).to(W.device)
            if not self.reference_w_update:
                W = sigma @ B / self.lam
        return MochaServer(B, W, omega, sigma, q, torch.tensor(rnd, device=server.round.device))

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: MochaServer, ids: Tensor) -> MochaClient:
        return MochaClient(ids.clone(), torch.zeros(len(ids), max(ctx.max_train, 1), dtype=torch.float64))

    def step_budget(self, counts: Tensor, batch_size: int, epochs: int) -> Tensor:
        return torch.clamp(torch.floor(self.local_frac * counts.double() + 1e-9), min=1).long()

    def client_update(
        self, ctx: Context, payload: MochaPayload, state: MochaClient, batches: Batches, lr: float
    ) -> tuple[Tensor, MochaClient, Tensor]:
        x, y, mask = first_epoch(batches, ctx.local_epochs)  # (L, ...): the real examples first, in random order
        s0 = len(batches.x) // ctx.local_epochs
        assert batches.idx is not None, "MOCHA reads each example's index (Batches.idx)"
        idx = torch.cat(batches.idx[:s0]) if isinstance(batches.idx, list) else batches.idx[:s0].reshape(-1)
        xs = x.reshape(x.shape[0], -1).to(torch.float64)  # (L, d)
        ys = (2.0 * y.to(torch.float64) - 1.0) * mask.to(torch.float64)  # +-1, 0 on padding
        n = batches.n.to(torch.float64)
        w = row(payload.W, state.id)  # (d,)
        q = row(payload.q, state.id)
        steps = batches.limit if batches.limit is not None else n.long()
        sq = (xs * xs).sum(-1)
        total = max(1, math.ceil(self.local_frac * xs.shape[0]))  # a static bound on any node's steps
        beta = state.beta
        dbeta = torch.zeros_like(beta)
        dB = torch.zeros_like(w)
        slots = torch.arange(beta.shape[0], device=beta.device)
        for c0 in range(0, total, self.chunk):
            c1 = min(total, c0 + self.chunk)
            pos = torch.remainder(torch.arange(c0, c1, device=xs.device), n.long().clamp_min(1))  # cyclic order
            xc, yc, sqc, ic = (t.index_select(0, pos) for t in (xs, ys, sq, idx))
            base = xc @ (w + q * dB)  # margins before this chunk's steps
            qgram = q * (xc @ xc.T)  # later margins see the local model's change through the Gram matrix
            curv = q * sqc / n
            coefs = []
            for j in range(c1 - c0):
                act = (c0 + j) < steps
                i = ic[j].reshape(1)
                b_old = (beta + dbeta).index_select(0, i).squeeze(0)
                delta = _coordinate(self.loss, b_old, yc[j] * base[j], curv[j]) - b_old
                delta = torch.where(act, delta, torch.zeros_like(delta))
                # one coordinate of dbeta moves (torch.where: a fraction of index_add's time under vmap, same sums)
                dbeta = dbeta + torch.where(slots == i, delta, torch.zeros_like(delta))
                cj = delta * yc[j] / n
                coefs.append(cj)
                base = base + cj * qgram[j]
            dB = dB + torch.stack(coefs) @ xc
        loss = (_primal_loss(self.loss, ys * (xs @ w)) * mask).sum() / n
        return dB, MochaClient(state.id, beta + self.gamma * dbeta), loss.to(torch.float32)

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(self, ctx: Context, payload: MochaPayload, state: MochaClient, batches: Batches | None,
                    lr: float, seen: bool) -> Tensor:
        return row(payload.W, state.id) if seen else payload.W.mean(0)

    def predict_log_proba(self, ctx: Context, eval_state: Tensor, x: Tensor) -> Tensor:
        """Class probabilities sigmoid(-+ x^T w_t): the SVM's margin through the logistic link (accuracy is
        the sign rule; the reported loss is that link's log-loss, not the hinge loss being minimized)."""
        margin = x.reshape(x.shape[0], -1).to(torch.float64) @ eval_state
        return torch.stack([F.logsigmoid(-margin), F.logsigmoid(margin)], -1).to(torch.float32)
