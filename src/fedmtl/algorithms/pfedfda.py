"""pFedFDA: personalized federated learning via feature distribution adaptation.

Mclaughlin, Su, "Personalized Federated Learning via Feature Distribution Adaptation", NeurIPS 2024 (arXiv
2411.00329).  Sources read: the paper's abstract and introduction (the stored copies reached no further) and the
authors' code (cj-mclaughlin/pFedFDA: ``clients/client_fedfda.py``, ``servers/server_fedfda.py``) for the formulas
and numbers below; the paper's equation numbers could not be read, so the steps are cited by their symbols.

The model is a shared body (the feature extractor, ``Model.features``: z = f_phi(x) in R^d) under a *generative*
classifier: each class's features are Gaussian with mean mu_c and one covariance Sigma shared by the classes, so the
Bayes classifier is linear (linear discriminant analysis).  With the shrunk covariance

    Sigma' = (1 - eps) Sigma + eps (tr(Sigma) / d) I                                          (covariance shrinkage)

and priors pi_c, the head (``Model.head``: an ``nn.Linear`` with bias) is

    w_c = Sigma'^{-1} mu_c,   b_c = -(1/2) mu_c^T Sigma'^{-1} mu_c + log pi_c,                (the generative head)

whose softmax is the posterior p(c | z) of the Gaussians N(mu_c, Sigma') (tested against the densities).

A round, for a sampled client i receiving phi, the global means mu_g (C x d) and covariance Sigma_g:

1. the head is the generative head of (mu_g, Sigma_g) with the client's label priors pi_i (n_i,c / n_i + eps,
   renormalized), frozen; the body trains ``run.local_epochs`` epochs on the cross-entropy under it;
2. with the trained body the client estimates its local Gaussian: class means mu_i,c (a class with ``min_samples``
   examples or fewer takes the global mean) and the pooled covariance Sigma_i = S_i / (n_i - 1) + ``cov_ridge`` I
   (S_i the within-class scatter around those means);
3. it interpolates local and global estimates, mu^_i = beta mu_i + (1 - beta) mu_g, Sigma^_i = beta Sigma_i +
   (1 - beta) Sigma_g, with beta chosen by 2-fold stratified cross-validation of the generative head's
   cross-entropy on its own features (``interpolation = "cv"``) or fixed (``"fixed"``, ``beta``);
4. it sends phi_i, mu^_i and Sigma^_i.

The server averages the bodies, the means and the covariances, each weighted by n_i over the round's clients
(mu_g, Sigma_g replaced, not accumulated).  It starts from mu_g ~ U[0, 1)^(C x d) (seeded) and Sigma_g = I.  A
client (seen or unseen) predicts with the global body under its personal generative head: steps 2 and 3 on the
global body's features of its training data, with its priors.  Clients keep no state.

Deviations and choices, each stated where it is implemented:
* beta is the best of ``beta_grid`` evenly spaced values in [0, 1] on the cross-validation loss (a fixed amount
  of work, vmap-safe); the authors' code runs 10 L-BFGS iterations from 0.5, clipped to [0, 1].  One beta for means
  and covariance (the authors' ``--single_beta`` option).  Their default, a beta for the means and another for the
  covariance, is not offered: a grid over both would cost the square of one grid's solves;
* the folds are stratified by alternation (the k-th example of a class, in the round's shuffled order, goes to fold
  k mod 2), classes with fewer than 2 examples left out of the cross-validation (the authors drop them too), a
  random stratified split in their code;
* step 2 reads the trained body's features of every example once; the authors' code collects the features of the
  training steps (the body changing between batches, each example once per epoch);
* the local covariance adds ``cov_ridge`` x I (default 1, the identity the authors' code adds); their code also adds
  1e-4 to every entry and projects onto the PSD cone (a no-op for this estimate, PSD by construction): not done;
* the linear systems are solved exactly (``torch.linalg.solve``), the authors' use least squares;
* a model whose head is one logit (binary) gets the logit difference of the two classes' discriminants;
* the server's means and covariances are client statistics, not model updates: robust aggregators and
  ``[privacy]`` are refused (``averages_updates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from ..models.base import Model, ModelError
from ..optim import Batches, first_epoch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, nobody
from .bodyhead import train_part
from .fedproto import one_hot, representation_dim

#: eps of the priors and of the covariance shrinkage (the authors' code)
EPS = 1e-4


class FDAServer(NamedTuple):
    """Server state (also the payload): the global body phi, the global class means mu_g (C, d) and the shared
    covariance Sigma_g (d, d)."""

    body: Params
    means: Tensor
    cov: Tensor


class FDAUpdate(NamedTuple):
    """A client's update: its trained body and its interpolated Gaussian estimate (mu^_i, Sigma^_i)."""

    body: Params
    means: Tensor
    cov: Tensor


def shrink(cov: Tensor, eps: float = EPS) -> Tensor:
    """Sigma' = (1 - eps) Sigma + eps (tr(Sigma) / d) I: the covariance shrinkage of the generative head."""
    d = cov.shape[-1]
    eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
    return (1 - eps) * cov + eps * (torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1) / d)[..., None, None] * eye


