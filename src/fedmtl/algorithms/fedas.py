"""FedAS: federated parameter-alignment and client-synchronization.

Yang, Huang, Ye, "FedAS: Bridging Inconsistency in Personalized Federated Learning", CVPR 2024 (pp. 11986-11995).
Sources read: the paper's abstract (the stored copies reached no further) and the authors' code
(xiyuanyang45/FedAS: ``clientas.py``, ``serveras.py``) for the formulas and numbers below; the paper's equation
numbers could not be read, so the steps are cited by the paper's two components, (PA) parameter alignment and (CS)
client synchronization, and by their symbols.

The model is split into a shared body (the feature extractor f, ``Model.features``) and a personal head
(``Model.head``; a model without the split is refused).  Every client keeps its whole personal model
theta_i = (phi_i, h_i).  A sampled client i that receives the global body phi_g:

1. (PA) computes its class prototypes with its own body, p_i,c = mean_{y_l = c} f_{phi_i}(x_l), and aligns the
   *received* body to them for ``align_epochs`` epochs of plain SGD at rate ``align_lr``,

       min_phi  sum_{c in batch} (1/|B_c|) sum_{l in B_c} ||f_phi(x_l) - p_i,c||^2 / d

   (a mean-squared error per class present in the batch, summed over classes), so that the shared parameters
   "learn from the previous model" before they replace the local body;
2. trains the aligned body and its own head together for ``run.local_epochs`` epochs (cross-entropy) and keeps the
   result as its personal model;
3. (CS) computes the trace of the Fisher information of its trained model on its training data, as the authors'
   code estimates it, F_i = sum_b ||grad_theta L_b(theta_i)||^2 over its mini-batches b (L_b the batch-mean negative
   log-likelihood; ``fisher = "batch"``), or as the empirical Fisher's trace over single examples,

       F_i = tr I(theta_i) = (1/n_i) sum_l ||grad_theta log p(y_l | x_l; theta_i)||^2   (``fisher = "sample"``),

   and sends its body with F_i.

The server aggregates the bodies weighted by their Fisher traces, phi_g = sum_i F_i phi_i / sum_i F_i (CS), so that
under-trained clients (stragglers) weigh less.  ``weighting = "samples"`` weighs by n_i instead (the authors'
``--wo_global`` ablation); ``align_epochs = 0`` skips PA (their ``--wo_local``).  With both, FedAS is FedPer whose
clients predict with their own trained body (tested).

Deviations and choices, each stated where it is implemented:
* ``fisher = "batch"`` (default) is the authors' estimate; the paper's own estimator could not be read, so the
  textbook empirical Fisher over single examples is offered as ``fisher = "sample"`` (per-example gradients: about
  ten times the cost of a local epoch on the bundled MLP; scale and noise differ, and only the ratios F_i / sum F_j
  matter);
* the alignment runs on the round's batches (``run.batch_size``); the authors' code uses batches of 16;
* a straggler (``[systems]``) aligns in full and cuts its training short, as the authors' slow clients do (their
  alignment happens on receipt of the model, their training runs fewer epochs): the step budget counts training
  steps only;
* the authors' clients that are not sampled also recompute their Fisher trace each round, which the server never
  reads (only sampled clients' traces weigh their uploads): not done;
* unseen clients (outside the federation) have no personal model: they train the initial head on the global body
  for ``unseen_head_epochs`` epochs, as FedPer's do;
* the server combines its own weights: robust aggregators and ``[privacy]`` are refused (``averages_updates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from ..data.federated import steps_per_epoch
from ..models.base import Model
from ..optim import SGD, Batches, GradFn, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, nobody
from .bodyhead import SplitModel, with_personal_head
from .fedproto import grad_with_aux, local_prototypes, one_hot, representation_dim


class ASClient(NamedTuple):
    """Client state: the client's whole personal model theta_i (its body and head)."""

    params: Params


class ASUpdate(NamedTuple):
    """A client's update: its trained body and the trace F_i of its model's Fisher information (())."""

    body: Params
    fisher: Tensor


