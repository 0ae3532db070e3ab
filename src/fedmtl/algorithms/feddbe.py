"""FedDBE: FedAvg with the Domain Bias Eliminator.

Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan, "Eliminating Domain Bias for Federated Learning in Representation Space",
NeurIPS 2023 (arXiv 2311.14975): DBE, the Domain Bias Eliminator (the Personalized Representation Bias Memory, PRBM,
and Mean Regularization, MR), on FedAvg (FedDBE).  Sources read: the paper's abstract and introduction and the
authors' code (TsingZ0/DBE: ``clientDBE.py``, ``serverDBE.py``, ``run_me.sh``) for the formulas and numbers below;
the paper's section and equation numbers could not be read, so the equations are cited by their symbols.

The model is split into a feature extractor f (the body, ``Model.features``) and a head g (``Model.apply_head``);
both are shared and averaged as in FedAvg.  DBE adds, per client i:

* PRBM (the personalized representation bias memory): a trainable vector z_bar^p_i (d,), zero at first, kept by the
  client and never sent; the head reads the representation z_i = z^g_i + z_bar^p_i, with z^g_i = f(x);
* MR (mean regularization): the running mean of the global representation over the local steps,
  z_bar^g_i <- (1 - mu) z_bar^g_i + mu mean_batch(f(x))  (reset to 0 each round, the previous value held constant),
  is pulled towards the consensus z_bar^g, the counts-weighted mean of the clients' z_bar^g_i collected once in the
  initialization period and fixed afterwards.

A client's local objective, once the consensus exists:

    L_i = CE(g(f(x) + z_bar^p_i), y) + kappa R(z_bar^g_i, z_bar^g),   R(a, b) = (1/d) sum_j (a_j - b_j)^2 / 2,

with f, g and z_bar^p_i trained jointly by the run's local optimizer for ``run.local_epochs`` epochs; the client sends
f and g, the server averages them weighted by sample counts.  A client predicts with g(f(x) + z_bar^p_i); an unseen
client (z_bar^p = 0) predicts with the global model.

Defaults: kappa = 50 and mu = 1 (the authors' Fashion-MNIST run, ``run_me.sh``: ``-klw 50 -mo 1``; mu = 1 makes
z_bar^g_i the current batch's mean representation).

Choices and deviations, each stated where it is implemented:
* the initialization period: the authors' server first lets every client train one local pass without DBE, only to
  collect z_bar^g, and discards that training.  Here the first round is that period: its clients train as FedAvg
  (no PRBM, no MR) and send z_bar^g_i with their models, their counts-weighted mean becomes z_bar^g and the round's
  models are kept (averaged) as in any FedAvg round.  With full participation the consensus is formed from every
  client, as the authors'; with partial participation from the first round's clients only;
* R is the mean over the d coordinates of half the squared difference (the authors' ``mean(0.5 (a - b)^2)``);
* ``[privacy]`` is refused (``check_privacy``): the consensus is a one-time release that the server then keeps;
* z_bar^p_i trains with the run's local optimizer (momentum and weight decay included) at the run's rate; the
  authors' code steps it with plain SGD at the same rate (their model optimizer is plain SGD too, so with
  ``optim.momentum = 0`` and ``weight_decay = 0`` the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from ..models.base import Model
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, nobody
from .fedproto import grad_with_aux, representation_dim

#: the PRBM vector and the running mean while they train beside the model (the latter a statistic: assigned by
#: ``local_sgd``, never stepped)
PRBM, RUNNING = "dbe.prbm", "dbe.running_mean"


class DBEServer(NamedTuple):
    """Server state (also the payload): the global model (body and head), the consensus z_bar^g (d,) and whether it
    exists yet (() 0. before the initialization round, 1. after)."""

    params: Params
    mean: Tensor
    ready: Tensor


class DBEUpdate(NamedTuple):
    """A client's update: its trained model and its running mean z_bar^g_i at the end of the round (read by the server
    in the initialization round only)."""

    params: Params
    mean: Tensor


class PRBMState(NamedTuple):
    """Client state: its personalized representation bias z_bar^p_i (d,)."""

    prbm: Tensor


class DBEEval(NamedTuple):
    params: Params
    prbm: Tensor


def dbe_logits(model: Model, params: Params, prbm: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(logits g(f(x) + z_bar^p), representations f(x))."""
    z = model.features(params, x)
    return model.apply_head(params, z + prbm), z


