"""Omni-Fedge: personalized federated learning with shared and task-specific layers and a
Bayesian weighting of every node's loss.

Kesanapalli & Bharath, "Federated Algorithm with Bayesian Approach: Omni-Fedge", ICASSP 2021.

Node i's network = shared layers theta_sh (one copy for all nodes) + its task-specific head theta_i (the
model's head, ``Model.head``).  With L_ij the loss of node i's network on node j's data, the poster's bound
is minimized over the weights without constraint,

    omega_i = argmin_omega sum_j omega_ij L_ij - lambda sum_j log omega_ij   =>   omega_ij = lambda / L_ij

(``omega = "paper"``, lambda = 1 in the poster; losses are floored at ``loss_floor`` so that a network that
fits a node's batch exactly cannot produce an infinite weight).  ``omega = "simplex"`` adds the constraint
sum_j omega_ij = 1 (omega_ij = lambda / (L_ij + nu_i), nu_i by bisection, ``solve_omega``): an earlier
fedmtl default, which gives nearly uniform weights at O(1) losses.  The reference code does neither: it
minimizes sum_j L_j omega_j^p - p sum_j log omega_j with p = 0.5 under a box constraint by SLSQP.

One round (each node uses one mini-batch, cycling through its batches):

1. node j receives theta_sh, all heads and omega; it reports L_ij for every network i on its batch,
   the partial shared gradient sum_i omega_ij grad_sh L_j(theta_sh, theta_i), and the gradient of its
   own loss with respect to its own head;
2. the server *averages* the partial shared gradients over the reporting nodes, the poster's Algorithm 1
   step (1/N) sum_j sum_i omega_ij grad L_ij with all N nodes reporting, and takes a gradient step on
   theta_sh; it steps each head with its node's gradient, stores L and solves omega row by row.

**The head step** (Algorithm 1, lines 5 and 7: each node's head minimizes its own loss with the shared layers
fixed).  ``head_step = "gradient"`` (default) takes one gradient step of the round's rate on the node's batch;
``head_step = "exact"`` solves that sub-problem to tolerance: full-batch gradient descent on the node's batch at
the round's rate, ``head_iters`` iterations at most, stopping (per node, vmap-safe) once the gradient's norm is
below ``head_tol``.  On a separable batch the cross-entropy has no minimizer (the logits grow without bound), so
the exact solve adds ``head_l2 / 2 ||W||^2`` on the head's weight matrices (biases unpenalized, as scikit-learn's
logistic regression does); it is checked against scikit-learn's solver on a linear head (``tests/test_methods.py``).

Paper vs reference code (stated, and the paper is followed): the code solves omega from the *losses
of all networks on node i's data* (the transpose), keeps one shared-layer copy per node, and also updates the
heads with omega-weighted gradients; here omega_i weights network i's losses across nodes (the talk's and the
paper's formulation), the shared layers are one copy, and each head takes its own node's gradient.  Plain
gradient steps with the round's learning rate; unseen nodes use the head with the lowest loss on their
training data.  Losses a node has not reported yet are unknown (stored as -1) and keep their initial weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor
from torch.func import grad, vmap

from .. import tree as T
from ..models.base import Model
from ..optim import Batches, first_epoch, pick_batch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, Toy, row


class OmniServer(NamedTuple):
    """Shared layers (one copy), every node's head (stacked (N, ...)), omega (N, N) and the last losses L_ij."""

    shared: Params
    heads: Params
    omega: Tensor
    losses: Tensor


class OmniPayload(NamedTuple):
    shared: Params
    heads: Params
    omega: Tensor


class OmniStep(NamedTuple):
    """What node j reports: its partial shared step, its own head's step, and L_ij for every network i."""

    shared: Params
    head: Params
    losses: Tensor


def solve_omega(losses: Tensor, lam: float, iters: int = 100) -> Tensor:
    """Row-wise argmin over the simplex of sum_j w_j L_j - lam sum_j log w_j: w_j = lam / (L_j + nu).

    losses (..., m) >= 0.  Bisection on nu in (-min L, -min L + m lam] where the weight sum falls
    from +inf to <= 1 (float64 throughout)."""
    L = losses.to(torch.float64)
    m = L.shape[-1]
    lo = -L.min(-1, keepdim=True).values
    hi = lo + m * lam
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_big = (lam / (L + mid).clamp_min(1e-300)).sum(-1, keepdim=True) > 1
        lo = torch.where(too_big, mid, lo)
        hi = torch.where(too_big, hi, mid)
    w = lam / (L + hi)
    return (w / w.sum(-1, keepdim=True)).to(losses.dtype)


