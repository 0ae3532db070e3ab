"""FedDyn: federated learning based on dynamic regularization.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, ICLR 2021, Algorithm 1.

Client k keeps the gradient state h_k (zero at first).  A sampled client solves
theta_k = argmin L_k(theta) - <h_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2 by ``run.local_epochs`` of local
SGD from the server model, then h_k <- h_k - alpha (theta_k - theta^{t-1}), and sends theta_k.  Server:
h <- h - (alpha / m) sum_{k in P_t} (theta_k - theta^{t-1})  (m = all clients),
theta^t = mean_{k in P_t} theta_k - h / alpha.  The mean is uniform (the paper); ``weighted = true`` weights it
by sample counts.  With alpha = 0 the regularizers vanish, h stays 0 (the h / alpha term is taken as 0) and
FedDyn is FedAvg (tested with ``weighted = true``).  Evaluation uses the server model theta^t (the paper
reports the mean of the active clients' models as its "cloud model"; theta^t is what the next round sends).

The paper's local solver is plain SGD, and so is the bundled config's (``configs/synthetic/feddyn.toml``).  FedDyn
and heavy-ball momentum interact: the linear term -<h_k, theta> enters every step's gradient, and momentum
carries it over steps.  A run with ``optim.momentum > 0`` logs a warning.  Alpha matters more than the solver.
Measured on the FedEM synthetic data (200 rounds, lr 0.1 decayed at rounds 100 and 150), test accuracy:

| alpha | momentum 0 | momentum 0.9 |
|---|---|---|
| 0.1 | 69.07 | 69.05 |
| 0.01 | 39.66 | 68.07 |

With alpha = 0.01 and plain SGD the server model collapses in the last rounds (training accuracy 0.70 at round
100, 0.40 at round 200).  theta^t = mean - h / alpha, and h / alpha accumulates every round's drift with weight 1
whatever alpha is, while the prox term alpha / 2 ||theta - theta^{t-1}||^2 that restrains the drift shrinks with
alpha.  Use alpha >= 0.1 there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from .. import tree as T
from ..optim import SGD, Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, nobody

log = logging.getLogger("fedmtl")


class DynServer(NamedTuple):
    """Server state: the model theta and the server's gradient state h."""

    params: Params
    h: Params


class GradState(NamedTuple):
    """Client state: h_k, the gradient of the client's loss at its last model."""

    h: Params


@dataclass(frozen=True)
class FedDyn(Algorithm[DynServer, GradState]):
    """FedDyn: each local objective is corrected by a linear term and a proximal term so that its stationary
    points agree with the global objective's."""

    name: ClassVar[str] = "feddyn"
    keeps_client_state: ClassVar[bool] = True
    #: alpha, the weight of the dynamic regularizer (0 = FedAvg; the authors' reference code runs 0.01)
    alpha: Annotated[float, Range(0, 1e3)] = 0.1
    #: weight the server mean by sample counts instead of uniformly (the paper)
    weighted: bool = False

    def check_optim(self, opt: SGD) -> None:
        if opt.momentum > 0:
            log.warning("feddyn with optim.momentum = %g: the paper's FedDyn runs plain local SGD (momentum 0); "
                        "momentum carries the dynamic regularizer's linear term over steps (see fedmtl.algorithms."
                        "feddyn)", opt.momentum)

    def init_server(self, ctx: Context, params: Params, seed: int) -> DynServer:
        return DynServer(params, T.zeros_like(params))

    def payload(self, server: DynServer) -> Params:
        return server.params

    def init_client(self, ctx: Context, server: DynServer) -> GradState:
        return GradState(T.zeros_like(server.params))

    def client_update(
        self, ctx: Context, payload: Params, state: GradState, batches: Batches, lr: float
    ) -> tuple[Params, GradState, Tensor]:
        theta, loss = local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt, prox_center=payload,
                                prox_mu=self.alpha, grad_shift=T.scale(state.h, -1.0))
        h = T.tmap(lambda hk, t, w: hk - self.alpha * (t - w), state.h, theta, payload)
        return theta, GradState(h), loss

    def aggregate(self, ctx: Context, server: DynServer, updates: Params, weights: Tensor,
                  clients: Tensor) -> DynServer:
        ok = weights > 0
        if nobody(ctx, weights):
            return server
        mean = ctx.combine(updates, weights if self.weighted else ok.to(weights.dtype))
        if self.alpha == 0:
            return DynServer(mean, server.h)
        if ctx.private:
            # under [privacy] h must come from the released (noised) quantities only: the noised mean is
            # theta + (sum of clipped deviations + noise) / D, so (1/m) sum_{P_t}(theta_k - theta) is estimated by
            # (D / m)(mean - theta); neither the participants nor their count enter (the plain mean of the updates
            # and |P_t| would be released without noise)
            drift, share = T.sub(mean, server.params), ctx.dp_denominator / ctx.num_clients
        else:
            drift = T.sub(T.weighted_mean(updates, ok.to(weights.dtype)), server.params)  # mean_{P_t}(theta_k - theta)
            share = float(ok.sum()) / ctx.num_clients
        h = T.tmap(lambda hh, d: hh - self.alpha * share * d, server.h, drift)
        return DynServer(T.tmap(lambda m, hh: m - hh / self.alpha, mean, h), h)
