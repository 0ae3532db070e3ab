"""LG-FedAvg: think locally, act globally.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally, Act Globally: Federated
Learning with Local and Global Representations", arXiv 2001.01523 (2020), Algorithm 1.

The opposite split of FedPer: each client keeps its own body (the local representation) and the head (the
global layers, ``Model.head``) is shared.  A sampled client trains its body and the received head together for
``run.local_epochs`` epochs, keeps the body and sends the head; the server averages the heads weighted by sample
counts.  Clients start from the same initial body.  Unseen clients train a body from it under the global head
for ``unseen_body_epochs`` epochs of their training data before testing (the paper's new devices learn their
local model on their own data).  The paper's optional warm start (the first rounds of FedAvg on the whole
model) is left out: run FedAvg and resume from its model to reproduce it.
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
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, split_server, train_part


class PersonalBody(NamedTuple):
    """Client state: the client's own body (local representation)."""

    body: Params


@dataclass(frozen=True)
class LGFedAvg(Algorithm[SplitModel, PersonalBody]):
    """LG-FedAvg: personal bodies, a shared head averaged by the server."""

    name: ClassVar[str] = "lgfedavg"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True
    keeps_client_state: ClassVar[bool] = True
    #: unseen clients: epochs of body training (head fixed) on their training data before testing
    unseen_body_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_body_epochs

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        return split_server(ctx.model, params, self.name, "head")

    def payload(self, server: SplitModel) -> Params:
        return server.params  # the head

    def init_client(self, ctx: Context, server: SplitModel) -> PersonalBody:
        return PersonalBody(server.fixed)

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalBody, batches: Batches, lr: float
    ) -> tuple[Params, PersonalBody, Tensor]:
        new, loss = local_sgd(ctx.model.value_and_grad, {**state.body, **payload}, batches, lr, ctx.opt)
        body, head = ctx.model.split(new, self.name)
        return head, PersonalBody(body), loss

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalBody, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return {**state.body, **payload}
        assert batches is not None
        body, _ = train_part(ctx, state.body, payload, batches, lr)
        return {**body, **payload}