def fisher_trace(model: Model, params: Params, batches: Batches, steps: int, per_sample: bool) -> Tensor:
    """F_i over the real examples of the first ``steps`` batches.  ``per_sample``: (1/n) sum_l ||grad log p(y_l|x_l)||^2
    (per-example gradients, ``torch.func.vmap``); otherwise the authors' sum over batches of ||grad of the batch-mean
    negative log-likelihood||^2.  vmap-safe."""
    dev = next(iter(params.values())).device
    total = torch.zeros((), dtype=torch.float32, device=dev)
    count = torch.zeros((), dtype=torch.float32, device=dev)
    frozen = {k: v.detach() for k, v in params.items()}
    for s in range(steps):
        x, y, mask = batches.x[s], batches.y[s], batches.mask[s]
        m = mask.to(torch.float32)
        if per_sample:
            def one(p: Params, xi: Tensor, yi: Tensor) -> Tensor:
                return model.nll(model.apply(p, xi.unsqueeze(0)), yi.unsqueeze(0)).sum()

            g = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(frozen, x, y)
            sq = torch.stack([v.reshape(v.shape[0], -1).pow(2).sum(-1) for v in g.values()]).sum(0)  # (B,)
            total = total + (sq * m).sum()
            count = count + m.sum()
        else:
            g = torch.func.grad(model.loss)(frozen, x, y, mask)
            total = total + torch.stack([v.pow(2).sum() for v in g.values()]).sum()
    return total / count.clamp_min(1.0) if per_sample else total


def split_budget(batches: Batches, cut: int) -> tuple[Batches, Batches]:
    """(the batches of the alignment, the batches of the training) of a client whose first ``cut`` steps align: the
    alignment runs whole, a straggler's ``limit`` (its budget of training steps, ``FedAS.step_budget``) counts from
    the first training step."""
    if batches.limit is None or not cut:
        return batches, batches
    masks = batches.mask[:cut]
    if isinstance(masks, list):
        aligned = torch.stack([m.sum() > 0 for m in masks]).sum().to(batches.limit.device)
    else:
        aligned = (masks.sum(-1) > 0).sum()
    whole = batches._replace(limit=None, all_live=None)
    return whole, batches._replace(limit=batches.limit + aligned, all_live=None)


def alignment_step(model: Model, head: Params, protos: Tensor, counts: Tensor) -> GradFn:
    """The PA step ``(body, x, y, mask, weight) -> (grads, loss)``: the per-class mean-squared distance of the received
    body's features to the client's prototypes, summed over the classes present in the batch."""
    def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
        m = mask.to(protos.dtype)
        onehot = one_hot(model, y, protos.dtype) * m.unsqueeze(-1)  # (B, C), padding rows zero
        has = (counts > 0).to(protos.dtype)  # classes with a prototype (every local class)
        in_batch = onehot.sum(0)  # |B_c|

        def loss(q: Params) -> tuple[Tensor, Tensor]:
            z = model.features({**q, **head}, x)
            d2 = ((z.unsqueeze(1) - protos.unsqueeze(0)) ** 2).mean(-1)  # (B, C): ||z_l - p_c||^2 / d
            per_class = (onehot * d2).sum(0) / in_batch.clamp_min(1.0)  # MSE over the class's examples
            value = (per_class * has).sum()
            return value, value.detach()

        return grad_with_aux(loss, p)

    return grad_fn


