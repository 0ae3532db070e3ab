"""Decentralized variants: D-FedEM (Marfoq et al., NeurIPS 2021, Sec. 3.3 / Alg. 3) and D-SGD
(decentralized local SGD; Lian et al., NeurIPS 2017; Koloskova et al., ICML 2020).

No server: every client keeps its own copy of the model (D-SGD) or of the M components (D-FedEM),
runs its local update exactly as in the centralized method, then averages with its neighbours through
a doubly-stochastic mixing matrix W over a communication graph (``fedmtl.topology``): theta_i <-
sum_j W_ij theta_j.  The "server" state only holds W and the average over clients (used to start
unseen clients, and to report the consensus).  With a complete graph and uniform mixing, and clients
of equal size, D-FedEM is FedEM with full participation (tested).  Clients that are not sampled in a
round skip their local update but still gossip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches
from ..topology import build_graph, mix, mixing_matrix
from ..tree import Tree
from .base import Context
from .fedavg import FedAvg
from .fedem import FedEM


@dataclass(frozen=True)
class _Gossip:
    """Graph fields shared by the decentralized algorithms."""

    topology: str = "erdos_renyi"  # complete | ring | erdos_renyi | file
    edge_prob: float = 0.5
    mixing: str = "metropolis"  # metropolis | max_degree
    adjacency_file: str = ""
    graph_seed: int = 0

    #: the client-state entry holding the gossiped model(s)
    model_key: ClassVar[str] = "params"

    def mixing_matrix(self, n: int) -> Tensor:
        adj = build_graph(self.topology, n, self.edge_prob, self.graph_seed, self.adjacency_file)
        return mixing_matrix(adj, self.mixing).to(torch.float32)

    def gossip_server(self, ctx: Context, model: Tree) -> Tree:
        """No server: only the mixing matrix and the average over clients (unseen clients, reporting)."""
        return {"W": self.mixing_matrix(ctx.num_clients), "average": model}

    def payload(self, server: Tree) -> Tree:
        return server["average"]

    def aggregate(
        self, ctx: Context, server: Tree, updates: Tree, weights: Tensor, clients: Tensor | None = None
    ) -> Tree:
        return server

    def post_round(self, ctx: Context, server: Tree, clients: Tree) -> tuple[Tree, Tree]:
        """Gossip step theta_i <- sum_j W_ij theta_j on the model entry; other client state stays."""
        mixed = T.tmap(lambda x: mix(server["W"], x), clients[self.model_key])
        average = T.tmap(lambda x: x.mean(0), mixed)
        return {"W": server["W"], "average": average}, {**clients, self.model_key: mixed}

    def upload_numel(self, ctx: Context, server: Tree) -> int:
        return T.num_params(server["average"])


@dataclass(frozen=True)
class DFedEM(_Gossip, FedEM):
    name: ClassVar[str] = "dfedem"
    model_key: ClassVar[str] = "components"

    def init_server(self, ctx: Context, params: Tree, seed: int) -> Tree:
        return self.gossip_server(ctx, FedEM.init_server(self, ctx, params, seed)["components"])

    def init_client(self, ctx: Context, server: Tree) -> Tree:
        return {"components": server["average"], **super().init_client(ctx, server)}

    def client_update(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches, lr: float
    ) -> tuple[Tree, Tree, Tensor]:
        comps, st, nll = super().client_update(ctx, state["components"], state, batches, lr)
        return {}, {"components": comps, "pi": st["pi"]}, nll

    def personalize(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches | None, lr: float, seen: bool
    ) -> Tree:
        comps = state["components"] if seen else payload
        return super().personalize(ctx, comps, state, batches, lr, seen)


@dataclass(frozen=True)
class DSGD(_Gossip, FedAvg):
    """Decentralized local SGD: local epochs, then gossip averaging with the neighbours."""

    name: ClassVar[str] = "dsgd"

    def init_server(self, ctx: Context, params: Tree, seed: int) -> Tree:
        return self.gossip_server(ctx, params)

    def init_client(self, ctx: Context, server: Tree) -> Tree:
        return {"params": server["average"]}

    def client_update(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches, lr: float
    ) -> tuple[Tree, Tree, Tensor]:
        params, _, loss = super().client_update(ctx, state["params"], state, batches, lr)
        return {}, {"params": params}, loss

    def personalize(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches | None, lr: float, seen: bool
    ) -> Tree:
        return state["params"] if seen else payload
