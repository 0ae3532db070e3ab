"""FedPAC: personalized federated learning with feature alignment and classifier collaboration.

Xu, Tong, Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration", ICLR 2023
(arXiv 2306.11867, OpenReview SXZr8aDKia): its method (feature alignment by global feature centroids; classifier
collaboration by estimated combination weights) and its algorithm.  Sources read: the paper's abstract and
introduction (the stored copies of the arXiv and ICLR texts reached no further), its experimental settings as
restated by two public re-implementations' READMEs, and the authors' code (JianXu95/FedPAC: ``methods/fedpac.py``,
``tools.py``, ``running.py``, ``options.py``) for the formulas and numbers below.  The paper's section and equation
numbers could not be read, so the equations are cited by their symbols.

The model is split into a body theta (the feature extractor f_theta = ``Model.features``, shared and averaged) and a
head phi_i (``Model.apply_head`` on the model's own split; a model without one is refused), one per client.  A round
(the paper's algorithm, as the authors' ``train_round_fedpac`` runs it), for a sampled client i that receives the
global body theta and the global centroids c:

1. feature statistics under the received body (the same body for every client of the round), over its training
   examples (n_i of them, n_i,k of class k, p_i(k) = n_i,k / n_i, z = f_theta(x)):

       h_i = [p_i(k) mu_i,k]_k = (1/n_i) sum_l e_{y_l} z_l^T            (C x d; mu_i,k the class-k mean of z)
       V_i = (1/n_i) [ sum_k p_i(k) E_k ||z||^2 - sum_k p_i(k)^2 ||mu_i,k||^2 ]
           = (1/n_i) [ (1/n_i) sum_l ||z_l||^2 - ||h_i||_F^2 ]           (the variance of the estimate of h_i);

2. its head phi_i (its combined head of the last round) trains ``head_epochs`` epochs on the cross-entropy, the body
   fixed, at rate ``head_lr``;
3. the body trains ``run.local_epochs`` epochs, its head fixed, on the feature-aligned local objective

       L_i(theta) = (1/n_i) sum_l CE(phi_i(f_theta(x_l)), y_l) + lambda (1/n_i) sum_l ||f_theta(x_l) - c_{y_l}||^2;

4. it computes its local centroids with the trained body, c^_i,k = (1/n_i,k) sum_{y_l = k} f_theta_i(x_l), and sends
   theta_i, phi_i, (c^_i, n_i,k) and (h_i, V_i).

The server averages the bodies weighted by sample counts, forms each class's global centroid as the counts-weighted
mean c_k = sum_i n_i,k c^_i,k / sum_i n_i,k, and for each client i of the round solves the quadratic program over
the probability simplex that estimates its combination weights (the paper's bias-variance trade-off of the combined
classifier's test loss)

       alpha_i = argmin_{alpha >= 0, sum_j alpha_j = 1}  sum_j alpha_j^2 V_j + || h_i - sum_j alpha_j h_j ||_F^2
               = argmin alpha^T (diag(V) + G_i) alpha,   (G_i)_jl = <h_i - h_j, h_i - h_l>_F,

over the clients j of the round, and gives client i the combined head phi^_i = sum_j alpha_ij phi_j, where it starts
its next round.  ``simplex_qp`` solves it exactly (a primal active-set method, no iteration count to tune).

Engine form: the server state holds the body, the table of the clients' combined heads (N rows, as FedAMP's table
of models), the global centroids with their counts and the initial head; the payload is that state and a client
reads its row by its ``ClientId``.  A client predicts with the global body and its row of the table.  Binary models
(one logit) are supported: classes 0 and 1 each get a centroid and a block of h_i, and the heads combine as any
parameters.

Defaults: lambda = 1 (the authors' ``--lam`` default, "1.0 for mse_loss"), one head epoch at rate 0.1 before the
body's epochs at the run's rate (the authors' code; the paper's implementation details as the re-implementations
restate them: the classifier one epoch at eta_g = 0.1, the feature extractor several epochs at eta_f = eta); the
distance averaged over the d coordinates, as the authors' code computes it (a mean-squared error), the scale in which
lambda = 1 was chosen.

Choices and deviations, each stated where it is implemented:
* ``distance``: "mean" (default) is the authors' mean-squared error, ||z - c_y||^2 / d; "sum" is the plain squared
  Euclidean distance ||z - c_y||^2, d times as strong (as in ``fedproto``);
* the alignment term is left out for the examples of a class without a global centroid (every example in the first
  round); the authors' code uses the client's own pre-training centroid there (a class no client of earlier rounds
  had);
* the head's rate follows the run's schedule: ``head_lr`` x (the round's rate / ``optim.lr``); head and body steps
  both use the run's momentum and weight decay (the authors': momentum 0.5, weight decay 5e-4 for both);
* the QP is solved exactly; the authors' code solves it with CVXPY after dropping the eigenvalues of the matrix below
  0.01 and zeroes weights below 1e-3 afterwards (numerical safeguards, left out: the active set gives exact zeros);
* a client that did not train in a round keeps its row; clients that never trained start from the initial head;
  clients outside the federation (unseen) train the initial head on the global body for ``head_epochs`` epochs of
  their training data (FedPAC's own head phase; the authors' runs have no clients outside the federation);
* the logged training loss is the cross-entropy averaged over the live steps of both phases (a straggler may stop
  within the head phase);
* the server refuses ``[privacy]`` and robust aggregators: it combines each client's own head, centroids and
  statistics, not only a mean of model updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.base import Model
from ..optim import Batches, GradFn, first_epoch, live_steps, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, Toy, row
from .bodyhead import train_part
from .fedproto import aggregate_prototypes, grad_with_aux, local_prototypes, one_hot, representation_dim


class PACServer(NamedTuple):
    """Server state (also the payload): the global body theta, every client's combined head phi^_i stacked (N, ...),
    the global centroids c (C, d) with the number of examples each was formed from (C,; 0: none yet), and the
    initial head."""

    body: Params
    heads: Params
    protos: Tensor
    counts: Tensor
    init_head: Params


class PACUpdate(NamedTuple):
    """A client's update: its trained body and head, its local centroids c^_i (C, d) with class counts n_i,k (C,), and
    the feature statistics h_i (C, d) and V_i (()) under the received body."""

    body: Params
    head: Params
    protos: Tensor
    counts: Tensor
    h: Tensor
    v: Tensor


def feature_statistics(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(h_i, V_i) of the real examples (``mask`` = 1) under ``params``' body: h_i = (1/n) sum_l e_{y_l} z_l^T (C, d),
    i.e. p(k) mu_k per class, and V_i = ((1/n) sum_l ||z_l||^2 - ||h_i||_F^2) / n, the variance of h_i's estimate
    (the authors' ``statistics_extraction``: sum_k p(k) tr E_k[z z^T] - sum_k p(k)^2 ||mu_k||^2, over n).  vmap-safe."""
    z = model.features(params, x)  # (n, d)
    m = mask.to(z.dtype)
    n = m.sum().clamp_min(1.0)
    onehot = one_hot(model, y, z.dtype) * m.unsqueeze(-1)  # (n, C)
    h = onehot.T @ z / n
    second = ((z * z).sum(-1) * m).sum() / n  # (1/n) sum_l ||z_l||^2 = sum_k p(k) E_k ||z||^2
    v = (second - (h * h).sum()).clamp_min(0.0) / n
    return h, v


