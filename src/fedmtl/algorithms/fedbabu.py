"""FedBABU: federated averaging with body aggregation and body update only.

Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022.

The head (``Model.head``) is left at its random initialization during federated training and never updated;
a sampled client trains only the body for ``run.local_epochs`` epochs under that fixed head and the server
averages the bodies weighted by sample counts.  Personalization happens at evaluation: every client (seen or
unseen) fine-tunes a copy of the global model on its training data for ``finetune_epochs`` epochs before testing
-- the whole model (``finetune = "full"``, the paper's main setting) or only the head (``"head"``).  The global
model itself is not changed by fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import Tensor

from ..models.base import Model
from ..optim import SGD, Batches
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, split_server, train_part
from .fedavg import finetune


@dataclass(frozen=True)
class FedBABU(Algorithm[SplitModel, tuple[()]]):
    """FedBABU: train and average only the body under a frozen random head; fine-tune before evaluation."""

    name: ClassVar[str] = "fedbabu"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    # the toy task: a frozen random head needs more rounds
    toy: ClassVar[Toy] = Toy({"finetune_epochs": 1, "personal_lr": 0.05}, model="mlp", rounds=45)
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True
    #: epochs of fine-tuning on a client's training data before its evaluation
    finetune_epochs: Annotated[int, Range(1, 1000)] = 5
    #: what fine-tuning trains: the whole model (the paper's main setting) or only the head
    finetune: Literal["full", "head"] = "full"
    #: fine-tuning learning rate (0 = optim.lr, the schedule's initial value)
    personal_lr: Annotated[float, Range(0, 1e3)] = 0.0

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.finetune_epochs

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        return split_server(ctx.model, params, self.name, "body")  # fixed: the random head, never trained

    def payload(self, server: SplitModel) -> Params:
        return {**server.params, **server.fixed}

    def update_like(self, ctx: Context, payload: Params) -> Params:
        return ctx.model.split(payload, self.name)[0]  # the body: the head stays fixed

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        body, head = ctx.model.split(payload, self.name)
        body, loss = train_part(ctx, body, head, batches, lr)
        return body, state, loss

    def personalize(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        assert batches is not None
        if self.finetune == "full":
            return finetune(ctx, payload, batches, lr, self.personal_lr)
        body, head = ctx.model.split(payload, self.name)
        opt = ctx.opt if not self.personal_lr else SGD(self.personal_lr, ctx.opt.momentum, ctx.opt.weight_decay)
        head, _ = train_part(ctx, head, body, batches, self.personal_lr or lr, opt=opt)
        return {**body, **head}