@dataclass(frozen=True)
class FedAS(Algorithm[SplitModel, ASClient]):
    """FedAS: the received body aligned to the client's own class prototypes before local training (PA); the server
    averages the bodies weighted by their Fisher information's trace (CS)."""

    name: ClassVar[str] = "fedas"
    # the Fisher weights favour the clients furthest from a fit: under stragglers the toy loss falls more slowly
    toy: ClassVar[Toy] = Toy(model="mlp", rounds=25)
    needs_adaptation: ClassVar[bool] = True  # unseen clients train a head first
    keeps_client_state: ClassVar[bool] = True
    # the server weighs bodies by the clients' Fisher traces, not by sample counts: robust aggregators and [privacy]
    # do not apply (check_privacy refuses it)
    averages_updates: ClassVar[bool] = False
    #: PA: epochs of aligning the received body to the client's prototypes (0: no alignment, the authors' wo_local)
    align_epochs: Annotated[int, Range(0, 1000)] = 1
    #: PA: the alignment's learning rate (plain SGD, constant; the authors' code: 0.01)
    align_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.01
    #: CS: how the server weighs the bodies: by the Fisher information's trace F_i, or by sample counts n_i
    weighting: Literal["fisher", "samples"] = "fisher"
    #: F_i over mini-batch mean gradients (the authors' code) or over single examples (the empirical Fisher)
    fisher: Literal["batch", "sample"] = "batch"
    #: unseen clients: epochs of head training (body fixed) on their training data before testing
    unseen_head_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_head_epochs

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)

    def train_epochs(self, local_epochs: int) -> int:
        return self.align_epochs + local_epochs

    def step_budget(self, counts: Tensor, batch_size: int, epochs: int) -> Tensor:
        # the alignment is part of receiving the model (the authors' set_parameters), not of the local training a
        # straggler cuts short (their train(): fewer epochs): a device's budget counts the training steps only
        return steps_per_epoch(counts, batch_size) * epochs

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> SplitModel:
        return SplitModel(*ctx.model.split(params, self.name))  # the body aggregated, the initial head kept

    def payload(self, server: SplitModel) -> SplitModel:
        return server

    def update_like(self, ctx: Context, payload: SplitModel) -> ASUpdate:
        return ASUpdate(payload.params, torch.zeros((), device=next(iter(payload.params.values())).device))

    def aggregate(self, ctx: Context, server: SplitModel, updates: ASUpdate, weights: Tensor,
                  clients: Tensor) -> SplitModel:
        if nobody(ctx, weights):
            return server
        ok = weights > 0
        w = weights
        if self.weighting == "fisher":
            f = updates.fisher.to(weights.device, weights.dtype)
            fw = torch.where(ok, f, torch.zeros_like(f)).clamp_min(0.0)  # excluded rows never read (NaN-safe)
            # CS: phi_g = sum_i F_i phi_i / sum_i F_i; every trace 0 (a model that fits exactly): sample counts
            w = torch.where(fw.sum() > 0, fw, weights)
        return server._replace(params=ctx.combine(updates.body, w))

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: SplitModel) -> ASClient:
        return ASClient({**server.params, **server.fixed})  # the initial model

    def client_update(
        self, ctx: Context, payload: SplitModel, state: ASClient, batches: Batches, lr: float
    ) -> tuple[ASUpdate, ASClient, Tensor]:
        model = ctx.model
        epochs = self.train_epochs(ctx.local_epochs)
        per_epoch = len(batches.x) // epochs
        cut = self.align_epochs * per_epoch
        own_body, head = model.split(state.params, self.name)
        body = payload.params
        align, train = split_budget(batches, cut)
        if cut:
            # PA, step 1: the prototypes p_i,c of the client's own (previous) body, then the received body aligned
            # to them
            x0, y0, m0 = first_epoch(batches, epochs)
            local = local_prototypes(model, state.params, x0, y0, m0)
            body, _ = local_sgd(alignment_step(model, head, local.protos.detach(), local.counts.detach()), body,
                                align, self.align_lr, SGD(self.align_lr), steps=slice(0, cut))
        # step 2: the aligned body and the personal head trained together; the result is the personal model
        new, loss = local_sgd(model.value_and_grad, {**body, **head}, train, lr, ctx.opt, steps=slice(cut, None))
        # CS, step 3: the Fisher information's trace of the trained model on the client's data (the first epoch's
        # batches hold every example once)
        fisher = fisher_trace(model, new, batches, per_epoch, self.fisher == "sample")
        trained_body, _ = model.split(new, self.name)
        return ASUpdate(trained_body, fisher.detach()), ASClient(new), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: SplitModel, state: ASClient, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return state.params  # the client's own trained model
        return with_personal_head(ctx, payload.params, payload.fixed, batches, lr, seen)
