"""GPFL: simultaneously learning global and personalized feature information.

Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan, "GPFL: Simultaneously Learning Global and Personalized Feature
Information for Personalized Federated Learning", ICCV 2023 (arXiv 2308.10279), Section 3.2, Eq. (3)-(11), Figure 1
and Algorithm 1.  Sources read: the paper's text (Section 3, Algorithm 1, Table 6), and, for the numbers the text
leaves open (stated below), the authors' run script and initializers.

Client i holds a feature extractor phi (W^fe: ``Model.features``, the model's body), the Conditional Valve CoV (V),
the Global Category Embedding layer GCE (C: one embedding of size K per category, U categories), a frozen copy of
the received GCE (Ĉ) and a personalized head psi (W_i^h: ``Model.apply_head``, the model's own head on the
representation of size K; a model without a body/head split is refused).  For an example (x, y):

* f = phi(x; W^fe) in R^K;
* the conditional inputs: g = sum_u Ĉ_u / U (Eq. 5), and p_i = sum_u alpha_i^u Ĉ_u / U (Eq. 7) with alpha_i^u the
  proportion of category u in the client's training data (Eq. 6);
* CoV: two sub-modules CoV_gamma and CoV_beta of identical structure, each FC (K -> K), ReLU, LayerNorm, fed the
  conditional input: {gamma, beta} = CoV(g; V), {gamma_i, beta_i} = CoV(p_i; V) (Eq. 4);
* the global and personalized features f^G = ReLU[(gamma + 1) (.) f + beta], f^P = ReLU[(gamma_i + 1) (.) f + beta_i]
  (Eq. 3);
* angle-level guidance L^alg = -log softmax_u(sim(f^G, C_u))[y], sim the cosine similarity (Eq. 8), through which
  every embedding of C trains;
* magnitude-level guidance L^mlg = ||f^G - Ĉ_y||_2 (Eq. 9), Ĉ frozen;
* the personalized task L^P = CE(psi(f^P; W_i^h), y) (Eq. 10);
* the local objective L_i = L^P + L^alg + lambda L^mlg + mu ||V|| + mu ||C|| (Eq. 11).

Each round (Algorithm 1) a client starts phi, CoV and GCE from the received W^fe, V and C, Ĉ from C, computes g and
p_i, and trains W^fe, V, C and its own W_i^h together on L_i, end to end, for ``run.local_epochs`` epochs of local
SGD; it uploads W^fe, V and C and keeps W_i^h (Figure 1: "Client i shares W^fe, V, C and Ĉ while keeping W_i^h
locally").  The server averages each of the three weighted by sample counts (Algorithm 1, lines 15-18).  A client
predicts through the personalized task route only (Figure 1): psi(f^P; W_i^h) with the received W^fe, V and C and
its own alpha_i.  Without CoV and GCE the method is FedPer (Table 6, variant (e)): body and head trained together,
the body averaged, the head kept (tested on one local step).

Engine form: the server state ``GPServer`` holds the averaged body, V and C, and the model's initial head (where
unseen clients start; public: drawn from the seed, never trained on client data); the payload and an update are
``GPShared`` (body, V, C), so an update is in the payload's coordinates (robust aggregators, ``[privacy]`` and the
asynchronous modes treat it as any model update).  The client state ``GPClient`` is W_i^h and alpha_i.

Choices and deviations, each stated where it is implemented:
* Eq. (11) writes the regularizers as mu ||V||_2 + mu ||C||_2; they are implemented as the L2 penalty
  (mu / 2)(||V||_2^2 + ||C||_2^2), whose gradient mu V, mu C is the weight decay mu that the authors' code applies to
  V and C, the form for which their mu = 0.1 is set (the unsquared norm with the same mu would be a different, far
  weaker penalty on a large C);
* lambda = 0.01 and mu = 0.1: the paper's text gives no values; these are the authors' run-script values for the
  4-layer CNN and 3-layer MLP (the backbones of its FMNIST experiments);
* the losses are averaged over each batch's real examples (Eq. 1 takes the expectation of the per-example L_i);
  L^mlg is the per-example distance of Eq. (9) (the authors' code takes one norm over the whole batch);
* p_i is Eq. (7) as printed, divided by U (the authors' code leaves the division out); g and p_i come from the
  received Ĉ (Algorithm 1, lines 7-8);
* alpha_i (Eq. 6): the class frequencies of the client's training examples (those of its first epoch this round);
  a client that never trained holds alpha_i = 0 (p_i = 0) until it does;
* initial values (the paper gives none): CoV's FC layers as torch initializes nn.Linear (uniform in +-1/sqrt(K)),
  LayerNorm at weight 1 and bias 0, C standard normal (nn.Embedding's initializer), drawn from the run's seed;
* every client starts its head at the model's initial head (Algorithm 1, line 1 lets each client initialize its
  own); clients that never trained (unseen) train that head alone (W^fe, V and C fixed: only L^P depends on it) on
  their training data for ``unseen_head_epochs`` epochs before testing (the paper evaluates participating clients
  only);
* the run's optimizer (``[optim]``: momentum, weight decay) applies to every trained parameter, V and C included;
* binary models (one logit) are supported: U = 2 categories, two embeddings, L^P the logistic loss of the head's
  logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tree as T
from ..models.base import Model, ModelError
from ..models.parts import value_and_grad_of
from ..optim import Batches, GradFn, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, nobody
from .bodyhead import FIXED_IS_PUBLIC

#: prefix of CoV's (V) and key of GCE's (C) entries while they train beside the model's parameters
COV = "gpfl.cov."
GCE = "gpfl.gce"
#: CoV's and GCE's initial values are drawn from the run's seed plus this (never the model initializer's stream)
SEED_OFFSET = 9613
#: the eps of the cosine similarity's normalization (as ``F.normalize``): an all-zero f^G has similarity 0
COS_EPS = 1e-12


class GPShared(NamedTuple):
    """The payload and a client's update: the shared parts W^fe (the model's body), V (CoV) and C (GCE, (U, K))."""

    params: Params
    cov: Params
    gce: Tensor


class GPServer(NamedTuple):
    """Server state: the averaged W^fe, V and C, and ``fixed``, the model's initial head (unseen clients' start)."""

    params: Params
    cov: Params
    gce: Tensor
    fixed: Params


class GPClient(NamedTuple):
    """Client state: the personalized head W_i^h and alpha_i (U,), the client's class proportions (Eq. 6)."""

    head: Params
    alpha: Tensor


