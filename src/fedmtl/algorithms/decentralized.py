"""Decentralized variants: D-FedEM (Marfoq et al., NeurIPS 2021, Sec. 3.3 / Alg. 3) and D-SGD
(decentralized local SGD; Lian et al., NeurIPS 2017; Koloskova et al., ICML 2020).

No server: every client keeps its own copy of the model (D-SGD) or of the M components (D-FedEM),
runs its local update exactly as in the centralized method, then averages with its neighbours through
a doubly-stochastic mixing matrix W over a communication graph (``fedmtl.graph``, sparse): theta_i <-
sum_j W_ij theta_j (``sync``).  The "server" state only holds W and the average over clients (used to
start unseen clients, and to report the consensus).  With a complete graph and uniform mixing, and clients
of equal size, D-FedEM is FedEM with full participation (tested).  Clients that are not sampled in a
round skip their local update but still gossip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

from torch import Tensor

from .. import tree as T
from ..graph import Mixing, build
from ..optim import Batches
from ..schema import Annotated, Range
from ..tree import Params, Tree
from .base import Context
from .fedavg import FedAvg
from .fedem import FedEM, MixtureEval, MixtureWeights


class Gossip(NamedTuple):
    """The decentralized methods' "server": the mixing matrix and the average model over clients."""

    mixing: Mixing
    average: Params


class PeerModel(NamedTuple):
    """D-SGD client state: the client's copy of the model."""

    params: Params


class PeerMixture(NamedTuple):
    """D-FedEM client state: the client's copy of the M components and its mixture weights."""

    components: Params
    pi: Tensor


@dataclass(frozen=True)
class _Gossip:
    """Graph fields shared by the decentralized algorithms."""

    #: communication graph: complete, ring, erdos_renyi or file (adjacency_file)
    topology: Literal["complete", "ring", "erdos_renyi", "file"] = "erdos_renyi"
    #: edge probability of the Erdos-Renyi graph
    edge_prob: Annotated[float, Range(0, 1, lo_open=True)] = 0.5
    #: doubly-stochastic mixing weights: metropolis (Metropolis-Hastings) or max_degree
    mixing: Literal["metropolis", "max_degree"] = "metropolis"
    #: topology = 'file': an N x N adjacency matrix (.npy, or whitespace-separated text), symmetric, entries >= 0
    adjacency_file: str = ""
    #: seed of the random graph
    graph_seed: Annotated[int, Range(0, 2**63 - 1)] = 0

    syncs_clients: ClassVar[bool] = True
    averages_updates: ClassVar[bool] = False
    keeps_client_state: ClassVar[bool] = True

    def gossip_server(self, ctx: Context, model: Params) -> Gossip:
        """No server: only the mixing matrix and the average over clients (unseen clients, reporting)."""
        g = build(self.topology, ctx.num_clients, self.edge_prob, self.graph_seed, self.adjacency_file)
        w = g.mixing(self.mixing)
        dev = next(iter(T.leaves(model))).device
        return Gossip(Mixing(w.edges.to(dev), w.weight.to(dev).float(), w.self_weight.to(dev).float()), model)

    def payload(self, server: Gossip) -> Params:
        return server.average

    def aggregate(self, ctx: Context, server: Gossip, updates: Tree, weights: Tensor, clients: Tensor) -> Gossip:
        return server

    def _models(self, state: Tree) -> Params:
        """The models part of a client state (what gossip mixes)."""
        raise NotImplementedError

    def gossip_edges(self, server: Gossip) -> Tensor:
        return server.mixing.edges

    def sync_average(self, server: Gossip, mean_state: Tree) -> Gossip:
        """The mixing matrices used are doubly stochastic: whoever mixes, the server's average is the clients'."""
        return Gossip(server.mixing, self._models(mean_state))

    def _mix(self, server: Gossip, models: Params) -> tuple[Gossip, Params]:
        mixed = T.tmap(server.mixing.mix, models)
        return Gossip(server.mixing, T.tmap(lambda x: x.mean(0), mixed)), mixed


# D-FedEM and D-SGD reuse FedEM's and FedAvg's hyperparameters and local steps by inheritance, but their states are
# others (server ``Gossip``; clients ``PeerMixture`` / ``PeerModel``): as typed algorithms they are not an
# ``Algorithm[Mixture, MixtureWeights]`` / ``Algorithm[GlobalModel, tuple[()]]``, hence the ``misc`` (bases that
# disagree) and ``override`` ignores below.
@dataclass(frozen=True)
class DFedEM(_Gossip, FedEM):  # type: ignore[misc]
    """D-FedEM: FedEM's local EM steps, then gossip averaging of the M components with the neighbours."""
    name: ClassVar[str] = "dfedem"
    runs_async: ClassVar[bool] = False  # gossip: no server to run asynchronously

    def init_server(self, ctx: Context, params: Params, seed: int) -> Gossip:  # type: ignore[override]
        return self.gossip_server(ctx, FedEM.init_server(self, ctx, params, seed).components)

    def init_client(self, ctx: Context, server: Gossip) -> PeerMixture:  # type: ignore[override]
        return PeerMixture(server.average, FedEM.init_client(self, ctx, server).pi)  # type: ignore[arg-type]

    def client_update(  # type: ignore[override]
        self, ctx: Context, payload: Params, state: PeerMixture, batches: Batches, lr: float
    ) -> tuple[Params, PeerMixture, Tensor]:
        comps, st, nll = FedEM.client_update(self, ctx, state.components, MixtureWeights(state.pi), batches, lr)
        return {}, PeerMixture(comps, st.pi), nll

    def _models(self, state: PeerMixture) -> Params:  # type: ignore[override]
        return state.components

    def sync(self, ctx: Context, server: Gossip, clients: PeerMixture) -> tuple[Gossip, PeerMixture]:  # type: ignore[override]
        server, mixed = self._mix(server, clients.components)
        return server, clients._replace(components=mixed)

    def personalize(  # type: ignore[override]
        self, ctx: Context, payload: Params, state: PeerMixture, batches: Batches | None, lr: float, seen: bool
    ) -> MixtureEval:
        comps = state.components if seen else payload
        return FedEM.personalize(self, ctx, comps, MixtureWeights(state.pi), batches, lr, seen)


@dataclass(frozen=True)
class DSGD(_Gossip, FedAvg):  # type: ignore[misc]
    """Decentralized local SGD: local epochs, then gossip averaging with the neighbours."""

    name: ClassVar[str] = "dsgd"
    runs_async: ClassVar[bool] = False  # gossip: no server to run asynchronously

    def init_server(self, ctx: Context, params: Params, seed: int) -> Gossip:  # type: ignore[override]
        return self.gossip_server(ctx, params)

    def init_client(self, ctx: Context, server: Gossip) -> PeerModel:  # type: ignore[override]
        return PeerModel(server.average)

    def client_update(  # type: ignore[override]
        self, ctx: Context, payload: Params, state: PeerModel, batches: Batches, lr: float
    ) -> tuple[Params, PeerModel, Tensor]:
        params, _, loss = FedAvg.client_update(self, ctx, state.params, (), batches, lr)
        return {}, PeerModel(params), loss

    def _models(self, state: PeerModel) -> Params:  # type: ignore[override]
        return state.params

    def sync(self, ctx: Context, server: Gossip, clients: PeerModel) -> tuple[Gossip, PeerModel]:  # type: ignore[override]
        server, mixed = self._mix(server, clients.params)
        return server, PeerModel(mixed)

    def personalize(  # type: ignore[override]
        self, ctx: Context, payload: Params, state: PeerModel, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        return state.params if seen else payload
