"""Per-FedAvg: personalized FL with a model-agnostic meta-learning objective.

Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1.

Objective F(w) = mean_i f_i(w - alpha grad f_i(w)).  Each sampled client runs ``local_steps`` (tau)
steps from the global w, each on three *independent* batches D, D', D'':

* w~ = w - alpha grad f(w; D);  g = grad f(w~; D')
* FO:    w <- w - beta g
* HF:    w <- w - beta (g - alpha d),  d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta),
  the finite-difference Hessian-vector product at w (not at w~), as in the paper;
* exact: w <- w - beta (g - alpha H(w; D'') g), the Hessian-vector product by automatic differentiation (the
  paper's Per-FedAvg with exact second-order terms; HF approximates it, tested).

Batches: each round every role (D, D', D'') has its own uniform permutation of the client's examples, and meta-step
t takes batch t (cycling) of each, so the three batches are independent draws.  A client with a single batch
(n <= batch size) would get its whole set three times from permutations, so its D' and D'' are drawn *with
replacement* (n examples each, a bootstrap of its data); D is its whole set.  (Taken in turn from one shuffled
list of batches, all three would be the same batch for such a client.)  A straggler (``[systems]``) makes fewer
meta-steps.

alpha and beta are separate fields (a peer library silently uses one rate for both).  The server
averages the returned models uniformly (the paper).  Evaluation: each client takes the global model,
makes ``eval_steps`` (default 1) SGD step(s) with rate alpha on its own *training* data, then is tested
(the pFedMe repository adapts on test batches, a leak).  The optimizer's lr schedule, momentum and
weight decay are not used: the method's own rates are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor
from torch.func import grad, jvp

from .. import tree as T
from ..data.federated import Orders, epoch_orders
from ..models.stacking import value_and_grad_stacked
from ..optim import Batches, pick_batch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, Toy

ROLES = 3  # D, D', D''


def role_batches(batches: Batches, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """x, y, mask of every meta-step's batches at once, shaped (ROLES, steps, B, ...): entry [r, t] is batch ``t``
    (cycling over the client's non-empty batches) of the permutation of role ``r``.  One gather for the whole round
    (vmap-safe): selecting the 3 x ``steps`` batches one at a time cost more than the meta-steps' gradients.  Entry
    [r][t] indexes both forms (nested lists of the loop runner's ragged batches)."""
    if isinstance(batches.x, list):  # loop runner: every listed batch is real (and sized as it is: nested lists)
        per = len(batches.x) // ROLES
        return tuple([[f[r * per + t % per] for t in range(steps)] for r in range(ROLES)]
                     for f in (batches.x, batches.y, batches.mask))
    per = batches.x.shape[0] // ROLES
    if per == 1:  # every client of this call has one batch per role: no gather, a broadcast view
        return tuple(t.reshape(ROLES, 1, *t.shape[1:]).expand(ROLES, steps, *t.shape[1:])  # type: ignore[return-value]
                     for t in (batches.x, batches.y, batches.mask))
    live = (batches.mask.reshape(ROLES, per, -1).sum(-1) > 0).to(torch.long)  # (ROLES, per) non-empty batches
    k = torch.remainder(torch.arange(steps, device=live.device).unsqueeze(0),
                        live.sum(1, keepdim=True).clamp_min(1))  # (ROLES, steps)
    # the k-th non-empty batch of each role: its position where the running count of non-empty batches reaches k + 1
    hit = torch.cumsum(live, 1).unsqueeze(1) == (k + 1).unsqueeze(-1)  # (ROLES, steps, per)
    j = (torch.argmax(hit.to(torch.long), -1) + per * torch.arange(ROLES, device=live.device).unsqueeze(1)).reshape(-1)
    out = [t.index_select(0, j) for t in (batches.x, batches.y, batches.mask)]
    return tuple(o.reshape(ROLES, steps, *o.shape[1:]) for o in out)  # type: ignore[return-value]


def role_batch(batches: Batches, role: int, t: int) -> tuple[Tensor, Tensor, Tensor]:
    """Batch ``t`` of the permutation of ``role`` (``role_batches`` for one step)."""
    x, y, mask = role_batches(batches, t + 1)
    return x[role][t], y[role][t], mask[role][t]


@dataclass(frozen=True)
class PerFedAvg(Algorithm[GlobalModel, tuple[()]]):
    name: ClassVar[str] = "perfedavg"
    toy: ClassVar[Toy] = Toy({"beta": 0.05})  # the paper's MNIST beta = 0.001 barely moves the toy loss in 15 rounds
    needs_adaptation: ClassVar[bool] = True
    #: alpha, the step of the inner (personalization) gradient step
    alpha: Annotated[float, Range(0, 1e3)] = 0.01
    #: beta, the outer (meta) step size
    beta: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.001
    #: fo (first-order), hf (Hessian-free: finite-difference Hessian-vector product) or exact (autograd HVP)
    variant: Literal["fo", "hf", "exact"] = "fo"
    #: hf: the finite-difference step delta
    delta: Annotated[float, Range(0, 1, lo_open=True)] = 1e-3
    #: tau, local meta-steps per round
    local_steps: Annotated[int, Range(1, 10**4)] = 10
    #: SGD steps of rate alpha on the client's training data before evaluation
    eval_steps: Annotated[int, Range(0, 10**4)] = 1

    def train_epochs(self, local_epochs: int) -> int:
        return ROLES

    def draw_orders(self, counts: Tensor, epochs: int, batch_size: int, generator: torch.Generator) -> Orders:
        """One permutation per role; D' and D'' of single-batch clients drawn with replacement."""
        orders = epoch_orders(counts, ROLES, generator)
        small = [i for i, n in enumerate(counts.tolist()) if 0 < n <= batch_size]
        if small:
            local = orders.local.clone()
            for i in small:
                n, at = int(counts[i]), int(orders.starts[i])
                for role in range(1, ROLES):
                    local[role, at:at + n] = torch.randint(n, (n,), generator=generator)
            orders = orders._replace(local=local)
        return orders

    def step_budget(self, counts: Tensor, batch_size: int, epochs: int) -> Tensor:
        return torch.full_like(counts, self.local_steps)  # a straggler makes fewer meta-steps

    @staticmethod
    def hvp_fd(ctx: Context, w: Params, v: Params, batch: tuple[Tensor, Tensor, Tensor], delta: float) -> Params:
        """Finite-difference Hessian-vector product H(w) v ~ [g(w + delta v) - g(w - delta v)] / (2 delta); both
        gradients in one call, the two points stacked as two models on the same batch."""
        pts = T.tmap(lambda a, b: torch.stack([a + delta * b, a - delta * b]), w, v)
        g, _ = value_and_grad_stacked(ctx.model, pts, *batch)
        return T.tmap(lambda gg: (gg[0] - gg[1]) / (2 * delta), g)

    @staticmethod
    def hvp_exact(ctx: Context, w: Params, v: Params, batch: tuple[Tensor, Tensor, Tensor]) -> Params:
        """H(w) v by forward-over-reverse automatic differentiation."""
        def loss(p: Params) -> Tensor:
            return ctx.model.loss(p, *batch)

        hv: Params = jvp(grad(loss), (w,), (v,))[1]
        return hv

    def meta_step(self, ctx: Context, w: Params, d1: tuple[Tensor, Tensor, Tensor],
                  d2: tuple[Tensor, Tensor, Tensor], d3: tuple[Tensor, Tensor, Tensor]) -> tuple[Params, Tensor]:
        """One meta-step from ``w`` on batches D, D', D''; returns (new w, loss on D)."""
        g1, loss = ctx.model.value_and_grad(w, *d1)
        w_tilde = T.sub(w, T.scale(g1, self.alpha))
        g2, _ = ctx.model.value_and_grad(w_tilde, *d2)
        if self.variant != "fo":
            d = self.hvp_fd(ctx, w, g2, d3, self.delta) if self.variant == "hf" else self.hvp_exact(ctx, w, g2, d3)
            g2 = T.sub(g2, T.scale(d, self.alpha))
        return T.sub(w, T.scale(g2, self.beta)), loss

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        w = payload
        limit = batches.limit
        loss_sum = torch.zeros(())
        count = torch.zeros(())
        xs, ys, ms = role_batches(batches, self.local_steps)
        for t in range(self.local_steps):
            new, loss = self.meta_step(ctx, w, *((xs[r][t], ys[r][t], ms[r][t]) for r in range(ROLES)))
            active = torch.ones((), dtype=torch.bool) if limit is None else torch.tensor(t) < limit
            w = T.tmap(lambda a, b, active=active: torch.where(active, a, b), new, w)
            loss_sum = loss_sum + torch.where(active, loss, torch.zeros_like(loss))
            count = count + active.to(count.dtype)
        return w, state, loss_sum / count.clamp_min(1.0)

    def aggregate(self, ctx: Context, server: GlobalModel, updates: Params, weights: Tensor,
                  clients: Tensor) -> GlobalModel:
        return super().aggregate(ctx, server, updates, (weights > 0).to(weights.dtype), clients)

    def personalize(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        assert batches is not None
        w = payload
        for t in range(self.eval_steps):
            g, _ = ctx.model.value_and_grad(w, *pick_batch(batches, t))
            w = T.sub(w, T.scale(g, self.alpha))
        return w