@dataclass(frozen=True)
class OmniFedge(Algorithm[OmniServer, ClientId]):
    name: ClassVar[str] = "omnifedge"
    toy: ClassVar[Toy] = Toy(model="mlp", rounds=45)  # one gradient query a round
    averages_updates: ClassVar[bool] = False
    needs_adaptation: ClassVar[bool] = True
    #: lambda of the omega subproblem (the log-barrier weight; 1 in the poster)
    lam: Annotated[float, Range(0, 1e6, lo_open=True)] = 1.0
    #: paper: omega_ij = lambda / L_ij (the poster's unconstrained bound); simplex: each row on the simplex
    omega: Literal["paper", "simplex"] = "paper"
    #: paper omega: losses below this floor count as the floor (a guard against infinite weights)
    loss_floor: Annotated[float, Range(0, 1e3, lo_open=True)] = 1e-3
    #: gradient: one gradient step on each node's head a round; exact: solve the head sub-problem to head_tol
    head_step: Literal["gradient", "exact"] = "gradient"
    #: exact: at most this many full-batch gradient iterations on the node's batch
    head_iters: Annotated[int, Range(1, 10**6)] = 500
    #: exact: stop once the head gradient's L2 norm is below this
    head_tol: Annotated[float, Range(0, 1e3)] = 1e-6
    #: exact: L2 weight on the head's weight matrices (a minimizer exists on separable batches)
    head_l2: Annotated[float, Range(0, 1e6)] = 1e-3

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def solve(self, losses: Tensor, old: Tensor) -> Tensor:
        """omega from the stored losses (-1 = not reported yet: that entry keeps its ``old`` weight)."""
        known = losses >= 0
        if self.omega == "simplex":
            return solve_omega(losses.clamp_min(0.0), self.lam)
        return torch.where(known, self.lam / losses.clamp_min(self.loss_floor), old)

    def init_server(self, ctx: Context, params: Params, seed: int) -> OmniServer:
        shared, _ = ctx.model.split(params, self.name)
        heads = T.stack([ctx.model.split(ctx.model.init(seed + 1000 + i), self.name)[1]
                         for i in range(ctx.num_clients)])
        m = ctx.num_clients
        w0 = 1.0 / m if self.omega == "simplex" else 1.0
        return OmniServer(shared, T.to(heads, next(iter(params.values())).device), torch.full((m, m), w0),
                          torch.full((m, m), -1.0))

    def payload(self, server: OmniServer) -> OmniPayload:
        return OmniPayload(server.shared, server.heads, server.omega)

    def init_clients(self, ctx: Context, server: OmniServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def client_update(
        self, ctx: Context, payload: OmniPayload, state: ClientId, batches: Batches, lr: float
    ) -> tuple[OmniStep, ClientId, Tensor]:
        x, y, mask = pick_batch(batches, 0)
        j = state.id

        def loss_of(shared: Params, head: Params) -> Tensor:
            return ctx.model.loss({**shared, **head}, x, y, mask)

        losses = vmap(loss_of, in_dims=(None, 0))(payload.shared, payload.heads)  # (m,) L_ij, i = all
        w_col = payload.omega.index_select(1, j.reshape(1)).squeeze(1)  # omega_ij for all i
        shared_grad = grad(lambda s: (vmap(loss_of, in_dims=(None, 0))(s, payload.heads) * w_col).sum())(
            payload.shared)
        own_head = row(payload.heads, j)
        own_loss = losses.index_select(0, j.reshape(1)).squeeze(0)
        if self.head_step == "exact":
            solved = self.solve_head(lambda h: loss_of(payload.shared, h), own_head, lr)
            head_move = T.sub(own_head, solved)  # the server subtracts it: the head becomes the solution
        else:
            head_move = T.scale(grad(lambda h: loss_of(payload.shared, h))(own_head), lr)
        # steps (gradient x this round's rate) so the server needs no schedule of its own
        step = OmniStep(T.scale(shared_grad, lr), head_move, losses)
        return step, state, own_loss

    def solve_head(self, loss: Callable[[Params], Tensor], head: Params, lr: float) -> Params:
        """argmin_h loss(h) + head_l2 / 2 ||weights of h||^2 by gradient descent at rate ``lr`` from ``head``:
        ``head_iters`` iterations at most, frozen once the gradient norm is below ``head_tol`` (vmap-safe)."""
        l2 = self.head_l2

        def objective(h: Params) -> Tensor:
            reg = sum((w * w).sum() for w in h.values() if w.dim() >= 2)
            return loss(h) + 0.5 * l2 * reg

        g_of = grad(objective)
        done = torch.zeros((), dtype=torch.bool)
        for _ in range(self.head_iters):
            g = g_of(head)
            norm = torch.sqrt(sum((x * x).sum() for x in g.values()))
            done = done | (norm < self.head_tol)
            head = {k: torch.where(done, v, v - lr * g[k]) for k, v in head.items()}
        return head

    def aggregate(self, ctx: Context, server: OmniServer, updates: OmniStep, weights: Tensor,
                  clients: Tensor) -> OmniServer:
        ok = torch.nonzero(weights > 0).flatten()
        if ok.numel() == 0:
            return server
        cl = clients.to(ok.device)[ok]
        # the poster's (1/N) sum_j: the mean of the reporting nodes' partial steps (all N nodes report each round
        # under full participation)
        mean = T.tmap(lambda g: g.index_select(0, ok).mean(0), updates.shared)
        shared = T.tmap(lambda p, g: p - g, server.shared, mean)
        heads = T.tmap(lambda h, g: h.index_add(0, cl, -g.index_select(0, ok)), server.heads, updates.head)
        losses = server.losses.clone()
        losses[:, cl] = updates.losses.index_select(0, ok).T.to(losses.dtype)  # column j = node j's data
        return OmniServer(shared, heads, self.solve(losses, server.omega), losses)

    def personalize(
        self, ctx: Context, payload: OmniPayload, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return {**payload.shared, **row(payload.heads, state.id)}
        assert batches is not None
        x, y, mask = first_epoch(batches, self.adapt_epochs)
        losses = vmap(lambda h: ctx.model.loss({**payload.shared, **h}, x, y, mask))(payload.heads)
        return {**payload.shared, **row(payload.heads, torch.argmin(losses))}
