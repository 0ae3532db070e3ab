"""Floco: federated learning over connected modes.

Grinwald, Wiesner, Nakajima, "Federated Learning over Connected Modes", NeurIPS 2024 (OpenReview JL2eMCfDW8, arXiv
2403.03333).  Sources read: the paper's abstract and its public summaries (the stored copies of the text reached no
further), and the authors' Flower baseline (adap/flower ``baselines/floco``: ``strategy.py``, ``model.py``, its
README's hyper-parameters) for the formulas and numbers below; the paper's equation numbers could not be read, so
the steps are cited by their symbols.

The model's last layer (``Model.head``, an ``nn.Linear``) becomes a *solution simplex*: M endpoint weight matrices
W_1..W_M (the bias stays one), the layer at a point alpha of the standard simplex Delta^(M-1) being

    W(alpha) = sum_m alpha_m W_m.                                                               (the simplex layer)

The rest of the model, the bias and the endpoints are trained by every client and averaged by the server (FedAvg,
weighted by n_i).  Each local step draws its own alpha:

* before the projection round tau, uniformly on the whole simplex (alpha = e / sum(e), e_m ~ Exp(1));
* from round tau on, in the client's subregion: points of the simplex within L1 distance rho of its center c_i
  (how, below: ``subregion``).

Projection (round tau): every client's signature is the pseudo-gradient of the endpoints it sent in the round before
(the received minus the trained W_1..W_M, flattened); the server reduces the signatures to M dimensions by PCA
(kappa_i), projects them onto the scaled simplex {beta >= 0, sum beta = z} (Euclidean projection, Duchi et al. 2008)
and normalizes, c_i = beta_i / z, with z among 1000 values in [1e-4, 1] chosen to minimize the Riesz s-energy
(s = 2) of the centers, log(sum_{i<j} 1 / ||c_i - c_j||^2) - log(#pairs): the centers spread over the simplex while
similar clients stay together.  A client predicts at its center c_i (the simplex center 1/M before the projection,
and for clients without a center).  With M = 1 Floco is FedAvg (tested).

Defaults: M = 10 endpoints, rho = 0.3 (the authors' Dirichlet-split value; 0.1 for their fold split), the projection
at round ``tau`` (the authors': 250); ``tau = 0`` projects after half of ``run.rounds``.

Deviations and choices, each stated where it is implemented:
* the authors sample every client in the round before the projection to collect all signatures; the engine samples
  as configured, so the server keeps each client's latest signature (from the last round it trained in, a table of N
  rows until the projection) and projects the clients that have one; the others keep the simplex center;
* how the paper draws alpha within a subregion could not be read.  ``subregion = "simplex"`` (default) samples
  alpha = c_i + (rho / 2)(s - c_i), s uniform on the simplex: uniform on a copy of the simplex shrunk by rho / 2
  around c_i, so alpha stays in the simplex within L1 distance rho of c_i, but it is not uniform over all such points
  (those far from c_i in directions other than a vertex's are never drawn): its mean distance from c_i is about
  rho / 3 (0.105 for M = 10, rho = 0.3, c_i the simplex center).  ``"ball"`` is the authors' code, c_i + r u with
  r ~ U(0, rho) and u a random L1-unit direction (mean distance rho / 2), which may leave the simplex (its
  coordinates need not sum to 1).  A given rho therefore means a smaller region by default than in the authors'
  code; the tuned tables search rho over 0.03-2;
* the PCA's component signs are fixed so that each component's largest score is positive (scikit-learn's
  ``svd_flip`` convention differs in the reference);
* the step's alpha comes from a counter-based generator keyed by (run seed, round, client, step), so that a client's
  update is a pure function of its inputs (the authors' code draws from NumPy's global generator);
* endpoints start from Xavier-normal draws of a generator seeded by the run (as the authors' code), the bias from the
  model's own initialization;
* clients outside the federation (unseen) have no signature: they predict at the simplex center; Floco+ (Ditto-style
  personal models) is not included;
* the server keeps client signatures: robust aggregators and ``[privacy]`` are refused (``averages_updates``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from ..hostsync import to_device
from ..models.base import Model, ModelError
from ..optim import SGD, Batches, live_steps, masked_steps
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, Toy, nobody, row
from .fedproto import representation_dim

_MOD = 2**31


class FlocoServer(NamedTuple):
    """Server state (also the payload): the shared parameters (everything but the head's weight), the endpoints
    W_1..W_M (M, *weight), each client's latest signature (N, P) with whether it has one (N,), each client's
    subregion center (N, M), the aggregations done t (()) and the run's seed (())."""

    params: Params
    simplex: Tensor
    signatures: Tensor
    signed: Tensor
    centers: Tensor
    t: Tensor
    seed: Tensor


class FlocoUpdate(NamedTuple):
    """A client's update: its trained shared parameters and endpoints."""

    params: Params
    simplex: Tensor


def counter_uniforms(key: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Uniform [0, 1) draws of ``shape`` from a counter-based generator keyed by the int64 tensor ``key`` (values below
    2^31): each entry hashes (key, its flat index) with multiplicative mixing rounds modulo 2^31 (no int64 overflow).
    Pure and vmap-safe."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n, dtype=torch.int64, device=key.device)
    x = torch.remainder(key.to(torch.int64) * 40503 + idx * 2654435 + 12345, _MOD)
    for mul, add in ((1103515245, 12345), (22695477, 1), (1664525, 1013904223), (134775813, 1)):
        x = torch.remainder(x * mul + add, _MOD)
        x = torch.bitwise_xor(x, torch.div(x, 8192, rounding_mode="floor"))  # x ^ (x >> 13)
    return ((x.to(torch.float64) + 0.5) / _MOD).reshape(shape)


def simplex_uniform(u: Tensor) -> Tensor:
    """Uniform points of the simplex from uniforms u (..., M): e = -log u, normalized (Dirichlet(1))."""
    e = -torch.log(u)
    return e / e.sum(-1, keepdim=True)


def project_to_simplex(v: Tensor, z: float | Tensor = 1.0) -> Tensor:
    """Euclidean projection of the rows of v (K, M) onto {beta >= 0, sum beta = z} (Duchi et al., ICML 2008, Fig. 1)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    cssv = torch.cumsum(u, -1) - z
    ind = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype, device=v.device)
    cond = (u - cssv / ind) > 0
    rho = cond.to(torch.int64).sum(-1, keepdim=True).clamp_min(1)  # the number of positive entries
    theta = torch.gather(cssv, -1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0.0)


def riesz_log_energy(points: Tensor) -> Tensor:
    """log(sum_{i<j} 1 / ||p_i - p_j||^2) - log(#pairs), distances below 1e-4 raised to 1e-4 (the authors')."""
    k = points.shape[0]
    d = torch.cdist(points, points).clamp_min(1e-4)
    iu = torch.triu_indices(k, k, 1)
    mutual = d[iu[0], iu[1]]
    return torch.log((1.0 / mutual**2).sum()) - torch.log(torch.tensor(float(mutual.numel()), dtype=points.dtype))


def pca_scores(x: Tensor, m: int) -> Tensor:
    """The first m principal-component scores of the rows of x (K, P), each component's sign fixed so that its largest
    |score| is positive; zero columns where fewer than m components exist."""
    centered = x - x.mean(0, keepdim=True)
    u, s, _ = torch.linalg.svd(centered, full_matrices=False)
    scores = u * s
    r = min(m, scores.shape[1])
    scores = scores[:, :r]
    big = scores.gather(0, scores.abs().argmax(0, keepdim=True))
    scores = scores * torch.where(big < 0, -1.0, 1.0).to(scores.dtype)
    if r < m:
        scores = torch.cat([scores, torch.zeros(x.shape[0], m - r, dtype=x.dtype)], 1)
    return scores


def project_clients(signatures: Tensor, m: int, grid: int = 1000) -> Tensor:
    """Subregion centers (K, M) of K clients' signatures (K, P): PCA to M dimensions, projection onto the simplex of
    sum z, normalized, z in ``grid`` values of [1e-4, 1] minimizing the centers' Riesz s-energy (the first minimum).
    float64 on the CPU."""
    sig = signatures.detach().to(torch.float64).cpu()
    k = sig.shape[0]
    if k < 2:
        return torch.full((k, m), 1.0 / m, dtype=torch.float64)
    kappa = pca_scores(sig, m)
    best, best_e = None, float("inf")
    for z in torch.linspace(1e-4, 1.0, grid, dtype=torch.float64):
        beta = project_to_simplex(kappa, z)
        beta = beta / beta.sum(-1, keepdim=True)
        e = float(riesz_log_energy(beta))
        if e < best_e:  # finite and strictly lower: the first minimum
            best, best_e = beta, e
    return best if best is not None else torch.full((k, m), 1.0 / m, dtype=torch.float64)


def sgd_by_step(step_grad: Callable[[Params, int, Tensor], tuple[Params, Tensor]], params: Params, batches: Batches,
                lr: float | Tensor, opt: SGD) -> tuple[Params, Tensor]:
    """Local SGD (the run's momentum and weight decay, as ``torch.optim.SGD`` with dampening 0) over ``batches`` whose
    gradient at step s is ``step_grad(params, s, j)``, j (a (1,) long tensor) the index of the step among the live
    ones: for methods whose step draws its own randomness (Floco's alpha, FedGen's generated samples), keyed by j so
    that the loop and vmap executors (padding between epochs) draw alike.  Returns (params, mean loss over the live
    steps).  vmap-safe."""
    live = live_steps(batches).to(torch.long)
    nth = (torch.cumsum(live, 0) - 1).clamp_min(0)

    def step(carry: tuple[Params, Params], s: int) -> tuple[tuple[Params, Params], Tensor]:
        p, buf = carry
        g, value = step_grad(p, s, nth[s].reshape(1))
        new_p, new_buf = {}, {}
        for k, v in p.items():
            d = g[k] + opt.weight_decay * v if opt.weight_decay else g[k]
            if opt.momentum > 0:
                d = d + opt.momentum * buf[k]
                new_buf[k] = d
            new_p[k] = v - lr * d
        return (new_p, new_buf), value.detach()

    buf0 = {k: torch.zeros_like(v) for k, v in params.items()} if opt.momentum > 0 else {}
    (trained, _), mean_loss = masked_steps(batches, step, (params, buf0))
    return trained, mean_loss


@dataclass(frozen=True)
class Floco(Algorithm[FlocoServer, ClientId]):
    """Floco: the last layer a simplex of M endpoints trained at random points; after the projection round each
    client trains and predicts in its own subregion, placed by its gradient signature."""

    name: ClassVar[str] = "floco"
    toy: ClassVar[Toy] = Toy({"endpoints": 3, "tau": 4}, model="mlp")
    # the server keeps each client's signature and places its subregion: robust aggregators and [privacy] do not
    # apply (check_privacy refuses it)
    averages_updates: ClassVar[bool] = False
    #: M, the number of endpoints of the solution simplex (1: FedAvg)
    endpoints: Annotated[int, Range(1, 1000)] = 10
    #: rho, the L1 radius of each client's subregion around its center
    rho: Annotated[float, Range(0, 2)] = 0.3
    #: tau, the round (1-based, at least 2) from which clients train in their subregions (0: half of run.rounds)
    tau: Annotated[int, Range(0, 10**7)] = 0
    #: how alpha is drawn in a subregion: within the simplex (default) or the authors' L1-ball draw (may leave it)
    subregion: Literal["simplex", "ball"] = "simplex"

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)
        head = model.head_module()
        if not isinstance(head, nn.Linear):
            raise ModelError(f"floco makes the model's last layer a simplex of weight matrices: the head of model "
                             f"{model.name!r} must be an nn.Linear, got {type(head).__name__}")

    def weight_name(self, model: Model) -> str:
        return next(n for n in model.head_names(self.name) if n.endswith("weight"))

    def projection_round(self, ctx: Context) -> int:
        """tau (1-based, at least 2: the projection needs a round of signatures): ``tau``, or half of the run's
        rounds where it is 0."""
        return max(self.tau if self.tau > 0 else ctx.rounds // 2, 2)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> FlocoServer:
        wn = self.weight_name(ctx.model)
        w = params[wn]
        g = torch.Generator().manual_seed(int(seed) + 4242)
        std = (2.0 / (w.shape[0] + w.shape[1])) ** 0.5  # Xavier normal, as the authors' endpoints
        simplex = (torch.randn(self.endpoints, *w.shape, generator=g) * std).to(w.device, w.dtype)
        n = ctx.num_clients
        return FlocoServer({k: v.clone() for k, v in params.items() if k != wn}, simplex,
                           torch.zeros(n, simplex.numel(), dtype=w.dtype, device=w.device),
                           torch.zeros(n, dtype=w.dtype, device=w.device),
                           torch.full((n, self.endpoints), 1.0 / self.endpoints, dtype=w.dtype, device=w.device),
                           torch.zeros((), dtype=torch.long, device=w.device),
                           torch.tensor(int(seed) % _MOD, dtype=torch.long, device=w.device))

    def payload(self, server: FlocoServer) -> FlocoServer:
        return server

    def update_like(self, ctx: Context, payload: FlocoServer) -> FlocoUpdate:
        return FlocoUpdate(payload.params, payload.simplex)

    def aggregate(self, ctx: Context, server: FlocoServer, updates: FlocoUpdate, weights: Tensor,
                  clients: Tensor) -> FlocoServer:
        if nobody(ctx, weights):
            return server
        new = ctx.combine(updates, weights)  # the shared parameters and the endpoints: FedAvg
        t = int(server.t) + 1  # this round, 1-based
        tau = self.projection_round(ctx)
        signatures, signed, centers = server.signatures, server.signed, server.centers
        if t < tau:
            # every valid client's signature: the pseudo-gradient of the endpoints (received minus trained)
            ok = torch.nonzero(weights > 0).flatten().to(clients.device)
            ids = clients[ok].to(torch.long).to(signatures.device)
            rows = (server.simplex.unsqueeze(0) - updates.simplex.index_select(0, ok.to(updates.simplex.device)))
            signatures = signatures.index_copy(0, ids, rows.reshape(len(ids), -1).to(signatures.dtype))
            signed = signed.index_fill(0, ids, 1.0)
        if t == tau - 1:
            # the projection, before round tau: the clients with a signature get their centers
            have = torch.nonzero(signed > 0).flatten()
            if have.numel() >= 2:
                c = project_clients(signatures.index_select(0, have), self.endpoints)
                centers = centers.index_copy(0, have, c.to(centers.dtype).to(centers.device))
        return FlocoServer(new.params, new.simplex, signatures, signed, centers, server.t + 1, server.seed)

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: FlocoServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def init_client(self, ctx: Context, server: FlocoServer) -> ClientId:
        return ClientId(torch.zeros((), dtype=torch.long))

    def alphas(self, ctx: Context, payload: FlocoServer, client: Tensor, steps: int) -> Tensor:
        """The alpha (steps, M) of each local step: uniform on the simplex before round tau, then drawn in the client's
        subregion (``subregion``: the simplex shrunk by rho / 2 around the center, or the authors' L1-ball draw)."""
        m = self.endpoints
        t1 = payload.t + 1  # this round, 1-based
        key = torch.remainder(payload.seed * 7919 + t1 * 104729 + client.to(torch.long) * 15485863, _MOD)
        u = counter_uniforms(key, (steps, 2 * m + 1))
        free = simplex_uniform(u[:, :m])
        center = row(payload.centers, client).to(torch.float64)
        if self.subregion == "simplex":
            local = center + (self.rho / 2) * (free - center)  # within the simplex, ||alpha - c||_1 <= rho
        else:  # the authors' draw: c + r u, r ~ U(0, rho), u a random L1-unit direction
            direction = u[:, m:2 * m] * 2 - 1
            direction = direction / direction.abs().sum(-1, keepdim=True)
            local = center + self.rho * u[:, 2 * m:] * direction
        projected = (t1 >= self.projection_round(ctx)).to(local.device)
        return torch.where(projected, local, free).to(payload.simplex.dtype)

    def client_update(
        self, ctx: Context, payload: FlocoServer, state: ClientId, batches: Batches, lr: float
    ) -> tuple[FlocoUpdate, ClientId, Tensor]:
        model = ctx.model
        wn = self.weight_name(model)
        alphas = self.alphas(ctx, payload, state.id, len(batches.x))

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor, alpha: Tensor) -> Tensor:
            w = torch.tensordot(alpha, p["__simplex__"], dims=1)  # W(alpha) = sum_m alpha_m W_m
            full = {k: v for k, v in p.items() if k != "__simplex__"}
            return model.loss({**full, wn: w}, x, y, mask)

        grad = torch.func.grad_and_value(loss)

        def step_grad(p: Params, s: int, nth: Tensor) -> tuple[Params, Tensor]:
            # the j-th live step draws the j-th alpha, wherever padding puts it (loop and vmap agree)
            # (the loop executor's step flags, and so nth, are on the host; the alphas on the model's device)
            return grad(p, batches.x[s], batches.y[s], batches.mask[s],
                        alphas.index_select(0, to_device(nth, alphas.device)).squeeze(0))

        trained, mean_loss = sgd_by_step(step_grad, {**payload.params, "__simplex__": payload.simplex}, batches, lr,
                                         ctx.opt)
        simplex = trained.pop("__simplex__")
        return FlocoUpdate(trained, simplex), state, mean_loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: FlocoServer, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        m = self.endpoints
        wn = self.weight_name(ctx.model)
        uniform = torch.full((m,), 1.0 / m, dtype=payload.simplex.dtype, device=payload.simplex.device)
        center = row(payload.centers, state.id) if seen else uniform  # unseen clients: the simplex center
        return {**payload.params, wn: torch.tensordot(center, payload.simplex, dims=1)}

