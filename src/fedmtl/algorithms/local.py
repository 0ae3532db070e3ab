"""Local training: every client trains its own model on its own data; nothing is communicated.

The baseline "Local" of Marfoq et al. (NeurIPS 2021) and Smith et al. (NeurIPS 2017).  All clients
start from the same initial model (as the FedEM reference code, whose learners share a seed).
Unseen clients never train, so they are evaluated with the initial model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from ..optim import Batches, local_sgd
from ..tree import Params
from .base import Algorithm, Context, GlobalModel


class LocalModel(NamedTuple):
    """Client state: the client's own model."""

    params: Params


@dataclass(frozen=True)
class Local(Algorithm[GlobalModel, LocalModel]):
    name: ClassVar[str] = "local"
    supports_batch_norm: ClassVar[bool] = True
    averages_updates: ClassVar[bool] = False
    keeps_client_state: ClassVar[bool] = True

    def payload(self, server: GlobalModel) -> Params:
        return {}

    def init_client(self, ctx: Context, server: GlobalModel) -> LocalModel:
        return LocalModel(server.params)

    def client_update(
        self, ctx: Context, payload: Params, state: LocalModel, batches: Batches, lr: float
    ) -> tuple[Params, LocalModel, Tensor]:
        params, loss = local_sgd(ctx.model.value_and_grad, state.params, batches, lr, ctx.opt)
        return {}, LocalModel(params), loss

    def aggregate(self, ctx: Context, server: GlobalModel, updates: Params, weights: Tensor,
                  clients: Tensor) -> GlobalModel:
        return server

    def personalize(
        self, ctx: Context, payload: Params, state: LocalModel, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        return state.params
