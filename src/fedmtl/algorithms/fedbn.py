"""FedBN: federated learning on non-IID features via local batch normalization.

Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
ICLR 2021, Algorithm 1.

FedAvg in which every batch-norm layer stays local: its affine weights and its running statistics
(``Model.batch_norm``, the parameters of the model's ``fedmtl.BatchNorm`` layers) are each client's own, trained and
kept by the client and never sent; the server averages the other parameters weighted by sample counts.  A sampled
client trains the whole model for ``run.local_epochs`` epochs from the received shared weights and its own
batch-norm layers (``local_sgd``: the statistics follow the batches, momentum 0.1).  A client predicts with the
shared weights and its own batch-norm layers.

The paper evaluates only participating clients.  Decided here for unseen clients (``data.unseen_frac``): they start
from the initial batch-norm layers (weight 1, bias 0, statistics 0 / 1) and train them, the shared weights fixed,
for ``unseen_bn_epochs`` epochs of their training data before testing, as FedPer's unseen clients train a head.
With a model whose batch-norm layers are shared by every client in one round (a single client), FedBN is FedAvg
(tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from ..models.base import Model, ModelError
from ..models.parts import split_names
from ..optim import Batches, ClientBatches, local_sgd, local_sgd_clients
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy
from .bodyhead import FIXED_IS_PUBLIC, SplitModel, train_part


class LocalNorm(NamedTuple):
    """Client state: the client's own batch-norm layers (affine weights and running statistics)."""

    bn: Params


@dataclass(frozen=True)
class FedBN(Algorithm[SplitModel, LocalNorm]):
    """FedBN: FedAvg on every parameter but the batch-norm layers', which each client keeps."""

    name: ClassVar[str] = "fedbn"
    toy: ClassVar[Toy] = Toy(model="batchnorm")
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # unseen clients fit batch-norm layers first
    keeps_client_state: ClassVar[bool] = True
    #: unseen clients: epochs of batch-norm training (the shared weights fixed) on their training data before testing
    unseen_bn_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_bn_epochs

    def check_model(self, model: Model) -> None:
        if not model.batch_norm:
            raise ModelError(f"fedbn keeps the batch-norm layers local, but model {model.name!r} has none: use "
                             "'cnn_bn', 'mlp' with batch_norm = true, or a module with fedmtl.BatchNorm layers")

    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        shared, bn = split_names(params, ctx.model.batch_norm)
        return SplitModel(shared, bn)

    def payload(self, server: SplitModel) -> Params:
        return server.params  # every parameter outside the batch-norm layers

    def init_client(self, ctx: Context, server: SplitModel) -> LocalNorm:
        return LocalNorm(server.fixed)  # the initial batch-norm layers

    def client_update(
        self, ctx: Context, payload: Params, state: LocalNorm, batches: Batches, lr: float
    ) -> tuple[Params, LocalNorm, Tensor]:
        new, loss = local_sgd(ctx.model.value_and_grad, {**payload, **state.bn}, batches, lr, ctx.opt)
        shared, bn = split_names(new, ctx.model.batch_norm)
        return shared, LocalNorm(bn), loss

    def client_update_clients(
        self, ctx: Context, payload: Params, states: LocalNorm, batches: ClientBatches, lr: float
    ) -> tuple[Params, LocalNorm, Tensor]:
        """``client_update`` of K clients at once (the stacked executor): the shared weights broadcast, each client's
        own batch-norm layers (K, ...), each normalized with its own batches' statistics."""
        new, loss = local_sgd_clients(ctx.model, {**payload, **states.bn}, batches, lr, ctx.opt)
        shared, bn = split_names(new, ctx.model.batch_norm)
        return shared, LocalNorm(bn), loss

    def personalize(
        self, ctx: Context, payload: Params, state: LocalNorm, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        bn = state.bn
        if not seen:
            assert batches is not None
            bn, _ = train_part(ctx, bn, payload, batches, lr)
        return {**payload, **bn}
