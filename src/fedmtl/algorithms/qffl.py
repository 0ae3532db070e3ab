"""q-FFL / q-FedAvg: fair resource allocation in federated learning.

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020, objective (2) and
Algorithm 2 (q-FedAvg).

q-FFL minimizes f_q(w) = sum_k p_k F_k(w)^(q+1) / (q+1): q = 0 is the usual weighted loss (FedAvg's objective),
larger q weighs the clients with a high loss more, for a more uniform accuracy across clients.  q-FedAvg: a sampled
client k evaluates F_k at the received w (its training data, before training), runs local SGD to w_k and sends

    Delta_k = F_k(w)^q * L (w - w_k),        h_k = q F_k(w)^(q-1) ||L (w - w_k)||^2 + L F_k(w)^q

with L = 1 / lr (the paper's Lipschitz estimate, Section 4.2: L (w - w_k) stands for a gradient); the server
steps w <- w - sum_k Delta_k / sum_k h_k.  The paper samples clients with probability p_k and sums uniformly; here
each client's Delta_k and h_k are weighted by its examples n_k over the clients that answered, the same in
expectation, so q = 0 is exactly FedAvg at every sampling rate (tested).  ``lipschitz`` > 0 sets L instead of
1 / lr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, scalar_mean


class QUpdate(NamedTuple):
    """What a client sends: Delta_k (shaped like the model) and h_k (a scalar)."""

    delta: Params
    h: Tensor


@dataclass(frozen=True)
class QFFL(Algorithm[GlobalModel, tuple[()]]):
    """q-FedAvg: local SGD; the server takes a step on the q-reweighted changes, normalized by the clients' h_k."""

    name: ClassVar[str] = "qffl"
    averages_updates: ClassVar[bool] = False  # the server divides two sums: robust aggregators and DP do not apply
    #: the fairness exponent q (0 = FedAvg; the paper uses 0.001 to 15 depending on the data)
    q: Annotated[float, Range(0, 1e3)] = 1.0
    #: L, the Lipschitz estimate of the gradients (0 = 1 / lr, the paper's choice)
    lipschitz: Annotated[float, Range(0, 1e6)] = 0.0

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[QUpdate, tuple[()], Tensor]:
        x, y, mask = first_epoch(batches, ctx.local_epochs)
        f = ctx.model.loss(payload, x, y, mask).detach().clamp_min(1e-10)  # F_k(w) on the client's data
        new, loss = local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt)
        # lr = 0 only when the update's structure is probed (no step is taken): any finite L will do there
        big_l = self.lipschitz or (1.0 / lr if lr > 0 else 1.0)
        dw = T.tmap(lambda w, wk: big_l * (w - wk), payload, new)  # L (w - w_k)
        sq = sum((v.to(torch.float64) ** 2).sum() for v in T.leaves(dw))
        fq = f.to(torch.float64) ** self.q
        h = self.q * f.to(torch.float64) ** (self.q - 1) * sq + big_l * fq
        return QUpdate(T.tmap(lambda v: (fq * v).to(v.dtype), dw), h.to(torch.float32)), state, loss

    def update_like(self, ctx: Context, payload: Params) -> QUpdate:
        return QUpdate(payload, torch.zeros(()))

    def aggregate(self, ctx: Context, server: GlobalModel, updates: QUpdate, weights: Tensor,
                  clients: Tensor) -> GlobalModel:
        if not bool((weights > 0).any()):
            return server
        delta = ctx.combine(updates.delta, weights)  # sum_k p_k Delta_k / sum_k p_k
        mean_h = scalar_mean(updates.h, weights)  # sum_k p_k h_k / sum_k p_k
        return GlobalModel(T.tmap(lambda p, d: p - (d.to(torch.float64) / mean_h).to(p.dtype), server.params, delta))
