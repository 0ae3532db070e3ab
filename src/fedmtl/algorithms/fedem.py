"""FedEM: federated multi-task learning under a mixture of distributions.

Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021, Algorithm 1 and Eq. (6)-(10).

Each client's data is a mixture of M shared distributions; the server holds M component models
Theta = (theta_1..theta_M), each client t its mixture weights pi_t (kept across rounds).  One round for
a sampled client (all in one batched computation under the vmap runner: K clients x M components):

* E-step (8): q_t(z_i = m) = softmax_m(log pi_tm - l(theta_m; x_i, y_i)), in log space, computed once
  with the received components on the whole local training set;
* pi update (9): pi_tm = mean_i q_t(z_i = m);
* M-step (10): for each m, ``local_epochs`` of SGD on the q_m-weighted loss, sum_i q_im l_im / |batch|.

Server: theta_m <- sum_t n_t theta_mt / sum_t n_t over the clients that took part (the paper).
``server_average = "all_clients"`` reproduces the reference code instead: the average runs over all
clients with weights n_t / n, unsampled clients contributing the previous model (which shrinks the
step under partial participation).

Prediction for client t is the pi_t-weighted mixture of the components' *probabilities* (Eq. 6), not
of their logits; the evaluation loss is the NLL of that mixture.  The training loss a round logs is the M-step's:
the mean over local steps of the responsibility-weighted batch loss summed over components (with M = 1 exactly
FedAvg's mean batch loss).  Unseen clients receive Theta and fit
their pi by EM with Theta fixed on their own training split, iterated until the L1 change of pi is
below ``unseen_tol`` or ``unseen_max_iter`` iterations (the reference code instead runs one EM
iteration per evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.stacking import apply_stacked, clients_components_logits, stacked_grad
from ..optim import Batches, ClientBatches, StackedUnsupported, first_epoch, local_sgd, local_sgd_clients
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, nobody


class Mixture(NamedTuple):
    """Server state: the M component models, stacked (M, ...)."""

    components: Params


class MixtureWeights(NamedTuple):
    """Client state: the client's mixture weights pi (M,)."""

    pi: Tensor


class MixtureEval(NamedTuple):
    """What a client predicts with: the components and its pi."""

    components: Params
    pi: Tensor


MAX_COMPONENTS = 256


