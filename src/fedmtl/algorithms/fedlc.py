"""FedLC: federated learning via logits calibration.

Zhang, Li, Li, Xu, Wu, Ding, Wu, "Federated Learning with Label Distribution Skew via Logits Calibration",
ICML 2022, Section 4 (the calibrated cross-entropy).

Under label skew a client's softmax cross-entropy pushes the logits of its rare and missing classes down, and the
averaged model inherits the bias.  FedLC trains every client on calibrated logits: each class y gets the pairwise
label margin Delta_y = tau * n_{c,y}^{-1/4}, with n_{c,y} the client's number of training examples of class y,

    L_cal(x, y) = -log [ exp(f_y(x) - Delta_y) / sum_{y'} exp(f_{y'}(x) - Delta_{y'}) ],

so a rare class (large Delta) must win by a larger margin and a missing class (n = 0: an infinite margin, taken
here as n = 1e-8, 100 tau) drops out of the normalizer and is not pushed down.  The server is FedAvg's; the
calibration is a training loss only, predictions use the plain logits.

The normalizer: ``denominator = "all"`` (default) sums over every class, the softmax of the calibrated logits,
which is the calibrated probability of the paper's derivation and the loss the method's implementations train.
``denominator = "others"`` sums over y' != y only, which is how the printed equation of the calibrated loss reads;
that loss has no minimum (it falls linearly in f_y) and is offered to reproduce the printed form, not as a default.
Binary models (one logit z) are calibrated as the two logits (0, z).  ``tau`` is tuned per dataset in the paper;
the default 1.0 is the value the method's other implementations use.  tau = 0 is FedAvg (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.base import Model
from ..models.parts import value_and_grad_of
from ..optim import Batches, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, Toy


def label_margins(model: Model, y: Tensor, mask: Tensor, tau: float) -> Tensor:
    """(C,) Delta_y = tau * n_{c,y}^{-1/4} from the client's labels ``y`` and ``mask`` (its first epoch: every
    training example once); classes the client lacks count as n = 1e-8."""
    classes = 2 if model.output == "binary" else model.num_classes
    counts = (F.one_hot(y.long(), classes).to(torch.float32) * mask.to(torch.float32).unsqueeze(-1)).sum(0)
    return tau * counts.clamp_min(1e-8).pow(-0.25)


def calibrated_nll(model: Model, out: Tensor, y: Tensor, margins: Tensor, others: bool) -> Tensor:
    """(n,) the calibrated cross-entropy of outputs ``out`` (n, C) (binary: (n,), read as logits (0, z))."""
    logits = torch.stack([torch.zeros_like(out), out], -1) if model.output == "binary" else out
    z = logits - margins  # f_{y'}(x) - Delta_{y'}
    picked = torch.gather(z, -1, y.long().unsqueeze(-1)).squeeze(-1)  # f_y(x) - Delta_y
    if others:  # the printed form: the normalizer over y' != y only
        z = z.masked_fill(F.one_hot(y.long(), z.shape[-1]).bool(), float("-inf"))
    return torch.logsumexp(z, -1) - picked


@dataclass(frozen=True)
class FedLC(Algorithm[GlobalModel, tuple[()]]):
    """FedLC: FedAvg whose clients train on logits calibrated by their class counts (tau n_{c,y}^{-1/4})."""

    name: ClassVar[str] = "fedlc"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    #: the calibration strength tau of the margins tau * n_{c,y}^{-1/4} (0 = FedAvg)
    tau: Annotated[float, Range(0, 1e3)] = 1.0
    #: the calibrated loss's normalizer: "all" classes (the calibrated softmax) or the "others" y' != y (as printed)
    denominator: Literal["all", "others"] = "all"

    def client_update(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[Params, tuple[()], Tensor]:
        model = ctx.model
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        margins = label_margins(model, y0, m0, self.tau)  # (C,) from every training example once
        others = self.denominator == "others"

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            def loss(q: Params) -> Tensor:
                return model.masked_mean(calibrated_nll(model, model.apply(q, x), y, margins, others), mask)

            return value_and_grad_of(loss, p)

        params, loss = local_sgd(grad_fn, payload, batches, lr, ctx.opt)
        return params, state, loss
