"""Ditto: fair and robust federated learning through personalization.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021, Algorithm 1.

Global model w by FedAvg local SGD; every sampled client also trains its personal model v on
f(v) + lambda/2 ||v - w||^2 (w = the global model it received this round) with the same optimizer
over the same batches (``run.local_epochs`` passes), and is evaluated with v.  lambda = 0 makes v plain
local training (Local); lambda -> infinity pins v to w.  Unseen clients start v at the global model
and train it on their training data before testing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from ..optim import Batches, ClientBatches, local_sgd, local_sgd_clients
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel


class PersonalModel(NamedTuple):
    """Client state: the personal model v."""

    v: Params


@dataclass(frozen=True)
class Ditto(Algorithm[GlobalModel, PersonalModel]):
    name: ClassVar[str] = "ditto"
    loss_label: ClassVar[str] = "global loss"  # the loss reported is the global model's (w), not the personal v's
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True
    keeps_client_state: ClassVar[bool] = True
    #: lambda, the pull of each personal model v towards the global model (0 = local training)
    lam: Annotated[float, Range(0, 1e4)] = 0.1

    def init_client(self, ctx: Context, server: GlobalModel) -> PersonalModel:
        return PersonalModel(server.params)

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalModel, batches: Batches, lr: float
    ) -> tuple[Params, PersonalModel, Tensor]:
        w, loss = local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt)
        v, _ = local_sgd(ctx.model.value_and_grad, state.v, batches, lr, ctx.opt, prox_center=payload,
                         prox_mu=self.lam)
        return w, PersonalModel(v), loss

    def client_update_clients(
        self, ctx: Context, payload: Params, states: PersonalModel, batches: ClientBatches, lr: float
    ) -> tuple[Params, PersonalModel, Tensor]:
        w, loss = local_sgd_clients(ctx.model, payload, batches, lr, ctx.opt)
        v, _ = local_sgd_clients(ctx.model, states.v, batches, lr, ctx.opt, prox_center=payload, prox_mu=self.lam)
        return w, PersonalModel(v), loss

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalModel, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return state.v
        assert batches is not None
        return local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt, prox_center=payload,
                         prox_mu=self.lam)[0]
