"""FedPer: federated learning with personalization layers.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers", arXiv 1912.00818
(2019), Algorithm 1.

The model's body (base layers) is shared, its head (the personalization layers, ``Model.head``) is each
client's own.  A sampled client trains body and head together for ``run.local_epochs`` epochs from the
received body and its own head, keeps the head and sends the body; the server averages the bodies weighted by
sample counts (FedAvg on the base layers).  Clients that never trained (unseen) start from the initial head and
train it, the body fixed, for ``unseen_head_epochs`` epochs of their training data before testing (the paper
evaluates only participating clients).  With an empty head (``Model.head = ()``) FedPer is FedAvg (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from ..models.base import Model
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, with_personal_head


class PersonalHead(NamedTuple):
    """Client state: the client's own head."""

    head: Params


@dataclass(frozen=True)
class FedPer(Algorithm[SplitModel, PersonalHead]):
    """FedPer: a shared body averaged by the server, a personal head trained with it and kept by each client."""

    name: ClassVar[str] = "fedper"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # unseen clients train a head first
    keeps_client_state: ClassVar[bool] = True
    #: unseen clients: epochs of head training (body fixed) on their training data before testing
    unseen_head_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_head_epochs

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def split(self, model: Model, params: Params) -> tuple[Params, Params]:
        """(shared, personal) parts of ``params``: the body and the head (``Model.head``)."""
        return model.split(params, self.name)

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        return SplitModel(*self.split(ctx.model, params))  # the body averaged, the initial head kept

    def payload(self, server: SplitModel) -> Params:
        return server.params  # the body

    def init_client(self, ctx: Context, server: SplitModel) -> PersonalHead:
        return PersonalHead(server.fixed)  # the initial head

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches, lr: float
    ) -> tuple[Params, PersonalHead, Tensor]:
        new, loss = local_sgd(ctx.model.value_and_grad, {**payload, **state.head}, batches, lr, ctx.opt)
        body, head = self.split(ctx.model, new)
        return body, PersonalHead(head), loss

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        return with_personal_head(ctx, payload, state.head, batches, lr, seen)
