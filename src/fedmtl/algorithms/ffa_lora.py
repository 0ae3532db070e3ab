"""FFA-LoRA: federated freeze-A LoRA.

Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024.

The model is a frozen base with LoRA adapters (``[model.adapters]``, ``fedmtl.models.lora``).  The A matrices stay at
their random initialization (drawn from the run's seed, the same for every client) and only the B matrices are
trained and averaged: with A fixed the adapters' update ``B A`` is linear in what the server averages, so averaging
the B matrices averages the clients' updates exactly (FedAvg of both A and B does not: the mean of products is not the
product of means), and half the adapters' parameters cross the network.  A sampled client trains its B matrices (and
the modules trained in full, ``train``) for ``run.local_epochs`` epochs under the fixed A; the server averages them
weighted by sample counts.  One global model: no personalization.  (The paper pairs it with a scaling factor alpha
larger than usual; that is ``[model.adapters] alpha``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ..models.base import Model
from ..optim import Batches
from ..tree import Params
from .adapters import check_adapters, split_a
from .base import Algorithm, Context, Toy
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, train_part


@dataclass(frozen=True)
class FFALoRA(Algorithm[SplitModel, tuple[()]]):
    """FFA-LoRA: the adapters' A matrices frozen at their seeded initialization, the B matrices averaged."""

    name: ClassVar[str] = "ffa_lora"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="lora", sgd_lr=1.0, rounds=45)  # only B learns, from zero: slower on the toy
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC  # fixed: the A matrices, never trained

    def check_model(self, model: Model) -> None:
        check_adapters(model, self.name)

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        trained, a = split_a(ctx.model, params, self.name)
        return SplitModel(trained, a)

    def payload(self, server: SplitModel) -> Params:
        return {**server.params, **server.fixed}

    def update_like(self, ctx: Context, payload: Params) -> Params:
        return split_a(ctx.model, payload, self.name)[0]  # the B matrices (and fully trained modules)

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        trained, a = split_a(ctx.model, payload, self.name)
        trained, loss = train_part(ctx, trained, a, batches, lr)
        return trained, state, loss


__all__ = ["FFALoRA"]
