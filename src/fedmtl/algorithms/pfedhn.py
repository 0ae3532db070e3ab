"""pFedHN: personalized federated learning with hypernetworks.

Shamsian, Navon, Fetaya, Chechik, ICML 2021, Algorithm 1.

The server holds a hypernetwork h(v; phi) and one embedding v_i per client; client i's model is
theta_i = h(v_i; phi).  A sampled client trains theta_i by ``run.local_epochs`` of local SGD to theta~_i and
sends Delta_i = theta_i - theta~_i; the server steps phi and v_i along the vector-Jacobian products
phi <- phi - hn_lr grad_phi(theta_i)^T Delta_i,  v_i <- v_i - hn_lr grad_v(theta_i)^T Delta_i
(averaged over the round's clients; with one client per round, the paper's setting, it is the paper's step).

The hypernetwork: an MLP on the embedding (``embed_dim``, ``hn_hidden`` units, ``hn_depth`` ReLU layers) with
one linear output per parameter tensor of the target model, initialized as torch's linear layers
(``out_scale`` = 1) plus biases equal to the target model's initial parameters.
Deviation in the protocol, not the mathematics: the payload is the hypernetwork and the embeddings, and each
client computes its own theta_i = h(v_i; phi) (the paper's server computes theta_i and sends it; the engine sends
one payload per round).  Unseen clients start from the mean embedding and fit their own by ``unseen_steps`` SGD
steps of rate ``embed_lr`` on their training data with phi fixed (the paper's generalization to novel clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.parts import value_and_grad_of
from ..optim import Batches, local_sgd, pick_batch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, row


class HyperServer(NamedTuple):
    """Server state: the hypernetwork's parameters phi and the clients' embeddings (N, embed_dim)."""

    hnet: Params
    embeddings: Tensor


def _key(name: str) -> str:
    return "out." + name.replace(".", "/")


@dataclass(frozen=True)
class PFedHN(Algorithm[HyperServer, ClientId]):
    """pFedHN: a server hypernetwork maps each client's embedding to that client's model."""

    name: ClassVar[str] = "pfedhn"
    needs_adaptation: ClassVar[bool] = True  # unseen clients fit an embedding
    averages_updates: ClassVar[bool] = False
    #: dimension of the client embeddings
    embed_dim: Annotated[int, Range(1, 4096)] = 16
    #: units of the hypernetwork's hidden layers
    hn_hidden: Annotated[int, Range(1, 10**5)] = 100
    #: hidden layers of the hypernetwork
    hn_depth: Annotated[int, Range(1, 64)] = 2
    #: the server's step size on the hypernetwork and the embeddings (the paper's 1e-2 goes with 50 local steps)
    hn_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.3
    #: scale of the output layers' initial weights (x 1/sqrt(hn_hidden)): how far the clients' first models differ
    out_scale: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0
    #: unseen clients: SGD steps on their embedding
    unseen_steps: Annotated[int, Range(0, 10**5)] = 20
    #: unseen clients: step size on their embedding
    embed_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.1

    def init_server(self, ctx: Context, params: Params, seed: int) -> HyperServer:
        dev = next(iter(params.values())).device
        g = torch.Generator().manual_seed(seed + 7)
        hnet: Params = {}
        width = self.embed_dim
        for layer in range(self.hn_depth):
            bound = 1.0 / math.sqrt(width)
            hnet[f"h{layer}.weight"] = (torch.rand(self.hn_hidden, width, generator=g) * 2 - 1) * bound
            hnet[f"h{layer}.bias"] = (torch.rand(self.hn_hidden, generator=g) * 2 - 1) * bound
            width = self.hn_hidden
        for name, p in params.items():
            scale = self.out_scale / math.sqrt(width)
            hnet[_key(name) + ".weight"] = torch.randn(p.numel(), width, generator=g) * scale
            hnet[_key(name) + ".bias"] = p.detach().flatten().cpu().clone()
        emb = torch.randn(ctx.num_clients, self.embed_dim, generator=g) * 0.1
        return HyperServer(T.to(hnet, dev), emb.to(dev))

    def generate(self, ctx: Context, hnet: Params, v: Tensor) -> Params:
        """theta = h(v; phi): the target model's parameters, shaped as the model's."""
        h = v
        for layer in range(self.hn_depth):
            h = torch.relu(h @ hnet[f"h{layer}.weight"].T + hnet[f"h{layer}.bias"])
        shapes = {k: p.shape for k, p in ctx.model.module.named_parameters()}
        return {k: (h @ hnet[_key(k) + ".weight"].T + hnet[_key(k) + ".bias"]).reshape(s) for k, s in shapes.items()}

    def payload(self, server: HyperServer) -> HyperServer:
        return server

    def init_clients(self, ctx: Context, server: HyperServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def client_update(
        self, ctx: Context, payload: HyperServer, state: ClientId, batches: Batches, lr: float
    ) -> tuple[Params, ClientId, Tensor]:
        theta = self.generate(ctx, payload.hnet, row(payload.embeddings, state.id))
        trained, loss = local_sgd(ctx.model.value_and_grad, theta, batches, lr, ctx.opt)
        return T.sub(theta, trained), state, loss  # Delta_i = theta_i - theta~_i

    def aggregate(self, ctx: Context, server: HyperServer, updates: Params, weights: Tensor,
                  clients: Tensor) -> HyperServer:
        ok = torch.nonzero(weights > 0).flatten()
        if ok.numel() == 0:
            return server
        ids = clients.to(ok.device)[ok]
        deltas = T.take(updates, ok)

        def surrogate(p: Params) -> Tensor:
            # sum_i <theta_i(phi, v_i), Delta_i> / K: its gradient is the mean vector-Jacobian product
            hnet = {k: v for k, v in p.items() if k != "embeddings"}
            thetas = torch.func.vmap(lambda v: self.generate(ctx, hnet, v))(p["embeddings"].index_select(0, ids))
            # sum() starts from the int 0: typed int | Tensor, a Tensor here
            return sum((thetas[k] * deltas[k].detach()).sum() for k in thetas) / ok.numel()  # type: ignore[return-value]

        g, _ = value_and_grad_of(surrogate, {**server.hnet, "embeddings": server.embeddings})
        hnet = {k: v - self.hn_lr * g[k] for k, v in server.hnet.items()}
        return HyperServer(hnet, server.embeddings - self.hn_lr * g["embeddings"])

    def personalize(
        self, ctx: Context, payload: HyperServer, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return self.generate(ctx, payload.hnet, row(payload.embeddings, state.id))
        assert batches is not None
        v = payload.embeddings.mean(0)
        for t in range(self.unseen_steps):
            batch = pick_batch(batches, t)

            def loss(p: Params, batch: tuple[Tensor, Tensor, Tensor] = batch) -> Tensor:
                return ctx.model.loss(self.generate(ctx, payload.hnet, p["v"]), *batch)

            gv, _ = value_and_grad_of(loss, {"v": v})
            v = v - self.embed_lr * gv["v"]
        return self.generate(ctx, payload.hnet, v)
