"""MR-MTL: mean-regularized multi-task learning.

Liu, Hu, Wu, Smith, "On Privacy and Personalization in Cross-Silo Federated Learning", NeurIPS 2022 (arXiv
2206.07902), Section 3 (the mean-regularized objective) and its MR-MTL algorithm.

Each client k keeps its own model w_k for the whole run; the server keeps only the average w_bar of the personal
models.  The objective is

    min_{w_1..w_K}  sum_k F_k(w_k) + (lambda / 2) sum_k ||w_k - w_bar||^2,   w_bar = (1/K) sum_k w_k,

solved by alternating (the paper's algorithm): the server broadcasts w_bar; each sampled client takes its local steps
on F_k(w_k) + (lambda / 2) ||w_k - w_bar||^2 from ITS OWN w_k (never reset to w_bar) and sends the new w_k; the server
sets w_bar to the mean of the received models.  Unlike Ditto there is no separately trained global model: the only
thing shared is the mean of the personal ones (one model sent each way, as FedAvg).  lambda = 0 is Local training
exactly (tested); as lambda grows the personal models are pinned to their mean (FedAvg-like).

Choices, stated where implemented: the mean is uniform over the round's clients (the objective's w_bar, and the
FL4Health example's aggregation); ``weighted = true`` weights it by sample counts (FedAvg's weighting, and the
authors' code's default, which its ``--unweighted_updates`` flag turns off).  Under partial participation
(``run.sampling_rate < 1``) w_bar is the mean of the round's received models, not of all K personal models: the paper
is cross-silo, every silo in every round, where the two are the same.  Every client starts at the common initial
model (the authors' code draws each client's own).  Clients outside the federation (unseen) start from w_bar and take
their epochs on the same regularized objective before testing (the paper has none).  The paper's privacy notion is
silo-specific *sample-level* DP (each client runs DP-SGD on its own examples), which fedmtl does not implement; under
``[privacy]`` the engine's user-level DP applies instead (the server releases a noised, clipped mean of the personal
models).  The paper tunes lambda per data set and privacy
level and gives no single default: ``lam = 1.0`` is this library's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from torch import Tensor

from ..optim import Batches, ClientBatches, local_sgd, local_sgd_clients
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, GlobalModel, nobody


class PersonalModel(NamedTuple):
    """Client state: the client's own model w_k."""

    w: Params


@dataclass(frozen=True)
class MRMTL(Algorithm[GlobalModel, PersonalModel]):
    """MR-MTL: personal models trained with a proximal pull towards their mean, the only thing the server keeps and
    broadcasts (lambda = 0: Local; lambda large: the models pinned to their mean)."""

    name: ClassVar[str] = "mrmtl"
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # unseen clients train from the mean first
    keeps_client_state: ClassVar[bool] = True
    #: lambda, the pull of each personal model towards the mean of all of them (0 = Local training; the paper tunes
    #: it per data set: no paper default)
    lam: Annotated[float, Range(0, 1e4)] = 1.0
    #: weight the server's mean by sample counts (FedAvg's weighting, the authors' code's default) instead of uniformly
    #: (the objective's w_bar)
    weighted: bool = False

    def init_client(self, ctx: Context, server: GlobalModel) -> PersonalModel:
        # every client starts at the common initial model (a choice: the authors' code draws each client's own)
        return PersonalModel(server.params)

    def client_update(
        self, ctx: Context, payload: Params, state: PersonalModel, batches: Batches, lr: float
    ) -> tuple[Params, PersonalModel, Tensor]:
        # local steps on F_k(w_k) + lambda/2 ||w_k - w_bar||^2 from the client's own w_k (Section 3's objective;
        # the gradient of the penalty is lambda (w_k - w_bar), local_sgd's proximal term)
        w, loss = local_sgd(ctx.model.value_and_grad, state.w, batches, lr, ctx.opt, prox_center=payload,
                            prox_mu=self.lam)
        return w, PersonalModel(w), loss

    def client_update_clients(
        self, ctx: Context, payload: Params, states: PersonalModel, batches: ClientBatches, lr: float
    ) -> tuple[Params, PersonalModel, Tensor]:
        w, loss = local_sgd_clients(ctx.model, states.w, batches, lr, ctx.opt, prox_center=payload, prox_mu=self.lam)
        return w, PersonalModel(w), loss

    def aggregate(self, ctx: Context, server: GlobalModel, updates: Params, weights: Tensor,
                  clients: Tensor) -> GlobalModel:
        if nobody(ctx, weights):
            return server
        # w_bar = (1/K) sum_k w_k over the round's valid clients (uniform, the objective's mean); excluded rows
        # (weight 0) stay out either way.  Deviation under partial participation: the mean of the round's clients, not
        # of all K personal models (the paper's silos all take part in every round: the same mean)
        ok = (weights > 0).to(weights.dtype)
        return GlobalModel(ctx.combine(updates, weights if self.weighted else ok))

    def personalize(
        self, ctx: Context, payload: Params, state: PersonalModel, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return state.w
        assert batches is not None  # an unseen client: from w_bar, on the same regularized objective
        return local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt, prox_center=payload,
                         prox_mu=self.lam)[0]
