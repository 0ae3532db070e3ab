"""FedRep: exploiting shared representations for personalized federated learning.

Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, Algorithm 1.

The body (representation phi) is shared, each client keeps its head h_i (``Model.head``).  A sampled client
first trains its head for ``head_epochs`` epochs with the received body fixed, then the body for
``run.local_epochs`` epochs with its new head fixed (the paper: tau_h head updates, then tau_phi body updates;
its experiments use 10 head epochs and 1 body epoch); it keeps the head and sends the body, which the server
averages weighted by sample counts.  Unseen clients train a head from the initial one, the body fixed, for
``head_epochs`` epochs of their training data before testing.  With ``head_epochs = 0`` the heads never move
and the body is trained under them as FedPer trains its body (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ..models.base import Model
from ..optim import Batches
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, split_server, train_part, with_personal_head
from .fedper import PersonalHead


@dataclass(frozen=True)
class FedRep(Algorithm[SplitModel, PersonalHead]):
    """FedRep: each round a client fits its own head on the shared body, then updates the body under that head."""

    name: ClassVar[str] = "fedrep"
    loss_label: ClassVar[str] = "body loss"  # the loss of the body phase (the head phase's is not reported)
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy({"head_epochs": 1}, model="mlp")
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True
    keeps_client_state: ClassVar[bool] = True
    #: epochs of head training (body fixed) before the body epochs, each round; also for unseen clients
    head_epochs: Annotated[int, Range(0, 1000)] = 10

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return max(self.head_epochs, 1)

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def train_epochs(self, local_epochs: int) -> int:
        return self.head_epochs + local_epochs

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        return split_server(ctx.model, params, self.name, "body")

    def payload(self, server: SplitModel) -> Params:
        return server.params

    def init_client(self, ctx: Context, server: SplitModel) -> PersonalHead:
        return PersonalHead(server.fixed)

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches, lr: float
    ) -> tuple[Params, PersonalHead, Tensor]:
        per_epoch = len(batches.x) // self.train_epochs(ctx.local_epochs)
        cut = self.head_epochs * per_epoch
        head = state.head
        if cut:
            head, _ = train_part(ctx, head, payload, batches, lr, steps=slice(0, cut))
        body, loss = train_part(ctx, payload, head, batches, lr, steps=slice(cut, None))
        return body, PersonalHead(head), loss

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        return with_personal_head(ctx, payload, state.head, batches, lr, seen)
