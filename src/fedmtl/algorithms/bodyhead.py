"""What the body/head methods share (FedPer, FedRep, LG-FedAvg, FedBABU): the server state that keeps the averaged
part of the model apart from the fixed one, training one part with the other fixed, and a personal head's
prediction.

The split is a property of the model (``Model.head``: the parameter names of the last layer(s)); a model that
declares none (``linear``) is refused by ``check_model`` before any work.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..models.base import Model
from ..optim import SGD, Batches, local_sgd
from ..tree import Params
from .base import Context

#: ``SplitModel.fixed`` under ``[privacy]``: drawn from the run's seed before any training and never updated from
#: client data, so releasing it costs no privacy (``Algorithm.public_server_state``)
FIXED_IS_PUBLIC = {"fixed": "the non-averaged part's initial values, drawn from the run's seed and never updated"}


class SplitModel(NamedTuple):
    """Server state of a body/head method: ``params``, the part the server averages (the body, or LG-FedAvg's
    head), and ``fixed``, the other part at its initial value (where clients without their own copy start)."""

    params: Params
    fixed: Params


def split_server(model: Model, params: Params, method: str, shared: str) -> SplitModel:
    """``SplitModel`` of the initial ``params`` whose averaged part is the ``shared`` one ("body" or "head")."""
    body, head = model.split(params, method)
    return SplitModel(body, head) if shared == "body" else SplitModel(head, body)


def train_part(ctx: Context, trainable: Params, fixed: Params, batches: Batches, lr: float | Tensor,
               steps: slice | None = None, opt: SGD | None = None) -> tuple[Params, Tensor]:
    """Local SGD on ``trainable`` with ``fixed`` (the rest of the model) held constant; (trained part, loss)."""
    def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
        g, loss = ctx.model.value_and_grad({**fixed, **p}, x, y, mask, w)
        return {k: g[k] for k in p}, loss

    return local_sgd(grad_fn, trainable, batches, lr, opt or ctx.opt, steps=steps)


def with_personal_head(ctx: Context, body: Params, head: Params, batches: Batches | None, lr: float,
                       seen: bool) -> Params:
    """The model a client with its own head predicts with: its head on the shared body; an unseen client first
    trains its head (from the initial one, the body fixed) on its training batches."""
    if not seen:
        assert batches is not None
        head, _ = train_part(ctx, head, body, batches, lr)
    return {**body, **head}
