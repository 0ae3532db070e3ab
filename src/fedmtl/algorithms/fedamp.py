"""FedAMP: attentive message passing between the clients' personalized models.

Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021,
Section 4 (Algorithm 1) and Section 5 (HeurFedAMP).

FedAMP minimizes sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2) over the clients' personal models w_i, with
the attention-inducing A(x) = 1 - exp(-x / sigma), by alternating two steps.  The server keeps every client's
latest model and forms for each client a *personalized cloud model* (eqs. 4-5)

    u_i = xi_ii w_i + sum_{j != i} xi_ij w_j,   xi_ij = alpha A'(||w_i - w_j||^2) = alpha exp(-||w_i - w_j||^2 / sigma)
    / sigma,   xi_ii = 1 - sum_{j != i} xi_ij,

so that clients with similar models exchange more; client i then solves (eq. 6)

    w_i = argmin_w F_i(w) + lambda / (2 alpha) ||w - u_i||^2

by ``run.local_epochs`` of local SGD started at u_i (the proximal point's natural start), and sends w_i back.
``attention = "cosine"`` is the paper's HeurFedAMP: xi_ii = ``self_weight`` and the rest split by a softmax of
sigma * cos(w_i, w_j) over j != i, which does not depend on the scale of the models.

alpha is the step of the message passing and sets the proximal weight lambda / alpha of the local objective.
With many clients whose models are close, sum_{j != i} xi_ij can exceed 1 and xi_ii turn negative (u_i then
extrapolates away from the crowd), as in the paper's formula; the paper's analysis asks for a small alpha.  With
``attention = "exp"`` sigma sets the distance scale: models farther apart than a few sigma in squared distance do
not exchange, so a sigma far below the clients' squared distances makes FedAMP local training; choose it on the
scale of ||w_i - w_j||^2.  alpha = lambda = sigma = 1 are the defaults of the method's other implementations (the
paper tunes them per dataset); on the label-permuted groups of ``reproduce personalization``, sigma = 3 separates
the groups (measured there).

Engine form: the server state holds the table of the clients' latest models and the table of their cloud models
(N rows each: memory N x the model); the payload is the cloud table, from which a client reads its row (its
``ClientId``), and each client keeps its own w_i (its state), which it predicts with.  Every cloud model is
recomputed after each round from the table (the paper's full participation; with client sampling, an absent
client's row is its last model).  A client that never trained (unseen) predicts with the mean of the cloud models.
Over Flower every node receives the whole cloud table, not only its clients' rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, row


class AMPServer(NamedTuple):
    """Server state: every client's latest model and its personalized cloud model, stacked (N, ...)."""

    models: Params
    cloud: Params


class AMPClient(NamedTuple):
    """Client state: the client's id and its personalized model w_i."""

    id: Tensor
    params: Params


