"""SCAFFOLD: stochastic controlled averaging for federated learning.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020, Algorithm 1 (option II control variates).

Server: model x and control variate c; client i: its control variate c_i (kept across rounds, zero at first).
A sampled client runs local SGD from x with every gradient corrected by (c - c_i), K steps of rate eta_l
(the round's learning rate; K = the steps it actually ran), ending at y_i; then
c_i+ = c_i - c + (x - y_i) / (K eta_l) (option II), and it sends (y_i - x, c_i+ - c_i).  Server:
x <- x + eta_g mean(y_i - x),  c <- c + (1/N) sum_i (c_i+ - c_i) over the clients that took part (N = all
clients).  The paper's mean over the sample is uniform; ``weighted = true`` weights the model step by sample
counts as FedAvg does here.  Option II divides the displacement by K eta_l, the sum of the weights plain SGD
gives its K (corrected) gradients.  With heavy-ball momentum beta in ``[optim]`` (the buffer restarted each round)
step t moves by eta_l sum_{s<=t} beta^(t-s) g_s, so gradient s enters x - y_i with weight (1 - beta^(K-s+1)) /
(1 - beta); the paper's formula, dividing by K eta_l, then overestimates the average gradient by up to 1 / (1 - beta)
(10x at 0.9) and c_i grows round after round until the run diverges.  Here
the displacement is divided by eta_l times the sum of those weights (``momentum_weight_sum``): c_i+ is the
momentum-weighted average of the path's gradients, exactly the gradient where it is constant, and option II as
the paper states it where beta = 0.  (A deviation for beta > 0, which the paper does not treat.)  Weight decay
enters the gradients, so c_i then estimates the gradient of the decayed loss.  In the first round (all control
variates zero) SCAFFOLD is FedAvg (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, live_steps, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy


class ScaffoldServer(NamedTuple):
    """Server state: the global model x and the server control variate c."""

    params: Params
    c: Params


class ScaffoldPayload(NamedTuple):
    params: Params
    c: Params


class ControlVariate(NamedTuple):
    """Client state: the client's control variate c_i."""

    c: Params


class ScaffoldUpdate(NamedTuple):
    """What a client sends: its model step y_i - x and its control-variate step c_i+ - c_i."""

    delta: Params
    dc: Params


def momentum_weight_sum(k: Tensor, beta: float) -> Tensor:
    """The total weight K heavy-ball steps give their gradients in the displacement: sum_{j=1..K} (1 - beta^j) /
    (1 - beta) = (K - beta (1 - beta^K) / (1 - beta)) / (1 - beta); K where beta = 0."""
    if beta == 0:
        return k
    return (k - beta * (1 - beta ** k) / (1 - beta)) / (1 - beta)


@dataclass(frozen=True)
class Scaffold(Algorithm[ScaffoldServer, ControlVariate]):
    """SCAFFOLD: local SGD corrected by control variates that estimate each client's drift."""

    name: ClassVar[str] = "scaffold"
    # the toy task: momentum makes the control-variate correction unstable (the paper: plain SGD)
    toy: ClassVar[Toy] = Toy(sgd_lr=0.1)
    keeps_client_state: ClassVar[bool] = True
    averages_updates: ClassVar[bool] = False  # the updates are steps, not models: robust aggregators do not apply
    #: eta_g, the server's step on the mean model update (1 = replace by the average)
    server_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0
    #: weight the model step by sample counts (as FedAvg here) instead of uniformly (the paper)
    weighted: bool = False

    def init_server(self, ctx: Context, params: Params, seed: int) -> ScaffoldServer:
        return ScaffoldServer(params, T.zeros_like(params))

    def payload(self, server: ScaffoldServer) -> ScaffoldPayload:
        return ScaffoldPayload(server.params, server.c)

    def init_client(self, ctx: Context, server: ScaffoldServer) -> ControlVariate:
        return ControlVariate(T.zeros_like(server.params))

    def client_update(
        self, ctx: Context, payload: ScaffoldPayload, state: ControlVariate, batches: Batches, lr: float
    ) -> tuple[ScaffoldUpdate, ControlVariate, Tensor]:
        x = payload.params
        y, loss = local_sgd(ctx.model.value_and_grad, x, batches, lr, ctx.opt, grad_shift=T.sub(payload.c, state.c))
        k = live_steps(batches).sum().to(torch.float32)
        inv = torch.where(k > 0, 1.0 / (momentum_weight_sum(k.clamp_min(1.0), ctx.opt.momentum) * lr), torch.zeros(()))
        # option II: c_i+ = c_i - c + (x - y) / (K lr) (K: the momentum-weighted step count, see the module
        # docstring); a client that ran no step keeps its c_i
        c_new = T.tmap(lambda ci, c, xi, yi: torch.where(k > 0, ci - c + (xi - yi) * inv, ci), state.c, payload.c, x, y)
        return ScaffoldUpdate(T.sub(y, x), T.sub(c_new, state.c)), ControlVariate(c_new), loss

    def aggregate(self, ctx: Context, server: ScaffoldServer, updates: ScaffoldUpdate, weights: Tensor,
                  clients: Tensor) -> ScaffoldServer:
        ok = weights > 0
        if not bool(ok.any()):
            return server
        w = weights if self.weighted else ok.to(weights.dtype)
        step = ctx.combine(updates.delta, w)
        total_dc = T.scale(T.weighted_mean(updates.dc, ok.to(weights.dtype)), float(ok.sum()) / ctx.num_clients)
        return ScaffoldServer(T.tmap(lambda p, d: p + self.server_lr * d, server.params, step),
                              T.add(server.c, total_dc))

    def personalize(
        self, ctx: Context, payload: ScaffoldPayload, state: ControlVariate, batches: Batches | None, lr: float,
        seen: bool
    ) -> Params:
        return payload.params
