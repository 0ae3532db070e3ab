"""FedCP: federated conditional policy.

Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedCP: Separating Feature Information for Personalized Federated Learning
via Conditional Policy", KDD 2023 (arXiv 2307.01217), Section 4 and Figure 2.  Sources read: Figure 2 and the
authors' KDD slides (both in the authors' repository), the equations of Section 4 as reproduced in a public course
report of the paper, and the authors' code for the numbers the text leaves open (stated below).  Only the upload
head's equation number, Eq. (6), could be checked (it is named in Figure 2's caption); the other equations are
cited by their symbols.

Client i holds a feature extractor W_i^fe (``Model.features``: the model's body), the Conditional Policy Network
(CPN) Theta_i, the frozen global head W^hd and its personalized head W_i^hd (two copies of the model's own head,
``Model.apply_head``; a model without a body/head split is refused).  For an example x (Section 4):

* the feature h = f(x; W_i^fe) in R^K, K the head's input size;
* the client-specific vector v_i = sum_c w_c^T, w_c the c-th row of W_i^hd (C x K), taken before the round's local
  training and held constant during it, and the conditional input C = (v_i / ||v_i||_2) (.) h;
* the CPN (Linear K -> 2K, LayerNorm, ReLU; Figure 2) maps C to a in R^{K x 2}, and the policy is the softmax over
  each coordinate's pair, r^k = exp(a^k_1) / sum_j exp(a^k_j), s^k = exp(a^k_2) / sum_j exp(a^k_j), so r + s = 1;
* the global information r (.) h goes through the frozen global head, the personalized information s (.) h through
  the personalized head, and out = g(r (.) h; W^hd) + g(s (.) h; W_i^hd): the prediction, in training and inference;
* the local objective is F_i = E_i + lambda E_i^d, E_i the cross-entropy of ``out`` and E_i^d the MMD between the
  features of W_i^fe and those of the received global extractor W^fe (frozen: data only flows forward through it).

W_i^fe and Theta_i start each round from the received W^fe and Theta (Figure 2: "upload & overwrite & train"),
W_i^hd from the client's own (Figure 2: "upload & train"); all three train on F_i by ``run.local_epochs`` of local
SGD, W^hd and W^fe held fixed.  The client uploads W_i^fe, Theta_i and the upload head hatW_i^hd = (W^hd + W_i^hd)
/ 2 (Eq. 6, W-hat in the paper) and keeps W_i^hd; the server averages each of the three weighted by sample counts,
giving the next W^fe, Theta and W^hd.  A client predicts with the received W^fe, Theta and W^hd, and its own W_i^hd
and v_i (Figure 2's inference path; the authors' clients overwrite W_i^fe and Theta_i with the global ones after
every round, Theta_i for the round's participants only).

Engine form: the server state and the payload are ``CPModel`` (the model's parameters, body W^fe and head W^hd, and
the CPN's); an update is a ``CPModel`` too, its head entries holding hatW_i^hd, so it is model-shaped like the
payload (robust aggregators and ``[privacy]`` clip and combine it as any model update).  The client state is W_i^hd.

Choices and deviations, each stated where it is implemented:
* the policy is the plain softmax of the equations above (deterministic: ``client_update`` is a pure function); the
  authors' code samples it with the Gumbel-softmax (tau = 1, soft) in training and in inference;
* E_i^d: the biased (V-statistic) estimate of MMD^2 between the batch's two sets of features, with the sum of four
  Gaussian kernels exp(-||a - b||^2 / (2 sigma)), sigma in {10, 15, 20, 50}, the kernel of the authors' code (the
  paper names an RBF kernel without its bandwidth); padding slots are left out;
* lambda = 5, the value of the authors' run script (``-lam 5``); the paper gives no separate default in the text we
  could read.  The kernel's bandwidths are absolute: on features within their range the MMD term is strong (on
  configs/fmnist/fedcp.toml's MLP, lambda = 5 contracted the 200-d representation: 77% mean seen test accuracy
  after 20 rounds against 87% at lambda = 1, the value that config uses);
* the CPN's Linear layer starts as torch's default (uniform in +-1/sqrt(K)), LayerNorm at weight 1 and bias 0, drawn
  from the run's seed;
* every client's personalized head starts at the model's initial head (the authors' clients copy the initial
  model).  Clients that never trained (unseen) start theirs at the current global head W^hd and train it alone (W^fe,
  Theta and W^hd fixed, so E_i^d vanishes) on their training data for ``unseen_head_epochs`` epochs before testing
  (the paper evaluates participating clients only);
* in the first round v_i comes from the initial head (the authors' code draws it uniformly at random).
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
from ..optim import Batches, GradFn, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy, nobody

#: the bandwidths sigma of the MMD's kernel sum_sigma exp(-||a - b||^2 / (2 sigma)) (the authors' code)
MMD_BANDWIDTHS: tuple[float, ...] = (10.0, 15.0, 20.0, 50.0)
#: prefixes of the personalized head's and the CPN's entries while they train beside the feature extractor
PERSONAL = "fedcp.personal."
CPN = "fedcp.cpn."
#: the CPN's initial weights are drawn from the run's seed plus this (never the model initializer's stream)
CPN_SEED_OFFSET = 7411


class CPModel(NamedTuple):
    """Server state and payload: ``params``, the model (feature extractor W^fe and global head W^hd), and ``cpn``,
    the Conditional Policy Network Theta.  A client's update has the same form, its head entries holding the upload
    head hatW_i^hd (Eq. 6)."""

    params: Params
    cpn: Params


class PersonalHead(NamedTuple):
    """Client state: the personalized head W_i^hd (the model's head entries)."""

    head: Params


class CPEval(NamedTuple):
    """What a client predicts with: the received model (W^fe and W^hd), the CPN and its personalized head."""

    params: Params
    cpn: Params
    head: Params


def head_dims(model: Model, method: str = "fedcp") -> tuple[int, int]:
    """(K, outputs) of the model's head, an ``nn.Linear``: K the size of the representation (the head's input)."""
    model.head_names(method)
    head = model.head_module()
    k, out = getattr(head, "in_features", None), getattr(head, "out_features", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(k, int) or not isinstance(out, int):
        raise ModelError(f"{method} splits the representation that enters the model's head and reads the head's "
                         f"weight rows; the head of model {model.name!r} is a {type(head).__name__}, not an nn.Linear")
    return k, out


def init_cpn(k: int, generator: torch.Generator) -> Params:
    """Theta: Linear(K, 2K) as torch initializes it (uniform in +-1/sqrt(K)), LayerNorm(2K) at weight 1, bias 0."""
    bound = 1.0 / math.sqrt(k)
    return {
        "linear.weight": (torch.rand(2 * k, k, generator=generator) * 2 - 1) * bound,
        "linear.bias": (torch.rand(2 * k, generator=generator) * 2 - 1) * bound,
        "norm.weight": torch.ones(2 * k),
        "norm.bias": torch.zeros(2 * k),
    }


def client_vector(head: Params) -> Tensor:
    """v_i = sum_c w_c^T over the rows w_c of the personalized head's weight (C x K; one row for a binary model),
    detached: a constant of the round's training."""
    (w,) = [t for t in head.values() if t.dim() == 2]
    return w.detach().sum(0)


def policy(cpn: Params, h: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(r, s), each (n, K): the conditional policy of features ``h`` (n, K) for a client with vector ``v`` (K,)."""
    c = h * (v / v.norm().clamp_min(1e-12))  # C = (v_i / ||v_i||_2) (.) h_i
    a = F.linear(c, cpn["linear.weight"], cpn["linear.bias"])
    a = F.relu(F.layer_norm(a, a.shape[-1:], cpn["norm.weight"], cpn["norm.bias"]))  # Linear, LayerNorm, ReLU
    # a in R^{K x 2}: the first K outputs are a^k_1, the next K a^k_2.  DEVIATION: the plain softmax of the paper's
    # equation, deterministic; the authors' code draws a Gumbel-softmax sample (tau = 1) here
    p = torch.softmax(a.reshape(*a.shape[:-1], 2, -1), dim=-2)
    return p[..., 0, :], p[..., 1, :]  # r (global), s (personalized); r + s = 1


def cp_logits(model: Model, params: Params, cpn: Params, head: Params, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(out, h): out = g(r (.) h; W^hd) + g(s (.) h; W_i^hd) with h = f(x; W^fe) (``params``: the feature extractor and
    the global head W^hd; ``head``: W_i^hd)."""
    h = model.features(params, x)
    r, s = policy(cpn, h, v)
    return model.apply_head(params, r * h) + model.apply_head(head, s * h), h


def mmd2(a: Tensor, b: Tensor, mask: Tensor, bandwidths: tuple[float, ...] = MMD_BANDWIDTHS) -> Tensor:
    """E_i^d: the biased estimate of MMD^2 between the real rows (``mask`` = 1) of ``a`` and ``b`` (n, K) under the
    kernel k(u, w) = sum_sigma exp(-||u - w||^2 / (2 sigma)): mean k(a, a') + mean k(b, b') - 2 mean k(a, b)."""
    m = mask.to(a.dtype)
    w = m / m.sum().clamp_min(1.0)
    pair = w.unsqueeze(-1) * w.unsqueeze(-2)  # 1 / n^2 on pairs of real rows, 0 on padding

    def sq(u: Tensor, z: Tensor) -> Tensor:  # ||u_i - z_j||^2
        return ((u * u).sum(-1).unsqueeze(-1) + (z * z).sum(-1).unsqueeze(-2) - 2.0 * u @ z.T).clamp_min(0.0)

    def kern(d: Tensor) -> Tensor:
        return sum((torch.exp(-0.5 * d / s) for s in bandwidths), torch.zeros_like(d))

    return (pair * (kern(sq(a, a)) + kern(sq(b, b)) - 2.0 * kern(sq(a, b)))).sum()


def _prefixed(prefix: str, params: Params) -> Params:
    return {prefix + k: v for k, v in params.items()}


def _unprefixed(prefix: str, params: Params) -> Params:
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class FedCP(Algorithm[CPModel, PersonalHead]):
    """FedCP: a per-example policy splits each feature between a frozen global head and a personalized head; the
    feature extractor, the policy network and the heads' mean are averaged by the server."""

    name: ClassVar[str] = "fedcp"
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True
    #: lambda, the weight of the MMD term E_i^d in F_i = E_i + lambda E_i^d (5: the authors' run script)
    lam: Annotated[float, Range(0, 1e4)] = 5.0
    #: unseen clients: epochs of training their personalized head (the rest fixed) on their training data
    unseen_head_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_head_epochs  # only unseen clients adapt (needs_adaptation False)

    def check_model(self, model: Model) -> None:
        head_dims(model, self.name)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> CPModel:
        k, _ = head_dims(ctx.model, self.name)
        dev = next(iter(params.values())).device
        g = torch.Generator().manual_seed(int(seed) + CPN_SEED_OFFSET)
        return CPModel(params, T.to(init_cpn(k, g), dev))

    def payload(self, server: CPModel) -> CPModel:
        return server

    def aggregate(self, ctx: Context, server: CPModel, updates: CPModel, weights: Tensor,
                  clients: Tensor) -> CPModel:
        if nobody(ctx, weights):
            return server
        # W^fe, W^hd = mean of the upload heads hatW_i^hd, Theta: sample-weighted means (Figure 2b)
        combined: CPModel = ctx.combine(updates, weights)
        return combined

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: CPModel) -> PersonalHead:
        # the head of the server's model: the initial head for every seen client (the store builds their states from
        # the initial server), the current global head W^hd for an unseen one
        return PersonalHead(ctx.model.split(server.params, self.name)[1])

    def grad_fn(self, ctx: Context, payload: CPModel, v: Tensor, fixed: Params, lam: float) -> GradFn:
        """The local step on F_i = E_i + lambda E_i^d over the trained entries (feature extractor, ``PERSONAL`` +
        W_i^hd, ``CPN`` + Theta_i); ``fixed``: the entries not trained (W^hd; for an unseen client W^fe and Theta
        too, and ``lam`` = 0)."""
        model = ctx.model

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)
            # the received extractor W^fe only runs forward (Figure 2: no gradient reaches it)
            hg = model.features(payload.params, x).detach() if lam else None

            def loss(q: Params) -> Tensor:
                full = {**fixed, **q}
                params = {k: full[k] for k in payload.params}
                out, h = cp_logits(model, params, _unprefixed(CPN, full), _unprefixed(PERSONAL, full), v, x)
                f = (model.nll(out, y) * m).sum() / m.sum().clamp_min(1.0)  # E_i, the cross-entropy of out
                if hg is not None:
                    f = f + lam * mmd2(h, hg, m)  # F_i = E_i + lambda E_i^d
                return f

            return value_and_grad_of(loss, p)

        return grad_fn

    def client_update(
        self, ctx: Context, payload: CPModel, state: PersonalHead, batches: Batches, lr: float
    ) -> tuple[CPModel, PersonalHead, Tensor]:
        model = ctx.model
        body, ghead = model.split(payload.params, self.name)
        v = client_vector(state.head)  # v_i from W_i^hd before the round, constant during it
        start = {**body, **_prefixed(PERSONAL, state.head), **_prefixed(CPN, payload.cpn)}
        new, loss = local_sgd(self.grad_fn(ctx, payload, v, ghead, self.lam), start, batches, lr, ctx.opt)
        head = _unprefixed(PERSONAL, new)
        upload = {k: (ghead[k] + head[k]) / 2 for k in ghead}  # hatW_i^hd = (W^hd + W_i^hd) / 2 (Eq. 6)
        params = {k: new[k] if k in body else upload[k] for k in payload.params}
        return CPModel(params, _unprefixed(CPN, new)), PersonalHead(head), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: CPModel, state: PersonalHead, batches: Batches | None, lr: float, seen: bool
    ) -> CPEval:
        head = state.head
        if not seen:
            # a client that never trained: its personalized head (the global head W^hd) trained alone, W^fe, Theta
            # and W^hd fixed (E_i^d is then 0: the extractor is the received one)
            assert batches is not None
            fixed = {**payload.params, **_prefixed(CPN, payload.cpn)}
            start = _prefixed(PERSONAL, head)
            grad_fn = self.grad_fn(ctx, payload, client_vector(head), fixed, 0.0)
            new, _ = local_sgd(grad_fn, start, batches, lr, ctx.opt)
            head = _unprefixed(PERSONAL, new)
        return CPEval(payload.params, payload.cpn, head)

    def predict_log_proba(self, ctx: Context, eval_state: CPEval, x: Tensor) -> Tensor:
        out, _ = cp_logits(ctx.model, eval_state.params, eval_state.cpn, eval_state.head,
                           client_vector(eval_state.head), x)
        return ctx.model.log_proba(out)
