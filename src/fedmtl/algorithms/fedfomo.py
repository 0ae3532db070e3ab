"""FedFomo: federated first-order model optimization.

Zhang, Sapra, Fidler, Yeung, Alvarez, "Personalized Federated Learning with First Order Model Optimization",
ICLR 2021, Section 3.

Every client keeps a personal model, and the server keeps every client's latest model.  In a round, client i
downloads M other clients' models theta_n and weights each by how much it lowers the loss L_i on i's local
validation split, per unit of distance from i's previous model (Section 3, the first-order weights):

    w_n = (L_i(theta_i^{t-1}) - L_i(theta_n)) / ||theta_n - theta_i^{t-1}||,
    w_n <- max(w_n, 0) / sum_m max(w_m, 0),                                      (0 where no w_m is positive)
    theta_i^t = theta_i^{t-1} + sum_n w_n (theta_n - theta_i^{t-1}),

then trains theta_i^t by ``run.local_epochs`` of local SGD on its training split and uploads it with the weights it
used.  Models that do not help get weight 0: with no helpful model the client's update is plain local training of
its previous model.  The server adds each client's weights into the affinity matrix, P_{i,n} += w_n, and picks the
M models client i downloads next round epsilon-greedily from its row (Section 3, model sampling): with probability
epsilon_t the M are other clients chosen uniformly at random, otherwise the M of largest affinity (ties in random
order), with epsilon_t = max(epsilon - epsilon_decay * t, 0) after t aggregations.

Defaults: epsilon = 0.3 decreased by 0.05 a round, 20% of the local data as the validation split (80/20), and the
paper's "5 models", which the authors' README runs as 4 other clients' models beside the client's own
(``num_models`` = 4 counts the others).  The authors' code offers variants (an L1 norm of the model change, a
softmax of the weights); this module follows Section 3's formula (the L2 norm, clipped and normalized weights).

Engine form (the design of fedmtl, not the paper's, where noted):

* ``client_update`` is pure and vmap-safe, so the epsilon-greedy draw happens on the server: ``aggregate`` draws
  every client's M ids for the next round with a ``torch.Generator`` seeded from (run seed, aggregation count),
  host-side, and the payload carries the table of models and the (N, M) ids.
* The validation split: the client receives only training batches, so a fixed part of its training examples is held
  out: example j of the client (its index ``Batches.idx`` among the client's own examples) is a validation example
  when frac(j / golden ratio) < ``val_fraction`` (a low-discrepancy sequence: about ``val_fraction`` of every client's
  examples, the same ones every round, whatever the order the examples are stored in; example 0 always, so every
  client with data has one).  L_i is the mean loss on those of the round's first epoch; local SGD trains on the
  others only (the validation slots masked out of every step).
* A client's previous model theta_i^{t-1} is its row of the server's table (the table's rows all start from the
  initial model: the first round is plain local training, every candidate being at distance 0, weight 0), and it
  predicts with that row.  A client never sampled predicts with the initial model.
* Unseen clients (outside the federation, ``needs_adaptation``): no row and no affinity, so they weight ALL N
  models of the table on their training data with the same first-order rule, around the table's mean model, and
  predict with the result (no local training).  The paper does not treat such clients.
* Where the id table asks for more models than there are other clients (M > N - 1), the extra slots name the client
  itself: a candidate at distance 0, weight 0.
* Under ``[systems]`` stragglers and drops, and client sampling, the round counter counts aggregations (a round in
  which nobody trained leaves the server, epsilon included, as it was).

Memory: the server holds the table of every client's latest model, N x the model's size, plus the (N, N) affinity
matrix; the payload carries the whole table (over Flower every node receives it, not only its clients' rows).
The server keeps the clients' models as they are, it averages nothing: ``[privacy]`` is refused and robust
aggregators do not apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.base import Model
from ..models.stacking import apply_stacked
from ..optim import Batches, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, row

#: 1 / golden ratio: frac(j * PHI) for j = 0, 1, 2, ... is evenly spread over [0, 1) (a Weyl sequence)
PHI = (math.sqrt(5.0) - 1.0) / 2.0


class FomoServer(NamedTuple):
    """Server state: every client's latest model (N, ...), the affinity matrix P (N, N), the ids each client
    downloads next round (N, M), the number of aggregations so far and the run's seed (the draws' source)."""

    models: Params
    affinity: Tensor
    selected: Tensor
    round: Tensor
    seed: Tensor


class FomoPayload(NamedTuple):
    """What the server broadcasts: the table of models (N, ...) and the ids each client downloads (N, M)."""

    models: Params
    selected: Tensor


class FomoUpdate(NamedTuple):
    """What a client sends: its new model theta_i^t, the ids of the M models it weighted and their weights w (M,)."""

    params: Params
    selected: Tensor
    weights: Tensor


def validation_examples(idx: Tensor, fraction: float) -> Tensor:
    """(...) bool: whether the client's example of index ``idx`` (its place among the client's own examples) belongs
    to its validation split: frac(idx * PHI) < ``fraction``."""
    u = torch.remainder(idx.to(torch.float64) * PHI, 1.0)
    return u < fraction


def first_order_weights(ref_loss: Tensor, losses: Tensor, dist: Tensor) -> Tensor:
    """(M,) FedFomo's weights (Section 3): (L(theta_i) - L(theta_n)) / ||theta_n - theta_i||, negative ones set to 0,
    the positive ones normalized to sum 1 (all 0 where none is positive); a candidate at distance 0 (the client's own
    model, an identical one) gets 0."""
    raw = torch.where(dist > 0, (ref_loss - losses) / dist.clamp_min(1e-30), torch.zeros_like(losses))
    pos = raw.clamp_min(0.0)
    total = pos.sum()
    return torch.where(total > 0, pos / total.clamp_min(1e-30), torch.zeros_like(pos))


def distances(candidates: Params, ref: Params) -> Tensor:
    """(M,) ||theta_n - theta_ref|| (L2 over every parameter) of M stacked ``candidates``."""
    sq = [((candidates[k] - r.unsqueeze(0)) ** 2).reshape(candidates[k].shape[0], -1).sum(1) for k, r in ref.items()]
    return torch.sqrt(torch.stack(sq).sum(0))


def combine(ref: Params, candidates: Params, w: Tensor) -> Params:
    """theta_ref + sum_n w_n (theta_n - theta_ref) (Section 3's update)."""

    def one(r: Tensor, c: Tensor) -> Tensor:
        wn = w.to(c.dtype).reshape(-1, *([1] * r.dim()))
        return r + (wn * (c - r.unsqueeze(0))).sum(0)

    return {k: one(ref[k], candidates[k]) for k in ref}


def masked_losses(model: Model, candidates: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """(M,) mean losses of M stacked models on the examples of ``x`` where ``mask`` is 1."""
    return model.masked_mean(model.nll(apply_stacked(model, candidates, x), y), mask)


@dataclass(frozen=True)
class FedFomo(Algorithm[FomoServer, ClientId]):
    """FedFomo: each client mixes into its model the other clients' models that lower its validation loss, weighted
    by the loss decrease per unit distance, then trains locally; the server picks who downloads whom."""

    name: ClassVar[str] = "fedfomo"
    needs_adaptation: ClassVar[bool] = True  # unseen clients weight the table's models on their training data
    averages_updates: ClassVar[bool] = False  # the server keeps a table of models, it averages nothing
    #: M, the other clients' models each client downloads and weights a round (the paper's "5 models": 4 + its own)
    num_models: Annotated[int, Range(1, 10**4)] = 4
    #: epsilon, the probability that a client's M models are drawn at random instead of by affinity (first round)
    epsilon: Annotated[float, Range(0, 1)] = 0.3
    #: how much epsilon decreases after every round (linear decay, floored at 0)
    epsilon_decay: Annotated[float, Range(0, 1)] = 0.05
    #: the fraction of each client's training examples held out as its validation split (the paper's 80/20 split)
    val_fraction: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 0.2
    #: unseen clients: the table's models weighted in each forward pass (memory against passes)
    unseen_chunk: Annotated[int, Range(1, 10**6)] = 64

    # -- server ---------------------------------------------------------------------------------
    def epsilon_at(self, t: int) -> float:
        """epsilon_t after t aggregations: max(epsilon - epsilon_decay * t, 0)."""
        return max(self.epsilon - self.epsilon_decay * t, 0.0)

    def select(self, affinity: Tensor, seed: int, t: int) -> Tensor:
        """(N, M) long: the ids each client downloads in the round after t aggregations (Section 3's
        epsilon-greedy sampling), drawn on the host from a generator seeded with (seed, t): with probability
        epsilon_t a client's M ids are M other clients at random, otherwise the M of largest affinity P_{i,.} (ties,
        as the all-zero rows of the first rounds, in random order); never the client itself, except as filler where
        M > N - 1 (a model at distance 0, weight 0)."""
        p = affinity.detach().to("cpu", torch.float64)
        n, m = p.shape[0], self.num_models
        g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(t) * 7_919 + 12_345) % (2**62))
        explore = torch.rand(n, generator=g, dtype=torch.float64) < self.epsilon_at(t)
        keys = torch.rand(n, n, generator=g, dtype=torch.float64)
        score = torch.where(explore.unsqueeze(1), torch.zeros_like(p), p)
        score = score.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))  # never the client itself
        perm = torch.argsort(keys, dim=1)  # a random order, the tie-break
        order = torch.argsort(torch.gather(score, 1, perm), dim=1, descending=True, stable=True)
        ranked = torch.gather(perm, 1, order)  # (N, N): by affinity, ties at random; the client itself last
        sel = ranked[:, : min(m, n)]
        if m > n:
            sel = torch.cat([sel, torch.arange(n).unsqueeze(1).expand(n, m - n)], 1)
        return sel.contiguous()

    def init_server(self, ctx: Context, params: Params, seed: int) -> FomoServer:
        n = ctx.num_clients
        dev = next(iter(params.values())).device
        affinity = torch.zeros(n, n, dtype=torch.float64, device=dev)
        return FomoServer(T.clone(T.broadcast(params, n)), affinity, self.select(affinity, seed, 0).to(dev),
                          torch.zeros((), dtype=torch.long, device=dev), torch.tensor(int(seed), device=dev))

    def payload(self, server: FomoServer) -> FomoPayload:
        return FomoPayload(server.models, server.selected)

    def update_like(self, ctx: Context, payload: FomoPayload) -> FomoUpdate:
        return FomoUpdate(T.take(payload.models, 0), payload.selected[0],
                          torch.zeros(self.num_models, device=payload.selected.device))

    def aggregate(self, ctx: Context, server: FomoServer, updates: FomoUpdate, weights: Tensor,
                  clients: Tensor) -> FomoServer:
        ok = torch.nonzero(weights > 0).flatten()  # excluded (NaN / Inf) updates have weight 0: they change nothing
        if ok.numel() == 0:
            return server
        dev = server.affinity.device
        ids = clients.to(dev)[ok.to(dev)].to(torch.long)
        models = T.tmap(lambda t, u: t.index_copy(0, ids.to(t.device), u.index_select(0, ok.to(u.device)).to(t.dtype)),
                        server.models, updates.params)  # the table's rows of this round's clients: theta_i^t
        cols = updates.selected.to(dev).index_select(0, ok.to(dev)).to(torch.long)  # (K, M)
        w = updates.weights.to(dev).index_select(0, ok.to(dev)).to(torch.float64)  # (K, M)
        rows = ids.unsqueeze(1).expand_as(cols)
        affinity = server.affinity.index_put((rows.reshape(-1), cols.reshape(-1)), w.reshape(-1),
                                             accumulate=True)  # Section 3: P_{i,n} += w_n
        t = int(server.round) + 1
        selected = self.select(affinity, int(server.seed), t).to(server.selected.device)
        return FomoServer(models, affinity, selected, server.round + 1, server.seed)

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: FomoServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def held_out(self, batches: Batches) -> tuple[Tensor | list[Tensor], Batches]:
        """(each slot's validation flag, (S, B) or a list of the steps' (b_s,) for ragged batches; the batches with
        the validation examples masked out of every step): the held-out split of the module docstring."""
        assert batches.idx is not None, "FedFomo reads each example's index (Batches.idx) for its validation split"
        if isinstance(batches.mask, list):  # one client's ragged batches (the loop executor): host-side flags
            assert isinstance(batches.idx, list)
            val = [validation_examples(i, self.val_fraction) for i in batches.idx]
            masks = [m * (~v).to(m.dtype) for m, v in zip(batches.mask, val, strict=True)]
            # the steps left live: non-empty and within the straggler limit, as ``live_steps`` finds them in the
            # padded form (a step of validation examples only is skipped in both forms)
            nonempty = torch.tensor([bool(m.sum() > 0) for m in masks])
            budget = len(masks) if batches.limit is None else int(batches.limit)
            live = nonempty & (torch.cumsum(nonempty.to(torch.long), 0) <= budget)
            return val, batches._replace(mask=masks, all_live=tuple(bool(v) for v in live.tolist()))
        val_all = validation_examples(batches.idx, self.val_fraction)  # (S, B)
        return val_all, batches._replace(mask=batches.mask * (~val_all).to(batches.mask.dtype), all_live=None)

    def client_update(
        self, ctx: Context, payload: FomoPayload, state: ClientId, batches: Batches, lr: float
    ) -> tuple[FomoUpdate, ClientId, Tensor]:
        model = ctx.model
        prev = row(payload.models, state.id)  # theta_i^{t-1}: this client's row of the table
        sel = payload.selected.index_select(0, state.id.reshape(1).to(torch.long)).squeeze(0)  # (M,)
        cands = T.tmap(lambda t: t.index_select(0, sel), payload.models)  # the M downloaded models theta_n
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        val, train = self.held_out(batches)
        s0 = len(batches.x) // ctx.local_epochs
        v0 = torch.cat(val[:s0]) if isinstance(val, list) else val[:s0].reshape(-1)
        vmask = m0 * v0.to(m0.dtype)  # the validation examples of the round's first epoch (each once)
        # L_i on the local validation split: the client's previous model and the M candidates
        ref = model.masked_mean(model.nll(model.apply(prev, x0), y0), vmask)
        losses = masked_losses(model, cands, x0, y0, vmask)
        w = first_order_weights(ref, losses, distances(cands, prev))  # Section 3: clipped, normalized weights
        start = combine(prev, cands, w)  # theta_i^{t-1} + sum_n w_n (theta_n - theta_i^{t-1})
        new, loss = local_sgd(model.value_and_grad, start, train, lr, ctx.opt)  # local training, train split only
        return FomoUpdate(new, sel, w), state, loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: FomoPayload, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return row(payload.models, state.id)  # the client's latest model
        assert batches is not None
        # an unseen client: the first-order weights of all N models of the table around their mean, on its training
        # data (it trains nothing, so all of it serves as its validation split)
        model = ctx.model
        x, y, mask = first_epoch(batches, self.adapt_epochs)
        mean = T.tmap(lambda t: t.mean(0), payload.models)
        n = next(iter(payload.models.values())).shape[0]
        losses, dists = [], []
        for a in range(0, n, self.unseen_chunk):
            part = T.tmap(lambda t, a=a: t[a:a + self.unseen_chunk], payload.models)
            losses.append(masked_losses(model, part, x, y, mask))
            dists.append(distances(part, mean))
        ref = model.masked_mean(model.nll(model.apply(mean, x), y), mask)
        w = first_order_weights(ref, torch.cat(losses), torch.cat(dists))
        return combine(mean, payload.models, w)