@dataclass(frozen=True)
class FedEM(Algorithm[Mixture, MixtureWeights]):
    name: ClassVar[str] = "fedem"
    runs_async: ClassVar[bool] = True  # sends models in the payload's coordinates (fedmtl.engine.asynchronous)
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # unseen clients fit pi on their training data
    keeps_client_state: ClassVar[bool] = True
    stacked_first_epoch: ClassVar[bool] = True  # client_update_clients' E-step reads the clients' first epochs
    #: M, the number of shared component models (at most 256)
    num_components: Annotated[int, Range(1, MAX_COMPONENTS)] = 3
    #: participants: average over the sampled clients (the paper); all_clients: the reference code (n-weighted mix
    #: with the old model)
    server_average: Literal["participants", "all_clients"] = "participants"
    #: unseen clients: EM for pi stops when pi moves less than this (L1)
    unseen_tol: Annotated[float, Range(0, 2)] = 1e-6
    #: unseen clients: at most this many EM iterations for pi
    unseen_max_iter: Annotated[int, Range(1, 10**5)] = 200

    def check_privacy(self) -> None:
        super().check_privacy()
        if self.server_average == "all_clients":
            raise ValueError("[privacy]: fedem with server_average = 'all_clients' scales the noised mean by the "
                             "participants' share of the examples, which is not private; use 'participants'")

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> Mixture:
        # component m starts from the initializer seeded with seed + m (as the reference code), so
        # component 0 is the model FedAvg starts from and FedEM with M = 1 is FedAvg.
        comps = [params] + [ctx.model.init(seed + m) for m in range(1, self.num_components)]
        comps = [T.to(c, next(iter(params.values())).device) for c in comps]
        return Mixture(T.stack(comps))

    def payload(self, server: Mixture) -> Params:
        return server.components

    def aggregate(self, ctx: Context, server: Mixture, updates: Params, weights: Tensor, clients: Tensor) -> Mixture:
        if nobody(ctx, weights):
            return server
        new = ctx.combine(updates, weights)  # (M, ...) average over participants
        if self.server_average == "all_clients":
            share = float(weights.sum()) / ctx.total_train  # n_participants / n
            new = T.tmap(lambda a, old: share * a + (1.0 - share) * old, new, server.components)
        return Mixture(new)

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: Mixture) -> MixtureWeights:
        return MixtureWeights(torch.full((self.num_components,), 1.0 / self.num_components))

    def component_nll(self, ctx: Context, comps: Params, x: Tensor, y: Tensor) -> Tensor:
        """(M, n) per-sample loss of every component."""
        return ctx.model.nll(apply_stacked(ctx.model, comps, x), y)

    @staticmethod
    def e_step(log_pi: Tensor, nll: Tensor) -> tuple[Tensor, Tensor]:
        """Responsibilities q (M, n) = softmax_m(log pi_m - nll_m) and per-sample log-likelihood (n,); ``log_pi``
        (M,), or (M, n): each example under its own client's pi (K clients at once)."""
        joint = (log_pi.unsqueeze(-1) if log_pi.dim() == 1 else log_pi) - nll  # (M, n)
        ll = torch.logsumexp(joint, dim=0)
        return torch.exp(joint - ll), ll

    def client_update(
        self, ctx: Context, payload: Params, state: MixtureWeights, batches: Batches, lr: float
    ) -> tuple[Params, MixtureWeights, Tensor]:
        x, y, mask = first_epoch(batches, ctx.local_epochs)
        nll = self.component_nll(ctx, payload, x, y)  # (M, S0*B)
        q, _ = self.e_step(torch.log(state.pi).to(nll.dtype), nll)
        # pi = the mean responsibility over the examples the client trained on (all of them, or under run.drop_last
        # those its first epoch kept); a client that kept none keeps its pi
        kept = mask.sum()
        pi = torch.where(kept > 0, (q * mask).sum(-1) / kept.clamp_min(1.0), state.pi.to(q.dtype))  # (M,)

        # M-step: all M components at once (stacked params, per-component weights q (M, S0*B))
        comps, m_loss = local_sgd(stacked_grad(ctx.model), payload, batches, lr, ctx.opt, sample_weight=q)
        return comps, MixtureWeights(pi.to(state.pi.dtype)), m_loss.sum(-1)

    def client_update_clients(
        self, ctx: Context, payload: Params, states: MixtureWeights, batches: ClientBatches, lr: float
    ) -> tuple[Params, MixtureWeights, Tensor]:
        """``client_update`` of K clients from one payload (the stacked executor): pi (K, M), components (K, M, ...);
        the E-step on their examples (N0, packed or the batches themselves: ``batches.first``), each under its
        client's pi; pi summed per client; the M-step with the responsibilities q (M, N0)."""
        if batches.first is None:
            raise StackedUnsupported("FedEM's clients' batches need their first epochs (stacked_first_epoch)")
        x, y, owner, mask = batches.first
        k = batches.n.shape[0]
        nll = ctx.model.nll(clients_components_logits(ctx.model, payload, x), y)  # (M, N0)
        q, _ = self.e_step(torch.log(states.pi).to(nll.dtype).T[:, owner], nll)  # (M, N0)
        kept = mask.new_zeros(k).index_add_(0, owner, mask).unsqueeze(-1)  # (K, 1): as client_update's ``kept``
        pi = q.new_zeros(k, q.shape[0]).index_add_(0, owner, (q * mask).T) / kept.clamp_min(1.0)  # (K, M)
        pi = torch.where(kept > 0, pi, states.pi.to(pi.dtype))
        comps, m_loss = local_sgd_clients(ctx.model, payload, batches, lr, ctx.opt, sample_weight=q, components=True)
        return comps, MixtureWeights(pi.to(states.pi.dtype)), m_loss.sum(-1)  # (K,)

    # -- evaluation -----------------------------------------------------------------------------
    def fit_pi(self, ctx: Context, comps: Params, pi0: Tensor, batches: Batches) -> Tensor:
        """EM for pi with the components fixed, to convergence (vmap-safe fixed iteration count)."""
        x, y, mask = first_epoch(batches, self.adapt_epochs)
        nll = self.component_nll(ctx, comps, x, y)
        pi = pi0.to(nll.dtype)
        done = torch.zeros((), dtype=torch.bool)
        for _ in range(self.unseen_max_iter):
            q, _ = self.e_step(torch.log(pi), nll)
            new = torch.where(mask.sum() > 0, (q * mask).sum(-1) / mask.sum().clamp_min(1.0), pi)
            done = done | ((new - pi).abs().sum() < self.unseen_tol)
            pi = torch.where(done, pi, new)
        return pi

    def personalize(
        self, ctx: Context, payload: Params, state: MixtureWeights, batches: Batches | None, lr: float, seen: bool
    ) -> MixtureEval:
        pi = state.pi
        if not seen:
            assert batches is not None
            pi = self.fit_pi(ctx, payload, pi, batches)
        return MixtureEval(payload, pi)

    def predict_log_proba(self, ctx: Context, eval_state: MixtureEval, x: Tensor) -> Tensor:
        """log sum_m pi_m p_m(y | x): (n, C), a mixture of probabilities (Eq. 6)."""
        logp = ctx.model.log_proba(apply_stacked(ctx.model, eval_state.components, x))  # (M, n, C)
        log_pi = torch.log(eval_state.pi).to(logp.dtype).view(-1, 1, 1)
        return torch.logsumexp(logp + log_pi, dim=0)
