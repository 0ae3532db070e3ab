"""FedAvg (McMahan et al., AISTATS 2017), FedProx (Li et al., MLSys 2020) and FedAvg+ (FedAvg then
local fine-tuning before evaluation, the "FedAvg+" baseline of Marfoq et al., NeurIPS 2021).

Server: w <- sum_k n_k w_k / sum_k n_k over the clients whose updates arrived (the FedAvg paper and
the FedProx code; FedProx's Algorithm 2 samples proportionally to n_k and averages uniformly, which
is the same in expectation).  Clients run ``local_epochs`` epochs of mini-batch SGD from the global
model.  FedProx adds ``mu (w - w_global)`` to every local gradient.  Deviation from the FedEM reference
code, stated here once: its clients keep their momentum buffers across rounds; ours start each round
with zero momentum (standard local SGD).  Its FedProx ran ProxSGD without momentum; ours uses the
configured optimizer, so FedProx with mu = 0 is exactly FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ..optim import SGD, Batches, ClientBatches, local_sgd, local_sgd_clients
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel


@dataclass(frozen=True)
class FedAvg(Algorithm[GlobalModel, tuple[()]]):
    """FedAvg: local SGD from the global model, the server averages the returned models weighted by samples."""

    name: ClassVar[str] = "fedavg"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    supports_batch_norm: ClassVar[bool] = True

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        params, loss = local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt)
        return params, state, loss

    def client_update_clients(
        self, ctx: Context, payload: Params, states: tuple[()], batches: ClientBatches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        params, loss = local_sgd_clients(ctx.model, payload, batches, lr, ctx.opt)
        return params, states, loss


@dataclass(frozen=True)
class FedProx(FedAvg):
    """FedAvg with the proximal term (mu / 2) ||w - w_global||^2 in every local objective."""

    name: ClassVar[str] = "fedprox"
    #: FedProx's proximal weight mu (0 = FedAvg; the paper tunes it in {0.001, 0.01, 0.1, 1}, Sec. 5.3.2)
    mu: Annotated[float, Range(0, 1e4)] = 0.01

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        params, loss = local_sgd(
            ctx.model.value_and_grad, payload, batches, lr, ctx.opt, prox_center=payload, prox_mu=self.mu
        )
        return params, state, loss

    def client_update_clients(
        self, ctx: Context, payload: Params, states: tuple[()], batches: ClientBatches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        params, loss = local_sgd_clients(ctx.model, payload, batches, lr, ctx.opt, prox_center=payload,
                                         prox_mu=self.mu)
        return params, states, loss


@dataclass(frozen=True)
class FedAvgFT(FedAvg):
    """FedAvg+: the global model fine-tuned for ``finetune_epochs`` local epochs before evaluation.

    ``personal_lr`` = 0 (default) fine-tunes at the personalization rate the engine passes, ``optim.lr`` (the
    schedule's initial value).  The FedEM reference code fine-tunes with each client's current optimizer, whose
    rate has decayed with the schedule (0.001 after the synthetic configs' two decays of 0.1); set ``personal_lr``
    to that value for the reference behaviour.  Every client (seen and unseen) fine-tunes a copy; the global model
    is unchanged.
    """

    name: ClassVar[str] = "fedavg+"
    needs_adaptation: ClassVar[bool] = True
    #: FedAvg+: epochs of local fine-tuning before each evaluation
    finetune_epochs: Annotated[int, Range(1, 1000)] = 1
    #: FedAvg+: fine-tuning learning rate (0 = optim.lr, the schedule's initial value)
    personal_lr: Annotated[float, Range(0, 1e3)] = 0.0

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.finetune_epochs

    def personalize(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        assert batches is not None
        return finetune(ctx, payload, batches, lr, self.personal_lr)


def finetune(ctx: Context, params: Params, batches: Batches, lr: float, personal_lr: float = 0.0) -> Params:
    """Local SGD of the whole model over ``batches`` (evaluation-time fine-tuning; FedAvg+, FedBABU) at
    ``personal_lr``, or at the personalization rate ``lr`` with the run's optimizer when it is 0."""
    opt = ctx.opt if not personal_lr else SGD(personal_lr, ctx.opt.momentum, ctx.opt.weight_decay)
    return local_sgd(ctx.model.value_and_grad, params, batches, personal_lr or lr, opt)[0]
