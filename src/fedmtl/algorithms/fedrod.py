"""FedRoD: federated robust decoupling.

Chen, Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", ICLR 2022.

One shared model (body + generic head, the model's own head ``Model.head``) and, per client, a personal head of
the same shape on the same representation.  In every local step on a batch:

* the body and the generic head take a step on the *balanced softmax* loss, CE(z_G + log pi, y) with pi the
  client's class frequencies (its training labels), which makes the generic model an estimate of the
  class-balanced objective;
* the personal head takes a step on CE(z_G + z_P, y), the generic logits and the representation held fixed.

The server averages the shared models weighted by sample counts (the personal heads stay on the clients).  A
client predicts with z_G + z_P.  The personal head starts at zero, so a client that never trained (unseen)
predicts with the generic model.  The paper's hypernetwork variant of the personal head is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tree as T
from ..models.base import Model
from ..models.parts import value_and_grad_of
from ..optim import Batches, first_epoch, local_sgd
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, Toy

PERSONAL = "personal."  # prefix of the personal head's entries while it trains beside the shared model


class PersonalHead(NamedTuple):
    """Client state: the personal head (zero at first)."""

    head: Params


class RoDEval(NamedTuple):
    params: Params
    head: Params


def logit_adjustment(model: Model, y: Tensor, mask: Tensor) -> Tensor:
    """log pi for the balanced softmax: (C,) log class frequencies (binary models: the one logit's shift
    log pi_1 - log pi_0), with a floor for classes the client does not have."""
    counts = (F.one_hot(y.long(), model.num_classes).to(mask.dtype) * mask.unsqueeze(-1)).sum(0)
    logpi = torch.log((counts / counts.sum().clamp_min(1.0)).clamp_min(1e-8))
    return logpi[1] - logpi[0] if model.output == "binary" else logpi


@dataclass(frozen=True)
class FedRoD(Algorithm[GlobalModel, PersonalHead]):
    """FedRoD: a generic model trained with the balanced softmax, plus a personal head on its representation."""

    name: ClassVar[str] = "fedrod"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def init_client(self, ctx: Context, server: GlobalModel) -> PersonalHead:
        return PersonalHead(T.zeros_like(ctx.model.split(server.params, self.name)[1]))

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches, lr: float
    ) -> tuple[Params, PersonalHead, Tensor]:
        model = ctx.model
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        shift = logit_adjustment(model, y0, m0)

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)

            def loss(q: Params) -> Tensor:
                shared = {k: v for k, v in q.items() if not k.startswith(PERSONAL)}
                head = {k[len(PERSONAL):]: v for k, v in q.items() if k.startswith(PERSONAL)}
                z = model.features(shared, x)
                zg = model.apply_head(shared, z)
                bsm = model.nll(zg + shift, y)  # balanced softmax: body and generic head
                ce = model.nll(zg.detach() + model.apply_head(head, z.detach()), y)  # personal head only
                return ((bsm + ce) * m).sum() / m.sum().clamp_min(1.0)

            return value_and_grad_of(loss, p)

        start = {**payload, **{PERSONAL + k: v for k, v in state.head.items()}}
        new, loss = local_sgd(grad_fn, start, batches, lr, ctx.opt)
        shared = {k: v for k, v in new.items() if not k.startswith(PERSONAL)}
        return shared, PersonalHead({k[len(PERSONAL):]: v for k, v in new.items() if k.startswith(PERSONAL)}), loss

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalHead, batches: Batches | None, lr: float, seen: bool
    ) -> RoDEval:
        return RoDEval(payload, state.head)

    def predict_log_proba(self, ctx: Context, eval_state: RoDEval, x: Tensor) -> Tensor:
        model = ctx.model
        z = model.features(eval_state.params, x)
        return model.log_proba(model.apply_head(eval_state.params, z) + model.apply_head(eval_state.head, z))
