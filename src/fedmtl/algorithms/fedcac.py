"""FedCAC: cautiously aggressive collaboration on each client's critical parameters.

Wu, Liu, Niu, Zhu, Tang, "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through
Cautiously Aggressive Collaboration", ICCV 2023 (arXiv 2309.11103): critical parameter selection and the
collaboration on critical and non-critical parameters.  Sources read: the paper's abstract and the FedCAC
implementation in the Fling library (kxzxvbk/Fling: ``fedcac_client.py``, ``fedcac_group.py`` and its CIFAR-10
config) for the formulas and numbers below; the paper's section and equation numbers could not be read, so the
equations are cited by their symbols.

Every parameter of the model is, per client, either *critical* (sensitive to the client's data: kept close to the
client's own and those of clients with similar critical parameters) or *non-critical* (aggregated with everyone).  A
round, for a sampled client i that starts from w_i:

1. local training: ``run.local_epochs`` epochs of SGD from w_i to w^_i;
2. critical parameter selection: the sensitivity of every parameter, s = |(w^_i - w_i) (.) w^_i| (the update
   standing in for the gradient in the first-order estimate of the loss change when the parameter is removed); in
   every parameter tensor (layer) of n entries the int(tau n) of largest sensitivity are critical: u_i = [s >= the
   int(tau n)-th largest s] (where that threshold is below 1e-10, the smallest sensitivity above 1e-20, as Fling);
3. it sends w^_i and its mask u_i.

The server forms the global model w_bar, the counts-weighted mean of the w^_i, and for every pair of the round's
clients the overlap of their critical parameters

    o_ij = 1 - ||u_i - u_j||_1 / (2 ||u_i||_1),

a threshold that rises with the round t, theta_t = o_avg + (t / beta)(o_max - o_avg) (o_avg, o_max: the mean and the
largest overlap over the ordered pairs i != j), and for each client i its customized global model, the uniform mean of
w^_j over j = i and the clients with o_ij >= theta_t.  The client's next start combines them:

    w_i = u_i (.) c_i + (1 - u_i) (.) w_bar,

its critical parameters from its customized global model, the rest from the global model.  As t grows past beta the
threshold passes o_max: the critical parameters collaborate with nobody (bold at first, cautious later).

Engine form: the server state holds w_bar, the table of the clients' customized global models (N rows, as FedAMP's and
FedPAC's tables) and the round counter t; the payload is that state and a client reads its row by its ``ClientId``.
A client keeps its mask u_i (zero before it first trains: it starts from w_bar).  A client predicts with its next
start w_i (the model the server's step personalizes for it); a client that never trained, and an unseen one, with
w_bar.

Defaults: tau = 0.5, beta = 100 (Fling's CIFAR-10 configuration for FedCAC).

Choices and deviations, stated where implemented:
* with partial participation, overlaps and customized models are formed over the round's clients; a client that
  did not train keeps its table row and mask, and its next start combines them with the current w_bar (Fling's
  runs have every client in every round);
* the global model is the counts-weighted mean (FedAvg), the customized one the uniform mean (as in Fling);
* ``[privacy]`` and robust aggregators are refused: the server combines each client's own model into the
  customized ones, not only a mean of updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, row


class CACServer(NamedTuple):
    """Server state (also the payload): the global model w_bar, every client's customized global model c_i stacked
    (N, ...), and the number of aggregations so far t (())."""

    params: Params
    custom: Params
    round: Tensor


class CACClient(NamedTuple):
    """Client state: its federation-wide id and its critical-parameter mask u_i (0/1 per parameter; 0 until it
    trains)."""

    id: Tensor
    mask: Params


class CACUpdate(NamedTuple):
    """A client's update: its trained model w^_i and its mask u_i."""

    params: Params
    mask: Params


def critical_mask(start: Tensor, trained: Tensor, tau: float) -> Tensor:
    """u for one parameter tensor: 1 where the sensitivity |(trained - start) trained| is among the top ``tau``
    fraction of the tensor (threshold: the int(tau n)-th largest value; where it is <= 1e-10, the smallest value above
    1e-20; none when int(tau n) = 0), else 0.  vmap-safe."""
    s = ((trained - start) * trained).abs().reshape(-1)  # step 2: the parameter's sensitivity
    k = int(tau * s.numel())
    if k == 0:
        return torch.zeros_like(trained)
    thresh = torch.sort(s, descending=True).values[k - 1]
    inf = torch.full_like(thresh, float("inf"))
    smallest = torch.where(s > 1e-20, s, inf).min()  # the smallest nonzero sensitivity (inf: all are 0)
    # a threshold at (or near) zero would mark the untouched parameters critical: Fling falls back to the
    # smallest nonzero sensitivity (and to 0, every parameter, when all are 0)
    thresh = torch.where(thresh <= 1e-10, torch.where(torch.isinf(smallest), thresh, smallest), thresh)
    return (s >= thresh).to(trained.dtype).reshape(trained.shape)


