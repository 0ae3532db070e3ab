"""APFL: adaptive personalized federated learning.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461 (2020), Alg. 1.

Each client keeps a personal model v and a mixing weight a in [0, 1]; it predicts with the mixture
h = a v + (1 - a) w.  Per local step on a batch: the global copy w takes an SGD step on f(w); v takes
a step on f(a v + (1 - a) w) (gradient a * grad f(h)); with ``adapt_alpha`` a takes a projected step
along <v - w, grad f(h)>.  The server averages the returned w (weighted by samples).  Unseen clients
have no personal model yet and predict with w.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, live_steps
from ..tree import Tree
from .base import Algorithm, Context, check_positive


@dataclass(frozen=True)
class APFL(Algorithm):
    name: ClassVar[str] = "apfl"
    alpha: float = 0.5
    adapt_alpha: bool = True
    alpha_lr: float = 0.01

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"algorithm.alpha must be in [0, 1], got {self.alpha}")
        check_positive("alpha_lr", self.alpha_lr, strict=False)

    def init_client(self, ctx: Context, server: Tree) -> Tree:
        return {"v": server["params"], "a": torch.tensor(self.alpha)}

    def client_update(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches, lr: float
    ) -> tuple[Tree, Tree, Tensor]:
        w, v, a = payload, state["v"], state["a"]
        wd = ctx.opt.weight_decay
        loss_sum, count = torch.zeros(()), torch.zeros(())
        live = live_steps(batches)
        for s in range(len(batches.x)):
            x, y, mask = batches.x[s], batches.y[s], batches.mask[s]
            active = live[s]
            gw, loss = ctx.model.value_and_grad(w, x, y, mask)
            h = T.tmap(lambda vi, wi, a=a: a * vi + (1 - a) * wi, v, w)
            gh, _ = ctx.model.value_and_grad(h, x, y, mask)
            new_w = T.tmap(lambda p, g: p - lr * (g + wd * p), w, gw)
            new_v = T.tmap(lambda p, g, a=a: p - lr * (a * g + wd * p), v, gh)
            if self.adapt_alpha:
                grad_a = sum((g * (vi - wi)).sum() for g, vi, wi in zip(T.leaves(gh), T.leaves(v), T.leaves(w),
                                                                       strict=True))
                new_a = torch.clamp(a - self.alpha_lr * grad_a, 0.0, 1.0)
                a = torch.where(active, new_a, a)
            w = T.where(active, new_w, w)
            v = T.where(active, new_v, v)
            loss_sum = loss_sum + torch.where(active, loss, torch.zeros_like(loss))
            count = count + active.to(count.dtype)
        return w, {"v": v, "a": a}, loss_sum / count.clamp_min(1)

    def personalize(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches | None, lr: float, seen: bool
    ) -> Tree:
        if not seen:
            return payload
        return T.tmap(lambda vi, wi: state["a"] * vi + (1 - state["a"]) * wi, state["v"], payload)
