"""FedALA: adaptive local aggregation for personalized federated learning.

Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
AAAI 2023, Algorithm 1.

Server: FedAvg.  Client i keeps its local model theta_i and element-wise aggregation weights W_i in [0, 1] (ones at
first).  On receiving the global model Theta, instead of overwriting its model it initializes

    theta^ = Theta on the lower layers,   theta^ = theta_i + (Theta - theta_i) * W_i on the higher layers

(the higher layers: the model's head, ``Model.head``), learns W_i by projected gradient steps
W_i <- clip(W_i - eta grad_W L(theta^), 0, 1) on a random ``rand_percent`` share of its batches (the gradient
is the head's gradient times (Theta - theta_i)), then trains theta^ for ``run.local_epochs`` epochs, keeps the
result as theta_i and sends it.  A client's first round has no local model (theta_i = Theta, W has no effect);
in its second, W is trained for ``ala_first_steps`` steps (the paper: until the loss settles), afterwards for
one pass over the sampled batches.  Seen clients are evaluated with their local model theta_i, unseen ones with
the global model.  Deviation: the paper's convergence test in the first adaptation is a fixed step count here
(a fixed number of steps keeps the client vmap-safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.base import Model
from ..optim import Batches, live_steps, local_sgd, pick_batch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, Toy


class ALAState(NamedTuple):
    """Client state: the local model, the aggregation weights of the head, and the rounds taken part in."""

    local: Params
    weights: Params
    rounds: Tensor


@dataclass(frozen=True)
class FedALA(Algorithm[GlobalModel, ALAState]):
    """FedALA: each client mixes the global model into its own element-wise, with weights it learns."""

    name: ClassVar[str] = "fedala"
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True
    #: eta, the step size of the aggregation weights
    eta: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0
    #: share of a client's batches (%) used to learn the weights each round
    rand_percent: Annotated[float, Range(0, 100, lo_open=True)] = 80.0
    #: steps of weight learning in a client's first adaptation (its second round)
    ala_first_steps: Annotated[int, Range(1, 10**4)] = 20

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def init_client(self, ctx: Context, server: GlobalModel) -> ALAState:
        head = ctx.model.split(server.params, self.name)[1]
        return ALAState(server.params, T.tmap(torch.ones_like, head), torch.zeros((), dtype=torch.long))

    def client_update(
        self, ctx: Context, payload: Params, state: ALAState, batches: Batches, lr: float
    ) -> tuple[Params, ALAState, Tensor]:
        model = ctx.model
        started = state.rounds > 0
        local = T.tmap(lambda a, b: torch.where(started, a, b), state.local, payload)
        _, head_g = model.split(payload, self.name)
        _, head_l = model.split(local, self.name)
        diff = T.sub(head_g, head_l)

        def mixed(w: Params) -> Params:
            return {**payload, **{k: head_l[k] + diff[k] * w[k] for k in w}}

        n_live = live_steps(batches).sum()
        share = torch.ceil(n_live.to(torch.float32) * self.rand_percent / 100).to(torch.long)
        budget = torch.where(state.rounds == 1, torch.tensor(self.ala_first_steps), share)
        most = max(self.ala_first_steps, math.ceil(len(batches.x) * self.rand_percent / 100))
        w = state.weights
        for s in range(most):
            g, _ = model.value_and_grad(mixed(w), *pick_batch(batches, s))
            new = {k: (w[k] - self.eta * g[k] * diff[k]).clamp(0.0, 1.0) for k in w}
            active = started & (torch.tensor(s) < budget)
            w = {k: torch.where(active, new[k], w[k]) for k in w}
        params, loss = local_sgd(model.value_and_grad, mixed(w), batches, lr, ctx.opt)
        return params, ALAState(params, w, state.rounds + 1), loss

    def personalize(
        self, ctx: Context, payload: Params, state: ALAState, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if not seen:
            return payload
        return T.tmap(lambda a, b: torch.where(state.rounds > 0, a, b), state.local, payload)
