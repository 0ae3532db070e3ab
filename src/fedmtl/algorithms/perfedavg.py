"""Per-FedAvg: personalized FL with a model-agnostic meta-learning objective.

Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1.

Objective F(w) = mean_i f_i(w - alpha grad f_i(w)).  Each sampled client runs ``local_steps`` (tau)
steps from the global w, each on three batches D, D', D'' (taken cyclically from its shuffled
training batches):

* w~ = w - alpha grad f(w; D);  g = grad f(w~; D')
* FO:  w <- w - beta g
* HF:  w <- w - beta (g - alpha d),  d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta),
  the finite-difference Hessian-vector product at w (not at w~), as in the paper.

alpha and beta are separate fields (a peer library silently uses one rate for both).  The server
averages the returned models uniformly (the paper).  Evaluation: each client takes the global model,
makes ``eval_steps`` (default 1) SGD step(s) with rate alpha on its own *training* data, then is tested
(the pFedMe repository adapts on test batches, a leak).  The optimizer's lr schedule, momentum and
weight decay are not used: the method's own rates are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import Tensor

from .. import tree as T
from ..optim import Batches, pick_batch
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, check_positive


@dataclass(frozen=True)
class PerFedAvg(Algorithm):
    name: ClassVar[str] = "perfedavg"
    needs_adaptation: ClassVar[bool] = True
    #: alpha, the step of the inner (personalization) gradient step
    alpha: float = 0.01
    #: beta, the outer (meta) step size
    beta: float = 0.001
    #: fo (first-order) or hf (Hessian-free: finite-difference Hessian-vector product)
    variant: Literal["fo", "hf"] = "fo"
    #: hf: the finite-difference step delta
    delta: float = 1e-3
    #: tau, local meta-steps per round
    local_steps: int = 10
    #: SGD steps of rate alpha on the client's training data before evaluation
    eval_steps: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("alpha", self.alpha, strict=False)
        check_positive("beta", self.beta)
        check_positive("delta", self.delta)
        check_positive("local_steps", self.local_steps)
        check_positive("eval_steps", self.eval_steps, strict=False)

    @staticmethod
    def hvp_fd(ctx: Context, w: Params, v: Params, batch: tuple[Tensor, Tensor, Tensor], delta: float) -> Params:
        """Finite-difference Hessian-vector product H(w) v ~ [g(w + delta v) - g(w - delta v)] / (2 delta)."""
        gp, _ = ctx.model.value_and_grad(T.add(w, T.scale(v, delta)), *batch)
        gm, _ = ctx.model.value_and_grad(T.sub(w, T.scale(v, delta)), *batch)
        return T.scale(T.sub(gp, gm), 1.0 / (2 * delta))

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        w = payload
        loss_sum = 0.0
        for t in range(self.local_steps):
            d1, d2, d3 = (pick_batch(batches, 3 * t + j) for j in range(3))
            g1, loss = ctx.model.value_and_grad(w, *d1)
            w_tilde = T.sub(w, T.scale(g1, self.alpha))
            g2, _ = ctx.model.value_and_grad(w_tilde, *d2)
            if self.variant == "hf":
                d = self.hvp_fd(ctx, w, g2, d3, self.delta)
                g2 = T.sub(g2, T.scale(d, self.alpha))
            w = T.sub(w, T.scale(g2, self.beta))
            loss_sum = loss_sum + loss
        return w, state, loss_sum / self.local_steps  # type: ignore[return-value]

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