@dataclass(frozen=True)
class FedAMP(Algorithm[AMPServer, AMPClient]):
    """FedAMP: each client trains towards a personalized cloud model, an attention-weighted mix of all clients'
    models that weights similar models more."""

    name: ClassVar[str] = "fedamp"
    keeps_client_state: ClassVar[bool] = True
    averages_updates: ClassVar[bool] = False  # the server keeps a table of models, it does not average updates
    toy: ClassVar[Toy] = Toy(kwargs={"sigma": 10.0})
    #: attention function: "exp" (FedAMP, A'(d) = exp(-d / sigma) / sigma) or "cosine" (HeurFedAMP)
    attention: Literal["exp", "cosine"] = "exp"
    #: the proximal weight lambda of the local objective (lambda / (2 alpha)) ||w - u_i||^2
    lam: Annotated[float, Range(0, 1e6)] = 1.0
    #: "exp": the scale sigma of A(x) = 1 - exp(-x / sigma); "cosine": the softmax's inverse temperature
    sigma: Annotated[float, Range(0, 1e12, lo_open=True)] = 1.0
    #: the step alpha_k of the attentive message passing (eq. 5; the local proximal weight is lambda / alpha)
    alpha: Annotated[float, Range(0, 1e6, lo_open=True)] = 1.0
    #: "cosine": the weight xi_ii of a client's own model in its cloud model
    self_weight: Annotated[float, Range(0, 1)] = 0.5

    def attention_weights(self, flat: Tensor) -> Tensor:
        """(N, N) xi from the clients' flattened models ``flat`` (N, P); rows sum to 1."""
        n = flat.shape[0]
        off = ~torch.eye(n, dtype=torch.bool, device=flat.device)
        f = flat.to(torch.float64)
        if self.attention == "exp":
            sq = (f * f).sum(1)
            d = (sq[:, None] + sq[None, :] - 2 * f @ f.T).clamp_min(0.0)  # ||w_i - w_j||^2
            xi = self.alpha * torch.exp(-d / self.sigma) / self.sigma * off  # eq. 5: alpha A'(d), j != i
            return xi + torch.diag(1.0 - xi.sum(1))
        unit = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)
        logits = (self.sigma * unit @ unit.T).masked_fill(~off, float("-inf"))  # HeurFedAMP: softmax over j != i
        soft = torch.softmax(logits, 1) if n > 1 else torch.zeros(n, n, dtype=f.dtype, device=f.device)
        keep = self.self_weight if n > 1 else 1.0
        return (1.0 - keep) * soft + keep * torch.eye(n, dtype=f.dtype, device=f.device)

    def cloud_models(self, models: Params) -> Params:
        """u_i = sum_j xi_ij w_j for every client (eq. 4), stacked (N, ...)."""
        n = next(iter(models.values())).shape[0]
        flat = torch.cat([v.reshape(n, -1) for v in models.values()], 1)  # (N, P), in the order of ``models``
        xi = self.attention_weights(flat)
        mixed = (xi @ flat.to(torch.float64)).to(flat.dtype)  # (N, P)
        out: Params = {}
        start = 0
        for k, v in models.items():
            size = v[0].numel()
            out[k] = mixed[:, start:start + size].reshape(v.shape).to(v.dtype)
            start += size
        return out

    def init_server(self, ctx: Context, params: Params, seed: int) -> AMPServer:
        table = T.broadcast(params, ctx.num_clients)
        return AMPServer(T.clone(table), T.clone(table))

    def payload(self, server: AMPServer) -> Params:
        return server.cloud

    def init_clients(self, ctx: Context, server: AMPServer, ids: Tensor) -> AMPClient:
        return AMPClient(ids.clone(), T.clone(T.take(server.models, ids.to(torch.long))))

    def client_update(
        self, ctx: Context, payload: Params, state: AMPClient, batches: Batches, lr: float
    ) -> tuple[Params, AMPClient, Tensor]:
        u = row(payload, state.id)  # u_i, this client's cloud model
        mu = self.lam / self.alpha  # eq. 6: (lambda / (2 alpha)) ||w - u_i||^2
        w, loss = local_sgd(ctx.model.value_and_grad, u, batches, lr, ctx.opt, prox_center=u, prox_mu=mu)
        return w, AMPClient(state.id, w), loss

    def update_like(self, ctx: Context, payload: Params) -> Params:
        return T.take(payload, 0)

    def aggregate(self, ctx: Context, server: AMPServer, updates: Params, weights: Tensor,
                  clients: Tensor) -> AMPServer:
        ok = torch.nonzero(weights > 0).flatten()
        if ok.numel() == 0:
            return server
        ids = clients.to(ok.device)[ok].to(torch.long)
        models = T.tmap(lambda t, u: t.index_copy(0, ids.to(t.device), u.index_select(0, ok.to(u.device)).to(t.dtype)),
                        server.models, updates)
        return AMPServer(models, self.cloud_models(models))

    def personalize(
        self, ctx: Context, payload: Params, state: AMPClient, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return state.params
        return T.tmap(lambda c: c.mean(0), payload)  # a client outside the federation: the mean cloud model
