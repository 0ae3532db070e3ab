"""Clustered Federated Learning (CFL).

Sattler, Mueller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask
Optimization Under Privacy Constraints", IEEE TNNLS 2020 (arXiv 1910.01991), Algorithm 1.

The server keeps one model per cluster (stacked, so the vmap runner trains every client from its own
cluster's model in one batched computation) and each client's cluster id.  A client runs local SGD
from theta_c and returns dtheta_i.  Per cluster c: dtheta_c = sum_i n_i dtheta_i / sum_i n_i (paper;
the demo code uses the plain mean).  Split test: if ||dtheta_c|| < eps1 (the cluster is near a
stationary point of its joint objective) and max_i ||dtheta_i|| > eps2 (some clients still are not),
and the cluster has more than ``min_cluster_size`` clients and the round is past ``warmup_rounds``
(the demo's guards), the cluster is bipartitioned by complete-linkage clustering on the cosine
similarities of its clients' updates (which minimizes the largest cross-cluster similarity); both
halves continue from the parent model theta_c + dtheta_c.  Every client is evaluated with its
cluster's model.  The paper's final step (each client picks the best model from its cache on its
validation data) is left out.  Unseen clients use the cluster model with the lowest loss on their
training data (the reference code does not support unseen clients).  Splits need the updates of all
the cluster's members, so run CFL with full participation, as the reference code requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, Toy, row


class Clusters(NamedTuple):
    """Server state: one model per cluster (stacked (G, ...)), every client's cluster id, rounds so far."""

    models: Params
    assign: Tensor  # (N,) long
    round: Tensor  # () long


class ClusterPayload(NamedTuple):
    models: Params
    assign: Tensor


def bipartition(delta: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Split rows of ``delta`` (k, P) in two by complete linkage on cosine similarity; returns the two
    index sets and the largest cross-cluster similarity."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    norm = delta / np.maximum(np.linalg.norm(delta, axis=1, keepdims=True), 1e-12)
    sim = norm @ norm.T
    dist = np.clip(1.0 - sim, 0.0, 2.0)
    np.fill_diagonal(dist, 0.0)
    labels = fcluster(linkage(squareform(dist, checks=False), method="complete"), 2, criterion="maxclust")
    a, b = np.flatnonzero(labels == 1), np.flatnonzero(labels == 2)
    cross = float(sim[np.ix_(a, b)].max()) if a.size and b.size else 1.0
    return a, b, cross


@dataclass(frozen=True)
class ClusteredFL(Algorithm[Clusters, ClientId]):
    name: ClassVar[str] = "clustered"
    toy: ClassVar[Toy] = Toy({"warmup_rounds": 2})
    needs_adaptation: ClassVar[bool] = True  # unseen clients choose a cluster on their training data
    #: split test: a cluster's mean update norm below this means it is near a stationary point
    eps1: Annotated[float, Range(0, lo_open=True)] = 0.4
    #: split test: some client's update norm above this means the cluster still disagrees
    eps2: Annotated[float, Range(0, lo_open=True)] = 1.6
    #: no split before this round (the reference demo's guard)
    warmup_rounds: Annotated[int, Range(0, 10**7)] = 20
    #: a cluster is split only if it has more clients than this
    min_cluster_size: Annotated[int, Range(1, 10**6)] = 3
    #: upper bound on the number of clusters (stacked server models)
    max_clusters: Annotated[int, Range(1, 1024)] = 16

    def check_privacy(self) -> None:
        raise ValueError("[privacy]: clustered splits clusters by the cosine similarities of the clients' raw updates "
                         "and releases the assignment, which the noised mean cannot privatize; it refuses [privacy]")

    def init_server(self, ctx: Context, params: Params, seed: int) -> Clusters:
        return Clusters(T.stack([params]), torch.zeros(ctx.num_clients, dtype=torch.long),
                        torch.zeros((), dtype=torch.long))

    def payload(self, server: Clusters) -> ClusterPayload:
        # the assignment travels with the models (every client learns its cluster, also over Flower); Clustered
        # FL needs every member of a cluster each round anyway (full participation), so this is O(N) by design
        return ClusterPayload(server.models, server.assign)

    def init_clients(self, ctx: Context, server: Clusters, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def client_update(
        self, ctx: Context, payload: ClusterPayload, state: ClientId, batches: Batches, lr: float
    ) -> tuple[Params, ClientId, Tensor]:
        theta = row(payload.models, row(payload.assign, state.id))
        new, loss = local_sgd(ctx.model.value_and_grad, theta, batches, lr, ctx.opt)
        return T.sub(new, theta), state, loss

    def aggregate(self, ctx: Context, server: Clusters, updates: Params, weights: Tensor, clients: Tensor) -> Clusters:
        models, assign = server.models, server.assign.clone()
        rnd = int(server.round) + 1
        clients = clients.to(assign.device)
        new_models = list(T.unstack(models, T.leaves(models)[0].shape[0]))
        flat = T.flatten_rows(updates).to(torch.float64)
        for c in range(len(new_models)):
            rows = torch.nonzero((assign[clients] == c) & (weights > 0)).flatten()
            if rows.numel() == 0:
                continue
            w = weights[rows].to(torch.float64)
            mean = (flat[rows] * (w / w.sum()).unsqueeze(1)).sum(0)
            new_models[c] = T.add(new_models[c], ctx.combine(T.take(updates, rows), weights[rows]))
            members = torch.nonzero(assign == c).flatten()
            can_split = (rnd > self.warmup_rounds and members.numel() >= self.min_cluster_size
                         and rows.numel() == members.numel() and len(new_models) < self.max_clusters)
            if not can_split:
                continue
            max_norm = float(flat[rows].norm(dim=1).max())
            if float(mean.norm()) < self.eps1 and max_norm > self.eps2:
                a, b, _ = bipartition(flat[rows].cpu().numpy())
                if a.size and b.size:
                    new_models.append(T.clone(new_models[c]))
                    assign[clients[rows[torch.as_tensor(b)]]] = len(new_models) - 1
        return Clusters(T.stack(new_models), assign, torch.tensor(rnd))

    def personalize(
        self, ctx: Context, payload: ClusterPayload, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return row(payload.models, row(payload.assign, state.id))
        assert batches is not None
        x, y, mask = first_epoch(batches, self.adapt_epochs)
        losses = torch.func.vmap(lambda m: (ctx.model.nll(ctx.model.apply(m, x), y) * mask).sum())(payload.models)
        return row(payload.models, torch.argmin(losses))