class GPEval(NamedTuple):
    """What a client predicts with: the received body W^fe and V, its head W_i^h and its conditional input p_i."""

    params: Params
    cov: Params
    head: Params
    p: Tensor


def representation_size(model: Model, method: str = "gpfl") -> int:
    """K, the size of the representation entering the model's head (the input size of its first ``nn.Linear``)."""
    model.head_names(method)
    head = model.head_module()
    first = head if isinstance(head, torch.nn.Linear) else next(
        (m for m in head.modules() if isinstance(m, torch.nn.Linear)), None)
    if first is None:
        raise ModelError(f"{method} transforms the representation that enters the model's head and needs its size; "
                         f"the head of model {model.name!r} is a {type(head).__name__} without an nn.Linear")
    return int(first.in_features)


def init_cov(k: int, generator: torch.Generator) -> Params:
    """V: CoV_gamma and CoV_beta, each FC (K -> K) as torch initializes nn.Linear (uniform in +-1/sqrt(K)) and a
    LayerNorm(K) at weight 1, bias 0 (the paper gives no initial values)."""
    bound = 1.0 / math.sqrt(k)
    out: Params = {}
    for part in ("gamma", "beta"):
        out[f"{part}.fc.weight"] = (torch.rand(k, k, generator=generator) * 2 - 1) * bound
        out[f"{part}.fc.bias"] = (torch.rand(k, generator=generator) * 2 - 1) * bound
        out[f"{part}.norm.weight"] = torch.ones(k)
        out[f"{part}.norm.bias"] = torch.zeros(k)
    return out


def one_hot(y: Tensor, u: int, dtype: torch.dtype) -> Tensor:
    """(n, U) indicators I{y = u} (vmap-safe: ``F.one_hot`` reads its input's maximum)."""
    return (y.long().unsqueeze(-1) == torch.arange(u, device=y.device)).to(dtype)


def class_proportions(model: Model, y: Tensor, mask: Tensor) -> Tensor:
    """alpha_i (U,): alpha_i^u = E I{y = u} over the real examples (Eq. 6); zeros where there is none."""
    counts = (one_hot(y, model.num_classes, torch.float32) * mask.to(torch.float32).unsqueeze(-1)).sum(0)
    return counts / counts.sum().clamp_min(1.0)