@dataclass(frozen=True)
class FedDBE(Algorithm[DBEServer, PRBMState]):
    """FedDBE: FedAvg whose clients add a personal bias vector to the representation before the head and pull the
    running mean of their representations towards a global consensus mean."""

    name: ClassVar[str] = "feddbe"
    toy: ClassVar[Toy] = Toy(model="mlp", kwargs={"kappa": 1.0})
    keeps_client_state: ClassVar[bool] = True
    public_server_state: ClassVar[dict[str, str]] = {
        "ready": "whether the initialization round has passed: a function of the round number only"}
    #: kappa, the weight of the mean regularization (the authors' Fashion-MNIST setting)
    kappa: Annotated[float, Range(0, 1e4)] = 50.0
    #: mu, the momentum of the running mean of the representations (1: the current batch's mean)
    mu: Annotated[float, Range(0, 1, lo_open=True)] = 1.0

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)

    def check_privacy(self) -> None:
        # the consensus z_bar^g is released once (the initialization round) and then kept: the engine's user-level DP
        # releases a fresh noised mean of every field each round, so [privacy] is refused rather than half applied
        raise ValueError("[privacy]: feddbe keeps the consensus mean of its initialization round fixed; user-level DP "
                         "applies to methods whose server releases a fresh noised mean every round")

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> DBEServer:
        ref = next(iter(params.values()))
        d = representation_dim(ctx.model, self.name)
        return DBEServer(params, torch.zeros(d, dtype=ref.dtype, device=ref.device),
                         torch.zeros((), dtype=ref.dtype, device=ref.device))

    def payload(self, server: DBEServer) -> DBEServer:
        return server

    def update_like(self, ctx: Context, payload: DBEServer) -> DBEUpdate:
        return DBEUpdate(payload.params, payload.mean)

    def aggregate(self, ctx: Context, server: DBEServer, updates: DBEUpdate, weights: Tensor,
                  clients: Tensor) -> DBEServer:
        if nobody(ctx, weights):
            return server
        mixed = ctx.combine(updates, weights)  # FedAvg on (f, g); and the counts-weighted mean of z_bar^g_i
        # MR's consensus z_bar^g: collected in the initialization (first) round, fixed afterwards
        ready = server.ready
        mean = torch.where(ready > 0, server.mean, mixed.mean.to(server.mean.dtype))
        return DBEServer(mixed.params, mean, torch.ones_like(ready))

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: DBEServer) -> PRBMState:
        return PRBMState(torch.zeros_like(server.mean))  # PRBM starts at zero

    def client_update(
        self, ctx: Context, payload: DBEServer, state: PRBMState, batches: Batches, lr: float
    ) -> tuple[DBEUpdate, PRBMState, Tensor]:
        model, kappa, mu = ctx.model, self.kappa, self.mu
        on = payload.ready  # 0 in the initialization round: plain FedAvg training, no PRBM and no MR
        target = payload.mean

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)
            n = m.sum().clamp_min(1.0)

            def loss(q: Params) -> tuple[Tensor, Tensor]:
                params = {k: v for k, v in q.items() if not k.startswith("dbe.")}
                logits, z = dbe_logits(model, params, on * q[PRBM], x)  # z = z^g + z_bar^p (PRBM)
                ce = (model.nll(logits, y) * m).sum() / n
                # MR: the running mean with the previous value held constant, then R(z_bar^g_i, z_bar^g)
                running = (1 - mu) * q[RUNNING].detach() + mu * (z * m.unsqueeze(-1)).sum(0) / n
                reg = (0.5 * (running - target) ** 2).mean()
                return ce + on * kappa * reg, torch.cat([ce.detach().reshape(1), running.detach()])

            g, aux = grad_with_aux(loss, p)
            return {**g, RUNNING: aux[1:]}, aux[0]  # the running mean is assigned (a statistic), not stepped

        start = {**payload.params, PRBM: state.prbm, RUNNING: torch.zeros_like(state.prbm)}  # reset each round
        new, loss = local_sgd(grad_fn, start, batches, lr, ctx.opt)
        params = {k: v for k, v in new.items() if not k.startswith("dbe.")}
        return DBEUpdate(params, new[RUNNING]), PRBMState(new[PRBM]), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: DBEServer, state: PRBMState, batches: Batches | None, lr: float, seen: bool
    ) -> DBEEval:
        return DBEEval(payload.params, state.prbm)  # an unseen client's PRBM is zero: the global model

    def predict_log_proba(self, ctx: Context, eval_state: DBEEval, x: Tensor) -> Tensor:
        return ctx.model.log_proba(dbe_logits(ctx.model, eval_state.params, eval_state.prbm, x)[0])

