"""IFCA: the iterative federated clustering algorithm.

Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated Learning", NeurIPS 2020,
Algorithm 2 (model averaging).

The server keeps k cluster models.  A sampled client evaluates every model on its training data, picks the one
with the lowest loss (its cluster estimate, re-estimated every round), runs ``run.local_epochs`` of local SGD
from it and sends the new model with its choice; the server averages, for each cluster, the models of the
clients that chose it, uniformly by client as the paper's model averaging does (``weighted = true``: by sample
counts, as FedAvg does); a cluster nobody chose keeps its model.  Every client, seen
or unseen, is evaluated with the model of lowest loss on its training data.  Model j starts from the
initializer seeded with seed + j, so model 0 is FedAvg's and IFCA with k = 1 is FedAvg (tested); the paper's
random restarts of the initialization are left to the user (run several seeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.stacking import apply_stacked
from ..optim import Batches, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, row


class ClusterModels(NamedTuple):
    """Server state: the k cluster models, stacked (k, ...)."""

    models: Params


class IFCAUpdate(NamedTuple):
    """What a client sends: its trained model and its cluster choice (one-hot (k,))."""

    params: Params
    choice: Tensor


@dataclass(frozen=True)
class IFCA(Algorithm[ClusterModels, tuple[()]]):
    """IFCA: k models; each client trains the one that fits its data best."""

    name: ClassVar[str] = "ifca"
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # evaluation picks the best model on the client's training data
    averages_updates: ClassVar[bool] = False
    #: k, the number of cluster models
    num_clusters: Annotated[int, Range(1, 256)] = 2
    #: average each cluster's models by sample count instead of uniformly by client (the paper)
    weighted: bool = False

    def init_server(self, ctx: Context, params: Params, seed: int) -> ClusterModels:
        dev = next(iter(params.values())).device
        models = [params] + [T.to(ctx.model.init(seed + j), dev) for j in range(1, self.num_clusters)]
        return ClusterModels(T.stack(models))

    def payload(self, server: ClusterModels) -> Params:
        return server.models

    def _best(self, ctx: Context, models: Params, batches: Batches, epochs: int) -> Tensor:
        x, y, mask = first_epoch(batches, epochs)
        # all k models in one stacked forward pass (one matrix product per layer for linear/mlp)
        losses = ctx.model.masked_mean(ctx.model.nll(apply_stacked(ctx.model, models, x), y), mask)  # (k,)
        return torch.argmin(losses)

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[IFCAUpdate, tuple[()], Tensor]:
        j = self._best(ctx, payload, batches, ctx.local_epochs)
        params, loss = local_sgd(ctx.model.value_and_grad, row(payload, j), batches, lr, ctx.opt)
        choice = torch.nn.functional.one_hot(j, self.num_clusters).to(torch.float64)
        return IFCAUpdate(params, choice), state, loss

    def aggregate(self, ctx: Context, server: ClusterModels, updates: IFCAUpdate, weights: Tensor,
                  clients: Tensor) -> ClusterModels:
        models = T.unstack(server.models, self.num_clusters)
        base = weights if self.weighted else (weights > 0).to(weights.dtype)  # by client: every valid update once
        for j in range(self.num_clusters):
            w = base * updates.choice[:, j].to(weights.device, weights.dtype)
            if float(w.sum()) > 0:
                models[j] = ctx.combine(updates.params, w)
        return ClusterModels(T.stack(models))

    def personalize(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        assert batches is not None
        return row(payload, self._best(ctx, payload, batches, self.adapt_epochs))