def conditional_inputs(gce: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """(g, p_i), each (K,), from the frozen embeddings Ĉ (U, K): g = sum_u Ĉ_u / U (Eq. 5) and
    p_i = sum_u alpha_i^u Ĉ_u / U (Eq. 7, divided by U as printed)."""
    u = gce.shape[0]
    return gce.sum(0) / u, (alpha.to(gce.dtype) @ gce) / u


def conditional(cov: Params, c: Tensor, part: str) -> Tensor:
    """gamma or beta (K,) of the conditional input ``c`` (K,): FC, ReLU, LayerNorm (Eq. 4 and the text below it:
    only the conditional input enters the sub-module; the feature enters the affine map of Eq. 3)."""
    z = F.relu(F.linear(c, cov[f"{part}.fc.weight"], cov[f"{part}.fc.bias"]))
    return F.layer_norm(z, z.shape[-1:], cov[f"{part}.norm.weight"], cov[f"{part}.norm.bias"])


def valve(cov: Params, f: Tensor, c: Tensor) -> Tensor:
    """CoV's route for the conditional input ``c``: ReLU[(gamma + 1) (.) f + beta] of features ``f`` (n, K) (Eq. 3)."""
    return F.relu((conditional(cov, c, "gamma") + 1.0) * f + conditional(cov, c, "beta"))


def cosine(f: Tensor, emb: Tensor) -> Tensor:
    """(n, U) sim(f, C_u) = f^T C_u / (||f||_2 ||C_u||_2) (Eq. 8)."""
    fn = f / torch.linalg.vector_norm(f, dim=-1, keepdim=True).clamp_min(COS_EPS)
    en = emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp_min(COS_EPS)
    return fn @ en.T


def angle_guidance(f_g: Tensor, gce: Tensor, y: Tensor) -> Tensor:
    """(n,) L^alg = -log [exp sim(f^G, C_y) / sum_u exp sim(f^G, C_u)] (Eq. 8), C the trained embeddings."""
    logp = F.log_softmax(cosine(f_g, gce), dim=-1)
    return -torch.gather(logp, -1, y.long().unsqueeze(-1)).squeeze(-1)


def magnitude_guidance(f_g: Tensor, frozen: Tensor, y: Tensor) -> Tensor:
    """(n,) L^mlg = ||f^G - Ĉ_y||_2 (Eq. 9), Ĉ the frozen received embeddings (no gradient reaches them).  The
    distance's gradient at 0 is taken as 0 (the norm's subgradient), without a 0/0."""
    target = one_hot(y, frozen.shape[0], frozen.dtype) @ frozen.detach()
    d2 = ((f_g - target) ** 2).sum(-1)
    pos = d2 > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, d2, torch.ones_like(d2))), torch.zeros_like(d2))


def _prefixed(prefix: str, params: Params) -> Params:
    return {prefix + k: v for k, v in params.items()}