def simplex_qp(q: Tensor, start: int = 0, max_iter: int | None = None) -> Tensor:
    """argmin_{alpha >= 0, sum alpha = 1} alpha^T q alpha for a symmetric positive semi-definite q (K, K), exactly: a
    primal active-set method (Nocedal & Wright, Algorithm 16.3) from the vertex e_start, each step solving the
    equality-constrained problem on the free coordinates (its KKT system) and adding the blocking bound or freeing the
    bound of most negative multiplier.  A ridge of 1e-12 x the mean diagonal makes q definite (a singular q's optimum
    set is then resolved to its least-norm point up to that ridge).  float64 on the CPU; returns (K,) float64."""
    q = q.detach().to(torch.float64).cpu()
    k = q.shape[0]
    q = 0.5 * (q + q.T)
    scale = float(q.diagonal().abs().mean()) if k else 0.0
    scale = scale if scale > 0 else 1.0
    q = q + 1e-12 * scale * torch.eye(k, dtype=torch.float64)
    x = torch.zeros(k, dtype=torch.float64)
    x[start] = 1.0
    free = [start]
    tol = 1e-10 * scale
    for _ in range(max_iter if max_iter is not None else 20 * k + 50):
        f = torch.tensor(sorted(free))
        g = q @ x
        nf = len(f)
        kkt = torch.zeros(nf + 1, nf + 1, dtype=torch.float64)
        kkt[:nf, :nf] = q[f][:, f]
        kkt[:nf, nf] = 1.0
        kkt[nf, :nf] = 1.0
        rhs = torch.cat([-g[f], torch.zeros(1, dtype=torch.float64)])
        p = torch.linalg.solve(kkt, rhs)[:nf]
        if float(p.abs().max()) <= 1e-11:
            # stationary on the free set: g_F = nu there; the bounds' multipliers are mu_j = g_j - nu
            nu = float(g[f].mean())
            bound = [j for j in range(k) if j not in free]
            if not bound:
                break
            mu = g[bound] - nu
            j = int(torch.argmin(mu))
            if float(mu[j]) >= -tol:
                break
            free.append(bound[j])
            continue
        step, block = 1.0, -1
        for idx, j in enumerate(f.tolist()):
            if float(p[idx]) < 0:
                r = float(-x[j] / p[idx])
                if r < step:
                    step, block = r, j
        x[f] = x[f] + step * p
        if block >= 0:
            x[block] = 0.0
            free.remove(block)
    x = x.clamp_min(0.0)
    return x / x.sum()