def discriminants(means: Tensor, cov: Tensor, priors: Tensor) -> tuple[Tensor, Tensor]:
    """(W (C, d), b (C,)) of the generative head: w_c = Sigma'^{-1} mu_c, b_c = -mu_c^T Sigma'^{-1} mu_c / 2 +
    log pi_c, Sigma' the shrunk covariance."""
    s = shrink(cov)
    # + 1e-10 I: below float rounding for any covariance of scale 1e-3 or more; keeps an all-zero one (dead features,
    # cov_ridge = 0) solvable
    s = s + 1e-10 * torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    coefs = torch.linalg.solve(s, means.T).T  # (C, d): Sigma'^{-1} mu_c
    return coefs, -0.5 * (means * coefs).sum(-1) + torch.log(priors)


def client_priors(counts: Tensor) -> Tensor:
    """pi_i: the label frequencies plus eps, renormalized (the authors' code)."""
    p = counts / counts.sum().clamp_min(1.0) + EPS
    return p / p.sum()


def gaussian_estimate(z: Tensor, onehot: Tensor, global_means: Tensor, min_samples: int,
                      ridge: float) -> tuple[Tensor, Tensor]:
    """(mu_i (C, d), Sigma_i (d, d)) of features z (n, d) with one-hot labels ``onehot`` (n, C; all-zero rows are
    left out): class means where a class has more than ``min_samples`` examples (else the global mean), and the pooled
    within-class covariance S / (n - 1) + ridge I around those means.  vmap-safe."""
    counts = onehot.sum(0)  # (C,)
    local = (onehot.T @ z) / counts.clamp_min(1.0).unsqueeze(-1)
    means = torch.where((counts > min_samples).unsqueeze(-1), local, global_means.to(z.dtype))
    centered = (z - onehot @ means) * onehot.sum(-1, keepdim=True)  # rows outside the set: zero
    n = counts.sum()
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    return means, centered.T @ centered / (n - 1).clamp_min(1.0) + ridge * eye


def lda_log_likelihood(z: Tensor, onehot: Tensor, means: Tensor, cov: Tensor, priors: Tensor) -> Tensor:
    """The summed cross-entropy of the generative head on the rows of z that ``onehot`` marks."""
    w, b = discriminants(means, cov, priors)
    logp = torch.log_softmax(z @ w.T + b, -1)
    return -(onehot * logp).sum()


