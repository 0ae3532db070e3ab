"""Local training: every client trains its own model on its own data; nothing is communicated.

The baseline "Local" of Marfoq et al. (NeurIPS 2021) and Smith et al. (NeurIPS 2017).  All clients
start from the same initial model (as the FedEM reference code, whose learners share a seed).
Unseen clients never train, so they are evaluated with the initial model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ..optim import Batches, local_sgd
from ..tree import Tree
from .base import Algorithm, Context


@dataclass(frozen=True)
class Local(Algorithm):
    name: ClassVar[str] = "local"

    def payload(self, server: Tree) -> Tree:
        return {}

    def init_client(self, ctx: Context, server: Tree) -> Tree:
        return {"params": server["params"]}

    def client_update(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches, lr: float
    ) -> tuple[Tree, Tree, Tensor]:
        params, loss = local_sgd(ctx.model.value_and_grad, state["params"], batches, lr, ctx.opt)
        return {}, {"params": params}, loss

    def aggregate(
        self, ctx: Context, server: Tree, updates: Tree, weights: Tensor, clients: Tensor | None = None
    ) -> Tree:
        return server

    def personalize(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches | None, lr: float, seen: bool
    ) -> Tree:
        return state["params"]

    def upload_numel(self, ctx: Context, server: Tree) -> int:
        return 0