def combination_matrix(h: Tensor, v: Tensor) -> list[Tensor]:
    """The QP matrices diag(V) + G_i of the K clients (h (K, C, d), v (K,)): (G_i)_jl = <h_i - h_j, h_i - h_l>_F."""
    flat = h.reshape(h.shape[0], -1).to(torch.float64)
    diag = torch.diag(v.to(torch.float64).clamp_min(0.0))
    out = []
    for i in range(flat.shape[0]):
        diff = flat[i] - flat  # (K, C d): h_i - h_j
        out.append(diag + diff @ diff.T)
    return out


@dataclass(frozen=True)
class FedPAC(Algorithm[PACServer, ClientId]):
    """FedPAC: a shared body trained with its features pulled to global class centroids, and per-client heads
    combined by weights that solve a bias-variance quadratic program over the clients' feature statistics."""

    name: ClassVar[str] = "fedpac"
    toy: ClassVar[Toy] = Toy(model="mlp")
    needs_adaptation: ClassVar[bool] = True  # unseen clients train a head on the global body
    # the server combines each client's own head, centroids and statistics: robust aggregators and [privacy] do not
    # apply (check_privacy refuses it)
    averages_updates: ClassVar[bool] = False
    #: lambda, the weight of the feature-alignment term (the authors' default, for the mean-squared distance)
    lam: Annotated[float, Range(0, 1e4)] = 1.0
    #: epochs of head training (body fixed) before the body epochs, each round; also for unseen clients
    head_epochs: Annotated[int, Range(0, 1000)] = 1
    #: the head's learning rate eta_g (follows the run's schedule: x the round's rate / optim.lr)
    head_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.1
    #: the alignment distance: averaged over the d coordinates (the authors' code) or summed (||.||^2, d times as
    #: strong)
    distance: Literal["mean", "sum"] = "mean"

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return max(self.head_epochs, 1)

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)

    def train_epochs(self, local_epochs: int) -> int:
        return self.head_epochs + local_epochs

    def head_rate(self, ctx: Context, lr: float | Tensor) -> float | Tensor:
        """eta_g at this round: ``head_lr`` x (the round's rate / ``optim.lr``) (exactly ``lr`` when head_lr equals
        optim.lr)."""
        return lr * (self.head_lr / ctx.opt.lr)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> PACServer:
        body, head = ctx.model.split(params, self.name)
        ref = next(iter(params.values()))
        c, d = ctx.model.num_classes, representation_dim(ctx.model, self.name)
        return PACServer(T.clone(body), T.clone(T.broadcast(head, ctx.num_clients)),
                         torch.zeros(c, d, dtype=ref.dtype, device=ref.device),
                         torch.zeros(c, dtype=ref.dtype, device=ref.device), T.clone(head))

    def payload(self, server: PACServer) -> PACServer:
        return server

    def update_like(self, ctx: Context, payload: PACServer) -> PACUpdate:
        return PACUpdate(payload.body, payload.init_head, payload.protos, payload.counts,
                         torch.zeros_like(payload.protos), torch.zeros((), dtype=payload.protos.dtype))

    def combination_weights(self, h: Tensor, v: Tensor) -> Tensor:
        """(K, K) alpha: row i the combination weights of client i over the K clients whose statistics are h (K, C, d)
        and v (K,), each the solution of its simplex QP (started at its own vertex)."""
        mats = combination_matrix(h, v)
        return torch.stack([simplex_qp(m, start=i) for i, m in enumerate(mats)])

    def aggregate(self, ctx: Context, server: PACServer, updates: PACUpdate, weights: Tensor,
                  clients: Tensor) -> PACServer:
        ok = torch.nonzero(weights > 0).flatten()
        if ok.numel() == 0:
            return server
        body = ctx.combine(updates.body, weights)  # the bodies' counts-weighted mean (excluded rows skipped)
        protos, counts = aggregate_prototypes(server.protos, server.counts, updates.protos, updates.counts, weights)
        # the QPs of the round's valid clients only: excluded rows are never read
        h = updates.h.index_select(0, ok.to(updates.h.device))
        v = updates.v.index_select(0, ok.to(updates.v.device))
        alpha = self.combination_weights(h, v)  # (K', K') float64 on the CPU
        ids = clients.to(ok.device)[ok].to(torch.long)

        def combine_heads(table: Tensor, new: Tensor) -> Tensor:
            rows = new.index_select(0, ok.to(new.device))
            mixed = torch.tensordot(alpha.to(rows.device), rows.to(torch.float64), dims=1)  # phi^_i = sum_j a_ij phi_j
            return table.index_copy(0, ids.to(table.device), mixed.to(table.dtype).to(table.device))

        heads = T.tmap(combine_heads, server.heads, updates.head)
        return PACServer(body, heads, protos, counts, server.init_head)

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: PACServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def init_client(self, ctx: Context, server: PACServer) -> ClientId:
        return ClientId(torch.zeros((), dtype=torch.long))

    def body_step(self, ctx: Context, head: Params, protos: Tensor, counts: Tensor) -> GradFn:
        """The body's local step ``(body, x, y, mask, weight) -> (grads, CE loss)`` on L_i(theta) (step 3), the head
        fixed."""
        model, lam = ctx.model, self.lam

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)
            onehot = one_hot(model, y, protos.dtype)  # (B, C)
            target = onehot @ protos  # c_{y_l}
            on = onehot @ (counts > 0).to(onehot.dtype)  # the class has a global centroid (none in the first round)

            def loss(q: Params) -> tuple[Tensor, Tensor]:
                z = model.features({**q, **head}, x)
                ce = model.nll(model.apply_head(head, z), y)
                reg = ((z - target) ** 2).sum(-1) * on  # ||f_theta(x_l) - c_{y_l}||^2
                if self.distance == "mean":
                    reg = reg / z.shape[-1]  # the authors' mean-squared error (deviation: stated in the docstring)
                n = m.sum().clamp_min(1.0)
                return ((ce + lam * reg) * m).sum() / n, (ce.detach() * m).sum() / n

            return grad_with_aux(loss, p)

        return grad_fn

    def client_update(
        self, ctx: Context, payload: PACServer, state: ClientId, batches: Batches, lr: float
    ) -> tuple[PACUpdate, ClientId, Tensor]:
        model = ctx.model
        epochs = self.train_epochs(ctx.local_epochs)
        body, head = payload.body, row(payload.heads, state.id)  # theta, and phi^_i where the client starts
        x0, y0, m0 = first_epoch(batches, epochs)
        h, v = feature_statistics(model, {**body, **head}, x0, y0, m0)  # step 1, under the received body
        cut = self.head_epochs * (len(batches.x) // epochs)
        live = live_steps(batches).to(torch.float32)
        n_head, n_body = live[:cut].sum(), live[cut:].sum()
        head_loss = torch.zeros(())
        if cut:  # step 2: the head, the body fixed
            head, head_loss = train_part(ctx, head, body, batches, self.head_rate(ctx, lr), steps=slice(0, cut))
        if self.lam == 0:  # step 3 without the alignment term: the plain body step, bit for bit
            body, body_loss = train_part(ctx, body, head, batches, lr, steps=slice(cut, None))
        else:  # step 3: the body on L_i(theta), the head fixed
            body, body_loss = local_sgd(self.body_step(ctx, head, payload.protos, payload.counts), body, batches, lr,
                                        ctx.opt, steps=slice(cut, None))
        # the logged loss: the cross-entropy averaged over every live step of both phases (a straggler may stop
        # within the head phase)
        loss = (head_loss * n_head.to(head_loss.device) + body_loss * n_body.to(body_loss.device)) / (
            (n_head + n_body).clamp_min(1.0).to(body_loss.device))
        local = local_prototypes(model, {**body, **head}, x0, y0, m0)  # step 4: c^_i,k with the trained body
        update = PACUpdate(body, head, local.protos.detach(), local.counts.detach(), h.detach(), v.detach())
        return update, state, loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: PACServer, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        if seen:
            return {**payload.body, **row(payload.heads, state.id)}
        # a client outside the federation: the initial head trained on the global body (FedPAC's head phase)
        assert batches is not None
        head, _ = train_part(ctx, payload.init_head, payload.body, batches, self.head_rate(ctx, lr))
        return {**payload.body, **head}