@dataclass(frozen=True)
class PFedFDA(Algorithm[FDAServer, tuple[()]]):
    """pFedFDA: a shared body trained under the generative (Gaussian, shared-covariance) classifier of the global
    feature distribution; each client adapts it to its own features by a cross-validated local-global interpolation."""

    name: ClassVar[str] = "pfedfda"
    toy: ClassVar[Toy] = Toy(model="mlp")
    needs_adaptation: ClassVar[bool] = True  # every client fits its generative head to its training features
    # the server averages client statistics (means, covariances) besides the bodies: robust aggregators and [privacy]
    # do not apply (check_privacy refuses it)
    averages_updates: ClassVar[bool] = False
    #: how beta (local weight of the interpolated Gaussian estimate) is chosen: 2-fold cross-validation or fixed
    interpolation: Literal["cv", "fixed"] = "cv"
    #: beta under interpolation = "fixed" (1: local estimate only, 0: global only)
    beta: Annotated[float, Range(0, 1)] = 0.5
    #: the values of beta tried under interpolation = "cv" (evenly spaced in [0, 1])
    beta_grid: Annotated[int, Range(2, 1001)] = 21
    #: added to the diagonal of the local covariance estimate (the authors' code adds the identity)
    cov_ridge: Annotated[float, Range(0, 1e6)] = 1.0
    #: a class with this many examples or fewer takes the global mean (the authors': the number of folds)
    min_samples: Annotated[int, Range(0, 10**6)] = 2

    def check_model(self, model: Model) -> None:
        names = model.head_names(self.name)
        representation_dim(model, self.name)
        head = model.head_module()
        if not isinstance(head, nn.Linear) or head.bias is None or len(names) != 2:
            raise ModelError(f"pfedfda sets the model's head to a generative (LDA) classifier: the head of model "
                             f"{model.name!r} must be one nn.Linear with bias, got {type(head).__name__}")

    def head_names(self, model: Model) -> tuple[str, str]:
        """(weight, bias) names of the model's head."""
        names = model.head_names(self.name)
        weight = next(n for n in names if n.endswith("weight"))
        bias = next(n for n in names if n.endswith("bias"))
        return weight, bias

    def generative_head(self, model: Model, means: Tensor, cov: Tensor, priors: Tensor) -> Params:
        """The head entries (the model's nn.Linear weight and bias) of the generative classifier of (means, cov,
        priors)."""
        w, b = discriminants(means, cov, priors)
        if model.output == "binary":  # one logit: the difference of the two classes' discriminants
            w, b = w[1:] - w[:1], b[1:] - b[:1]
        wn, bn = self.head_names(model)
        return {wn: w, bn: b}

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> FDAServer:
        body, head = ctx.model.split(params, self.name)
        ref = next(iter(params.values()))
        c, d = ctx.model.num_classes, representation_dim(ctx.model, self.name)
        g = torch.Generator().manual_seed(int(seed))
        means = torch.rand(c, d, generator=g).to(ref.device, ref.dtype)  # mu_g ~ U[0, 1), the authors' start
        return FDAServer(dict(body), means, torch.eye(d, dtype=ref.dtype, device=ref.device))

    def payload(self, server: FDAServer) -> FDAServer:
        return server

    def update_like(self, ctx: Context, payload: FDAServer) -> FDAUpdate:
        return FDAUpdate(payload.body, payload.means, payload.cov)

    def aggregate(self, ctx: Context, server: FDAServer, updates: FDAUpdate, weights: Tensor,
                  clients: Tensor) -> FDAServer:
        if nobody(ctx, weights):
            return server
        # phi, mu_g, Sigma_g: the n_i-weighted means over the round's valid clients
        new = ctx.combine(updates, weights)
        return FDAServer(new.body, new.means, new.cov)

    # -- client ---------------------------------------------------------------------------------
    def adapt(self, model: Model, z: Tensor, y: Tensor, mask: Tensor, means_g: Tensor,
              cov_g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Steps 2-3 on features z (n, d) of labels y with ``mask``: (mu^_i, Sigma^_i, beta)."""
        onehot = one_hot(model, y, z.dtype) * mask.to(z.dtype).unsqueeze(-1)
        means_l, cov_l = gaussian_estimate(z, onehot, means_g, self.min_samples, self.cov_ridge)
        if self.interpolation == "fixed":
            beta = torch.full((), self.beta, dtype=z.dtype, device=z.device)
        else:
            beta = self.cross_validated_beta(z, onehot, means_g, cov_g)
        return beta * means_l + (1 - beta) * means_g, beta * cov_l + (1 - beta) * cov_g, beta

    def cross_validated_beta(self, z: Tensor, onehot: Tensor, means_g: Tensor, cov_g: Tensor) -> Tensor:
        """beta in ``beta_grid`` values of [0, 1] minimizing the 2-fold cross-validated cross-entropy of the generative
        head (the client's priors), the folds stratified by alternation within each class; classes with fewer than 2
        examples left out.  0 where no class has 2 (nothing to validate on)."""
        priors = client_priors(onehot.sum(0))
        rank = torch.cumsum(onehot, 0) * onehot  # 1, 2, ... within each class, in the given order
        kept = onehot * (onehot.sum(0) >= 2).to(z.dtype)  # classes with fewer examples than folds left out
        fold1 = (torch.remainder(rank, 2) == 0).to(z.dtype) * kept  # even ranks: fold 1; odd ranks: fold 0
        folds = [kept - fold1, fold1]
        grid = torch.linspace(0, 1, self.beta_grid, dtype=z.dtype, device=z.device)
        losses = torch.zeros_like(grid)
        for f in range(2):
            train, test = folds[1 - f], folds[f]
            m_l, c_l = gaussian_estimate(z, train, means_g, self.min_samples, self.cov_ridge)
            per = [lda_log_likelihood(z, test, b * m_l + (1 - b) * means_g, b * c_l + (1 - b) * cov_g, priors)
                   for b in grid]
            losses = losses + torch.stack(per)
        return torch.where(kept.sum() > 0, grid[torch.argmin(losses)], torch.zeros((), dtype=z.dtype,
                                                                                  device=z.device))

    def client_update(
        self, ctx: Context, payload: FDAServer, state: tuple[()], batches: Batches, lr: float
    ) -> tuple[FDAUpdate, tuple[()], Tensor]:
        model = ctx.model
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        onehot = one_hot(model, y0, payload.means.dtype) * m0.to(payload.means.dtype).unsqueeze(-1)
        priors = client_priors(onehot.sum(0))
        head = self.generative_head(model, payload.means, payload.cov, priors)  # step 1: the global head
        body, loss = train_part(ctx, payload.body, head, batches, lr)  # the body under the frozen head
        z = model.features({**body, **head}, x0).detach()
        means, cov, _ = self.adapt(model, z, y0, m0, payload.means, payload.cov)  # steps 2-3
        return FDAUpdate(body, means.detach(), cov.detach()), state, loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: FDAServer, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        assert batches is not None
        model = ctx.model
        x0, y0, m0 = first_epoch(batches, self.adapt_epochs)
        onehot = one_hot(model, y0, payload.means.dtype) * m0.to(payload.means.dtype).unsqueeze(-1)
        priors = client_priors(onehot.sum(0))
        head = self.generative_head(model, payload.means, payload.cov, priors)
        z = model.features({**payload.body, **head}, x0)  # the global body's features of the training data
        means, cov, _ = self.adapt(model, z, y0, m0, payload.means, payload.cov)
        return {**payload.body, **self.generative_head(model, means, cov, priors)}