def _unprefixed(prefix: str, params: Params) -> Params:
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class GPFL(Algorithm[GPServer, GPClient]):
    """GPFL: a Conditional Valve splits the shared feature extractor's output into a global feature, guided by the
    shared category embeddings, and a personalized feature, fed to each client's own head."""

    name: ClassVar[str] = "gpfl"
    runs_async: ClassVar[bool] = True  # sends W^fe, V, C in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True
    public_server_state: ClassVar[dict[str, str]] = FIXED_IS_PUBLIC
    #: lambda, the weight of the magnitude-level guidance L^mlg in Eq. (11) (0.01: the authors' CNN/MLP value)
    lam: Annotated[float, Range(0, 1e4)] = 0.01
    #: mu, the weight of the L2 penalty on CoV's and GCE's parameters in Eq. (11) (0.1: the authors' CNN/MLP value)
    mu: Annotated[float, Range(0, 1e4)] = 0.1
    #: unseen clients: epochs of training their head (the rest fixed) on their training data before testing
    unseen_head_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_head_epochs  # only unseen clients adapt (needs_adaptation False)

    def check_model(self, model: Model) -> None:
        representation_size(model, self.name)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> GPServer:
        model = ctx.model
        k, u = representation_size(model, self.name), model.num_classes  # binary models: U = 2 categories
        body, head = model.split(params, self.name)
        dev = next(iter(params.values())).device
        g = torch.Generator().manual_seed(int(seed) + SEED_OFFSET)
        cov = init_cov(k, g)
        gce = torch.randn(u, k, generator=g)  # C: nn.Embedding's initializer, N(0, 1)
        return GPServer(body, T.to(cov, dev), gce.to(dev), head)

    def payload(self, server: GPServer) -> GPShared:
        return GPShared(server.params, server.cov, server.gce)

    def aggregate(self, ctx: Context, server: GPServer, updates: GPShared, weights: Tensor,
                  clients: Tensor) -> GPServer:
        if nobody(ctx, weights):
            return server
        # W^fe, V and C: sample-weighted means of the uploads (Algorithm 1, lines 15-18)
        mean: GPShared = ctx.combine(updates, weights)
        return server._replace(params=mean.params, cov=mean.cov, gce=mean.gce)

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: GPServer) -> GPClient:
        return GPClient(server.fixed, torch.zeros(ctx.model.num_classes, device=server.gce.device))

    def grad_fn(self, ctx: Context, frozen: Tensor, alpha: Tensor) -> GradFn:
        """The local step on L_i (Eq. 11) over the model's entries (W^fe and W_i^h), ``COV`` + V and ``GCE`` (C);
        ``frozen``: Ĉ, the received embeddings (g, p_i and L^mlg's targets)."""
        model, lam, mu = ctx.model, self.lam, self.mu
        g, p = conditional_inputs(frozen, alpha)  # Eq. (5), (7)

        def grad_fn(q: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)

            def loss(r: Params) -> Tensor:
                net = {k: v for k, v in r.items() if not k.startswith(COV) and k != GCE}
                cov, gce = _unprefixed(COV, r), r[GCE]
                f = model.features(net, x)  # f = phi(x; W^fe)
                f_g, f_p = valve(cov, f, g), valve(cov, f, p)  # Eq. (3)-(4): the global and personalized routes
                per = (model.nll(model.apply_head(net, f_p), y)  # L^P (Eq. 10)
                       + angle_guidance(f_g, gce, y)  # L^alg (Eq. 8)
                       + lam * magnitude_guidance(f_g, frozen, y))  # lambda L^mlg (Eq. 9)
                total = (per * m).sum() / m.sum().clamp_min(1.0)
                if mu:
                    # DEVIATION: mu ||V||_2 + mu ||C||_2 of Eq. (11) taken as the L2 penalty (mu / 2)(||V||^2 +
                    # ||C||^2), the weight decay mu of the authors' code (the form their mu = 0.1 is set for)
                    sq = sum(((v * v).sum() for v in cov.values()), (gce * gce).sum())
                    total = total + 0.5 * mu * sq
                return total

            return value_and_grad_of(loss, q)

        return grad_fn

    def client_update(
        self, ctx: Context, payload: GPShared, state: GPClient, batches: Batches, lr: float
    ) -> tuple[GPShared, GPClient, Tensor]:
        model = ctx.model
        _, y0, m0 = first_epoch(batches, ctx.local_epochs)
        alpha = class_proportions(model, y0, m0)  # Eq. (6) on the client's training examples
        frozen = payload.gce  # Ĉ: the received C, copied before training (Algorithm 1, line 7)
        start = {**payload.params, **state.head, **_prefixed(COV, payload.cov), GCE: payload.gce}
        new, loss = local_sgd(self.grad_fn(ctx, frozen, alpha), start, batches, lr, ctx.opt)
        body = {k: new[k] for k in payload.params}
        head = {k: new[k] for k in state.head}
        return GPShared(body, _unprefixed(COV, new), new[GCE]), GPClient(head, alpha), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: GPShared, state: GPClient, batches: Batches | None, lr: float, seen: bool
    ) -> GPEval:
        head, alpha = state.head, state.alpha
        if not seen:
            # a client that never trained: alpha_i from its training data, and its head (the initial one) trained on
            # L^P with W^fe, V and C fixed (L^alg and L^mlg do not depend on the head)
            assert batches is not None
            _, y0, m0 = first_epoch(batches, self.adapt_epochs)
            alpha = class_proportions(ctx.model, y0, m0)
            _, p = conditional_inputs(payload.gce, alpha)
            model, net, cov = ctx.model, {**payload.params, **state.head}, payload.cov

            def grad_fn(q: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
                f_p = valve(cov, model.features(net, x), p).detach()  # f^P of the fixed W^fe and V
                return value_and_grad_of(lambda r: model.masked_mean(model.nll(model.apply_head(r, f_p), y), mask), q)

            head, _ = local_sgd(grad_fn, head, batches, lr, ctx.opt)
        _, p = conditional_inputs(payload.gce, alpha)  # p_i from the received C (Eq. 7)
        return GPEval(payload.params, payload.cov, head, p)

    def predict_log_proba(self, ctx: Context, eval_state: GPEval, x: Tensor) -> Tensor:
        # inference: the personalized task route only (Figure 1), psi(f^P; W_i^h)
        model = ctx.model
        f = model.features({**eval_state.params, **eval_state.head}, x)
        return model.log_proba(model.apply_head(eval_state.head, valve(eval_state.cov, f, eval_state.p)))