def overlaps(masks: Tensor) -> Tensor:
    """(K, K) o_ij = 1 - ||u_i - u_j||_1 / (2 ||u_i||_1) of the K flattened 0/1 masks (K, P), in float64; for 0/1
    vectors ||u_i - u_j||_1 = |u_i| + |u_j| - 2 <u_i, u_j>."""
    u = masks.to(torch.float64)
    size = u.sum(1)
    dist = size.unsqueeze(1) + size.unsqueeze(0) - 2 * u @ u.T
    return 1 - dist / (2 * size.clamp_min(1.0)).unsqueeze(1)


def collaborators(o: Tensor, t: float, beta: int) -> Tensor:
    """(K, K) 0/1 matrix a: a_ij = 1 for j = i and for the j != i with o_ij >= theta_t = o_avg + (t / beta)(o_max -
    o_avg), the mean and the largest overlap taken over the ordered pairs i != j."""
    k = o.shape[0]
    eye = torch.eye(k, dtype=torch.bool)
    if k < 2:
        return eye.to(torch.float64)
    off = o[~eye]
    avg, top = off.mean(), off.max()
    theta = avg + (t / beta) * (top - avg)  # the threshold rises with the round: aggressive first, cautious later
    return ((o >= theta) | eye).to(torch.float64)


@dataclass(frozen=True)
class FedCAC(Algorithm[CACServer, CACClient]):
    """FedCAC: each client's critical parameters (largest |update x value| per layer) start from the mean of the
    clients whose critical parameters overlap most with its own, its other parameters from the global model."""

    name: ClassVar[str] = "fedcac"
    toy: ClassVar[Toy] = Toy(kwargs={"beta": 5})
    keeps_client_state: ClassVar[bool] = True
    # the server combines each client's own model into customized models: robust aggregators and [privacy] do not
    # apply (check_privacy refuses it)
    averages_updates: ClassVar[bool] = False
    #: tau, the fraction of each parameter tensor that is critical
    tau: Annotated[float, Range(0, 1)] = 0.5
    #: beta, the rounds over which the collaboration threshold rises from the mean overlap to the largest one
    beta: Annotated[int, Range(1, 1_000_000)] = 100

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> CACServer:
        ref = next(iter(params.values()))
        return CACServer(params, T.clone(T.broadcast(params, ctx.num_clients)),
                         torch.zeros((), dtype=torch.long, device=ref.device))

    def payload(self, server: CACServer) -> CACServer:
        return server

    def update_like(self, ctx: Context, payload: CACServer) -> CACUpdate:
        return CACUpdate(payload.params, T.zeros_like(payload.params))

    def aggregate(self, ctx: Context, server: CACServer, updates: CACUpdate, weights: Tensor,
                  clients: Tensor) -> CACServer:
        ok = torch.nonzero(weights > 0).flatten()
        if ok.numel() == 0:
            return server
        glob = ctx.combine(updates.params, weights)  # w_bar: FedAvg over the round's valid clients
        t = server.round + 1
        masks = torch.cat([v.index_select(0, ok.to(v.device)).reshape(ok.numel(), -1).cpu()
                           for v in updates.mask.values()], 1)
        a = collaborators(overlaps(masks), float(t), self.beta)
        a = a / a.sum(1, keepdim=True)  # c_i: the uniform mean over i's collaborators
        ids = clients.to(ok.device)[ok].to(torch.long)

        def customize(table: Tensor, new: Tensor) -> Tensor:
            rows = new.index_select(0, ok.to(new.device)).to(torch.float64)
            mixed = torch.tensordot(a.to(rows.device), rows, dims=1)
            return table.index_copy(0, ids.to(table.device), mixed.to(table.dtype).to(table.device))

        return CACServer(glob, T.tmap(customize, server.custom, updates.params), t)

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: CACServer, ids: Tensor) -> CACClient:
        return CACClient(ids.clone(), T.zeros_like(T.broadcast(server.params, len(ids))))

    def init_client(self, ctx: Context, server: CACServer) -> CACClient:
        return CACClient(torch.zeros((), dtype=torch.long), T.zeros_like(server.params))

    def start(self, payload: CACServer, state: CACClient) -> Params:
        """w_i = u_i (.) c_i + (1 - u_i) (.) w_bar: the critical parameters from the customized global model, the
        rest from the global model (w_bar where the mask is still zero)."""
        custom = row(payload.custom, state.id)
        return T.tmap(lambda u, c, g: u * c + (1 - u) * g, state.mask, custom, payload.params)

    def client_update(
        self, ctx: Context, payload: CACServer, state: CACClient, batches: Batches, lr: float
    ) -> tuple[CACUpdate, CACClient, Tensor]:
        w0 = self.start(payload, state)
        trained, loss = local_sgd(ctx.model.value_and_grad, w0, batches, lr, ctx.opt)  # step 1
        mask = {k: critical_mask(w0[k], trained[k], self.tau) for k in trained}  # step 2, per layer
        return CACUpdate(trained, mask), CACClient(state.id, mask), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: CACServer, state: CACClient, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if not seen:
            return payload.params  # outside the federation: no mask, no row of the table: the global model
        return self.start(payload, state)
