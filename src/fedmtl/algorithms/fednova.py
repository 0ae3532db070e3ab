"""FedNova: normalized averaging of local updates.

Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020, Section 4 (eqs. 6-7) and Appendix (momentum SGD).

FedAvg weights client i's model change by its data share p_i, whatever the number tau_i of local steps that
produced it; clients that take more steps (more data, more epochs, faster devices) pull the global model towards
their own optimum, and FedAvg converges to the optimum of a *different* objective (the paper's objective
inconsistency).  FedNova divides each client's change by the weight its steps gave their gradients, then rescales:

    d_i = (x - y_i) / ||a_i||_1,        x <- x - tau_eff * sum_i p_i d_i,        tau_eff = sum_i p_i ||a_i||_1

with p_i = n_i / sum_j n_j over the clients whose updates arrived and, for local SGD with heavy-ball momentum
rho (the buffer restarted each round), ||a_i||_1 = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho) (tau_i for
plain SGD) — the same sum SCAFFOLD's ``momentum_weight_sum`` computes.  tau_i is the steps client i actually ran
(its epochs x batches, cut short where ``[systems]`` makes it a straggler).  With equal tau_i FedNova is FedAvg
(tested, the paper's remark after eq. 7); ``server_lr`` scales the step (1 = the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..optim import Batches, live_steps, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, scalar_mean
from .scaffold import momentum_weight_sum


class NovaUpdate(NamedTuple):
    """What a client sends: its normalized change d_i = (x - y_i) / ||a_i||_1 and ||a_i||_1 (a scalar)."""

    d: Params
    a: Tensor


@dataclass(frozen=True)
class FedNova(Algorithm[GlobalModel, tuple[()]]):
    """FedNova: local SGD from the global model; the server averages the step-normalized changes and rescales them
    by the effective number of steps."""

    name: ClassVar[str] = "fednova"
    supports_batch_norm: ClassVar[bool] = False
    averages_updates: ClassVar[bool] = False  # the updates are normalized steps: robust aggregators do not apply
    #: the server's step on tau_eff * sum_i p_i d_i (1 = the paper)
    server_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[NovaUpdate, tuple[()], Tensor]:
        y, loss = local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt)
        tau = live_steps(batches).sum().to(torch.float32)
        a = momentum_weight_sum(tau, ctx.opt.momentum)  # ||a_i||_1 (eq. 7; Appendix: momentum)
        inv = torch.where(a > 0, 1.0 / a.clamp_min(1e-12), torch.zeros(()))  # a client that ran no step sends 0
        return NovaUpdate(T.tmap(lambda x, yi: (x - yi) * inv, payload, y), a), state, loss

    def update_like(self, ctx: Context, payload: Params) -> NovaUpdate:
        return NovaUpdate(payload, torch.zeros(()))

    def aggregate(self, ctx: Context, server: GlobalModel, updates: NovaUpdate, weights: Tensor,
                  clients: Tensor) -> GlobalModel:
        if not bool((weights > 0).any()):
            return server
        d = ctx.combine(updates.d, weights)  # sum_i p_i d_i, p_i = n_i / sum n over the updates that arrived
        scale = self.server_lr * scalar_mean(updates.a, weights)  # eq. 7's tau_eff = sum_i p_i ||a_i||_1
        return GlobalModel(T.tmap(lambda p, di: p - (scale * di).to(p.dtype), server.params, d))
