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
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, masked_steps
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel


class APFLState(NamedTuple):
    """Client state: the personal model v and the mixing weight a."""

    v: Params
    a: Tensor


@dataclass(frozen=True)
class APFL(Algorithm[GlobalModel, APFLState]):
    name: ClassVar[str] = "apfl"
    keeps_client_state: ClassVar[bool] = True
    #: initial mixing weight a of the personal model in h = a v + (1 - a) w, in [0, 1]
    alpha: Annotated[float, Range(0, 1)] = 0.5
    #: learn each client's mixing weight a by projected gradient steps (the paper's adaptive APFL)
    adapt_alpha: bool = True
    #: step size of the mixing-weight update
    alpha_lr: Annotated[float, Range(0, 1e3)] = 0.01

    def init_client(self, ctx: Context, server: GlobalModel) -> APFLState:
        return APFLState(server.params, torch.tensor(self.alpha))

    def client_update(
        self, ctx: Context, payload: Params, state: APFLState, batches: Batches, lr: float
    ) -> tuple[Params, APFLState, Tensor]:
        wd = ctx.opt.weight_decay

        def step(carry: tuple[Params, Params, Tensor], s: int) -> tuple[tuple[Params, Params, Tensor], Tensor]:
            w, v, a = carry
            x, y, mask = batches.x[s], batches.y[s], batches.mask[s]
            gw, loss = ctx.model.value_and_grad(w, x, y, mask)
            h = T.tmap(lambda vi, wi: a * vi + (1 - a) * wi, v, w)
            gh, _ = ctx.model.value_and_grad(h, x, y, mask)
            new_w = T.tmap(lambda p, g: p - lr * (g + wd * p), w, gw)
            new_v = T.tmap(lambda p, g: p - lr * (a * g + wd * p), v, gh)
            if self.adapt_alpha:
                grad_a = sum((g * (vi - wi)).sum() for g, vi, wi in zip(T.leaves(gh), T.leaves(v), T.leaves(w),
                                                                       strict=True))
                a = torch.clamp(a - self.alpha_lr * grad_a, 0.0, 1.0)
            return (new_w, new_v, a), loss

        (w, v, a), loss = masked_steps(batches, step, (payload, state.v, state.a))
        return w, APFLState(v, a), loss

    def personalize(
        self, ctx: Context, payload: Params, state: APFLState, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if not seen:
            return payload
        return T.tmap(lambda vi, wi: state.a * vi + (1 - state.a) * wi, state.v, payload)
