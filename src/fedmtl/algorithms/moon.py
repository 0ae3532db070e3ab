"""MOON: model-contrastive federated learning.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, Algorithm 1.

FedAvg whose local loss adds a model-contrastive term on representations z = R_w(x) (``Model.features``, the
head's input; the paper's networks add a projection head, which the built-in models do not have):

    l = CE(w; x, y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) ),

with sim the cosine similarity, z_glob the representation under the received global model and z_prev under the
client's model of its previous round (kept as its state; the initial model before its first round).  The server
averages the models weighted by sample counts.  With mu = 0 MOON is FedAvg (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.base import Model
from ..models.parts import value_and_grad_of
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, Toy


class PreviousModel(NamedTuple):
    """Client state: the client's local model of its previous round."""

    params: Params


@dataclass(frozen=True)
class Moon(Algorithm[GlobalModel, PreviousModel]):
    """MOON: local training pulls each representation towards the global model's and away from the last local one."""

    name: ClassVar[str] = "moon"
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True
    #: mu, the weight of the model-contrastive loss (0 = FedAvg; the paper tunes it in {0.1, 1, 5, 10}, Sec. 4.2)
    mu: Annotated[float, Range(0, 1e4)] = 1.0
    #: tau, the temperature of the contrastive loss
    temperature: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.5

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def init_client(self, ctx: Context, server: GlobalModel) -> PreviousModel:
        return PreviousModel(server.params)

    def client_update(
        self, ctx: Context, payload: Params, state: PreviousModel, batches: Batches, lr: float
    ) -> tuple[Params, PreviousModel, Tensor]:
        model, tau, mu = ctx.model, self.temperature, self.mu

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            if mu == 0:
                return model.value_and_grad(p, x, y, mask)
            z_glob = model.features(payload, x).detach()
            z_prev = model.features(state.params, x).detach()
            m = mask.to(z_glob.dtype)

            def loss(q: Params) -> Tensor:
                z = model.features(q, x)
                ce = model.nll(model.apply_head(q, z), y)
                pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
                neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
                con = -(pos - torch.logsumexp(torch.stack([pos, neg]), dim=0))
                return ((ce + mu * con) * m).sum() / m.sum().clamp_min(1.0)

            return value_and_grad_of(loss, p)

        params, loss = local_sgd(grad_fn, payload, batches, lr, ctx.opt)
        return params, PreviousModel(params), loss
