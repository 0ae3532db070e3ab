"""FedProto: federated prototype learning.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022, Algorithm 1 (equation numbers of arXiv:2105.00243).

Every client keeps its OWN model F_i = g_i o f_i (body f_i = ``Model.features``, head g_i = ``Model.apply_head`` on
the model's own body/head split); no model is ever averaged.  Only class prototypes cross the network:

* a sampled client trains its model for ``run.local_epochs`` on (eq. 7, in the per-example form of Appendix B)

      L(D_i, w_i) = CE(g_i(f_i(x)), y) + lambda * ||f_i(phi_i; x) - Cbar^(y)||_2^2 / d,

  averaged over each batch's real examples, Cbar^(y) the global prototype of the example's class, d the size of the
  representation (``distance`` below);
* it then computes its local prototypes with the trained model over its training examples (eq. 3)

      C_i^(j) = 1/|D_i,j| sum_{(x, y) in D_i,j} f_i(phi_i; x),

  and sends them with its class counts |D_i,j| (a (C, d) matrix and a (C,) vector);
* the server forms each class's global prototype from the clients that have that class (eq. 6)

      Cbar^(j) = sum_{i in N_j} |D_i,j| C_i^(j) / sum_{i in N_j} |D_i,j|;

  a class that no client of the round had keeps its previous prototype.

A client predicts with its own model's logits (the paper's evaluation), or, with ``inference = "prototype"``, by
the nearest global prototype in its feature space (eq. 4).  Binary models (one logit) are supported: their classes
0 and 1 get a prototype each.

Deviations and choices, each stated where it is implemented:
* eq. 6 as printed carries an extra factor 1/|N_j| in front of weights |D_i,j|/N_j that already sum to one over
  N_j; it would shrink each prototype by the number of clients holding the class, which the paper's own analysis
  (Appendix B: Cbar = sum_i q_i C_i with sum_i q_i = 1) does not have.  The counts-weighted mean is used;
* the regularizer is eq. 7-8's distance between local and global prototypes written per example, as the paper's
  Appendix B and the authors' code train it.  Its scale (``distance``): by default the squared distance averaged
  over the d coordinates, ||f_i(x) - Cbar^(y)||_2^2 / d, as the authors' code computes it (a mean-squared error) and
  so the scale in which the paper tuned lambda = 1; ``distance = "sum"`` is Appendix B's ||.||_2^2, d times as
  strong (on configs/fmnist/fedproto.toml, d = 200, it collapses the representation at lambda = 1: 22% test
  accuracy against 83% with the mean);
* the term is left out for the examples whose class has no global prototype yet (every example in the first
  round): the loss of such an example is its cross-entropy alone, still counted in the batch mean;
* the paper samples every client each round; with partial participation a round's prototypes come from the clients
  that trained in it and sent a valid (finite) update;
* unseen clients (never trained) start from the common initial model and fine-tune it on their training data with
  the prototype regularizer for ``unseen_epochs`` epochs (the paper's "Model Inference" discussion of a new client:
  download the global prototypes, fine-tune the local model on the local objective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.base import Model, ModelError
from ..optim import Batches, GradFn, first_epoch, local_sgd
from ..schema import Annotated, Range
from ..transforms import eager
from ..tree import Params
from .base import Algorithm, Context, Toy


class ProtoServer(NamedTuple):
    """Server state: the global prototypes (C, d), the number of examples each was last formed from (C,; 0: the class
    has no prototype yet) and the initial model every client starts from."""

    protos: Tensor
    counts: Tensor
    init: Params


class GlobalPrototypes(NamedTuple):
    """What the server broadcasts: the global prototypes (C, d) and their counts (C,; > 0 where a prototype
    exists)."""

    protos: Tensor
    counts: Tensor


class LocalPrototypes(NamedTuple):
    """What a client sends: its prototypes C_i^(j) (C, d; zero for classes it has not) and counts |D_i,j| (C,)."""

    protos: Tensor
    counts: Tensor


class PersonalModel(NamedTuple):
    """Client state: the client's own model."""

    params: Params


class ProtoEval(NamedTuple):
    """What a client predicts with: its model, and the global prototypes (for ``inference = "prototype"``)."""

    params: Params
    protos: Tensor
    counts: Tensor


def grad_with_aux(fn: Callable[[Params], tuple[Tensor, Tensor]], params: Params) -> tuple[Params, Tensor]:
    """(gradient of the scalar ``fn(params)[0]`` w.r.t. ``params``, ``fn(params)[1]``): ``value_and_grad_of`` for a
    loss that reports another value than the one it differentiates (plain autograd outside torch.func transforms,
    ``torch.func.grad`` inside)."""
    if eager():
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss, aux = fn(leaves)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        return ({k: torch.zeros_like(v) if g is None else g.contiguous()
                 for (k, v), g in zip(params.items(), grads, strict=True)}, aux.detach())
    grads, aux = torch.func.grad(fn, has_aux=True)(params)
    return grads, aux


def representation_dim(model: Model, method: str = "fedproto") -> int:
    """d, the dimension of the representation f(x) (the input of the model's head, an ``nn.Linear``)."""
    head = model.head_module()
    d = getattr(head, "in_features", None)
    if not isinstance(d, int):
        raise ModelError(f"{method} keeps class prototypes of the representation that enters the model's head; the "
                         f"head of model {model.name!r} is a {type(head).__name__}, not an nn.Linear, so the "
                         "representation's size is unknown")
    return d


def one_hot(model: Model, y: Tensor, dtype: torch.dtype) -> Tensor:
    """(n, C) one-hot rows of labels ``y`` (binary models: classes 0 and 1); vmap-safe."""
    return (y.long().unsqueeze(-1) == torch.arange(model.num_classes, device=y.device)).to(dtype)


def local_prototypes(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> LocalPrototypes:
    """Eq. 3: the per-class mean representation C_i^(j) of the real examples (``mask`` = 1) of ``x`` and their
    counts |D_i,j|; a class without examples gets a zero row and count 0."""
    z = model.features(params, x)  # (n, d)
    onehot = one_hot(model, y, z.dtype) * mask.to(z.dtype).unsqueeze(-1)  # (n, C)
    counts = onehot.sum(0)  # |D_i,j|
    protos = (onehot.T @ z) / counts.clamp_min(1.0).unsqueeze(-1)
    return LocalPrototypes(protos, counts)


def aggregate_prototypes(old_protos: Tensor, old_counts: Tensor, protos: Tensor, counts: Tensor,
                         weights: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 6 over K updates (protos (K, C, d), counts (K, C)): Cbar^(j) = sum_i |D_i,j| C_i^(j) / sum_i |D_i,j| over
    the updates with weight > 0; the others (excluded NaN / Inf updates) are left out whatever they hold, and a class
    with no example among the kept updates keeps its previous prototype and count."""
    dev = old_protos.device
    counts, protos = counts.to(dev, torch.float64), protos.to(dev, torch.float64)
    keep = (weights.to(dev) > 0).unsqueeze(-1) & (counts > 0)  # (K, C): kept update i has examples of class j
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    n = torch.where(keep, counts, zero)  # |D_i,j|, 0 outside ``keep`` (where() never multiplies a NaN row)
    c = torch.where(keep.unsqueeze(-1), protos, zero)  # C_i^(j)
    total = n.sum(0)  # (C,) N_j
    mean = (n.unsqueeze(-1) * c).sum(0) / total.clamp_min(1.0).unsqueeze(-1)  # the counts-weighted mean (eq. 6)
    has = total > 0
    new_protos = torch.where(has.unsqueeze(-1), mean.to(old_protos.dtype), old_protos)
    new_counts = torch.where(has, total.to(old_counts.dtype), old_counts)
    return new_protos, new_counts


def prototype_logits(z: Tensor, protos: Tensor, counts: Tensor) -> Tensor:
    """(n, C) scores of representations ``z`` (n, d): -||z - Cbar^(j)||^2 for the classes with a prototype, so their
    argmax is eq. 4's nearest prototype (their softmax: the prototypical-network probabilities); a class without a
    prototype scores e^-30 below the farthest existing one (uniform scores where no class has a prototype yet)."""
    d2 = ((z * z).sum(-1, keepdim=True) - 2.0 * z @ protos.T + (protos * protos).sum(-1)).clamp_min(0.0)
    has = counts > 0
    worst = torch.where(has, -d2, torch.full_like(d2, float("inf"))).amin(-1, keepdim=True)
    worst = torch.where(torch.isfinite(worst), worst - 30.0, torch.zeros_like(worst))
    return torch.where(has, -d2, worst)


@dataclass(frozen=True)
class FedProto(Algorithm[ProtoServer, PersonalModel]):
    """FedProto: personal models regularized towards global class prototypes; only prototypes are exchanged."""

    name: ClassVar[str] = "fedproto"
    toy: ClassVar[Toy] = Toy(model="mlp")
    keeps_client_state: ClassVar[bool] = True
    # the updates are class prototypes with counts, aggregated class by class: robust aggregators of model updates
    # do not apply, and [privacy] (user-level DP of averaged model updates) is refused by check_privacy
    averages_updates: ClassVar[bool] = False
    #: lambda, the weight of the prototype regularizer (eq. 7; 0 = local training; the paper's best for MNIST and
    #: FEMNIST, Appendix A)
    lam: Annotated[float, Range(0, 1e4)] = 1.0
    #: how a client predicts: its own model's logits (the paper's evaluation) or the nearest global prototype (eq. 4)
    inference: Literal["model", "prototype"] = "model"
    #: the regularizer's squared distance: averaged over the representation's d coordinates (the authors' code, in
    #: whose scale the paper's lambda was tuned) or summed over them (Appendix B's ||.||_2^2, lambda * d as strong)
    distance: Literal["mean", "sum"] = "mean"
    #: unseen clients: epochs of fine-tuning the initial model on their training data with the regularizer
    unseen_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_epochs  # only unseen clients adapt (needs_adaptation False: seen ones predict as they are)

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> ProtoServer:
        ref = next(iter(params.values()))
        c, d = ctx.model.num_classes, representation_dim(ctx.model, self.name)
        # the initial model is kept so that every client (seen or unseen) starts from the same one (init_client)
        return ProtoServer(torch.zeros(c, d, dtype=torch.float32, device=ref.device),
                           torch.zeros(c, dtype=torch.float32, device=ref.device),
                           {k: v.detach().clone() for k, v in params.items()})

    def payload(self, server: ProtoServer) -> GlobalPrototypes:
        return GlobalPrototypes(server.protos, server.counts)

    def update_like(self, ctx: Context, payload: GlobalPrototypes) -> LocalPrototypes:
        return LocalPrototypes(payload.protos, payload.counts)

    def aggregate(self, ctx: Context, server: ProtoServer, updates: LocalPrototypes, weights: Tensor,
                  clients: Tensor) -> ProtoServer:
        if not bool((weights > 0).any()):
            return server
        protos, counts = aggregate_prototypes(server.protos, server.counts, updates.protos, updates.counts, weights)
        return server._replace(protos=protos, counts=counts)

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: ProtoServer) -> PersonalModel:
        return PersonalModel(server.init)

    def grad_fn(self, ctx: Context, payload: GlobalPrototypes) -> GradFn:
        """The local step's ``(params, x, y, mask, weight) -> (grads, loss)`` on eq. 7."""
        model, lam = ctx.model, self.lam
        if lam == 0:
            return model.value_and_grad  # the regularizer vanishes: plain local training (Local), bit for bit

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            m = mask.to(torch.float32)
            onehot = one_hot(model, y, payload.protos.dtype)  # (B, C)
            target = onehot @ payload.protos  # Cbar^(y) of every example (B, d)
            # the term only where the example's class has a global prototype (none in the first round)
            on = onehot @ (payload.counts > 0).to(onehot.dtype)  # (B,)

            def loss(q: Params) -> tuple[Tensor, Tensor]:
                z = model.features(q, x)
                ce = model.nll(model.apply_head(q, z), y)  # L_S
                reg = ((z - target) ** 2).sum(-1) * on  # ||f_i(phi_i; x) - Cbar^(y)||_2^2 (eq. 7, Appendix B)
                if self.distance == "mean":
                    reg = reg / z.shape[-1]
                n = m.sum().clamp_min(1.0)
                return ((ce + lam * reg) * m).sum() / n, (ce.detach() * m).sum() / n

            # the logged loss is the supervised loss L_S (the regularizer's target moves every round)
            return grad_with_aux(loss, p)

        return grad_fn

    def client_update(
        self, ctx: Context, payload: GlobalPrototypes, state: PersonalModel, batches: Batches, lr: float
    ) -> tuple[LocalPrototypes, PersonalModel, Tensor]:
        params, loss = local_sgd(self.grad_fn(ctx, payload), state.params, batches, lr, ctx.opt)
        # eq. 3 with the trained model over the client's training examples (its first epoch holds each once)
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        update = local_prototypes(ctx.model, params, x0, y0, m0)
        return LocalPrototypes(update.protos.detach(), update.counts.detach()), PersonalModel(params), loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: GlobalPrototypes, state: PersonalModel, batches: Batches | None, lr: float,
        seen: bool,
    ) -> ProtoEval:
        params = state.params
        if not seen:
            # a client that never trained: the initial model (its state) fine-tuned on its training data with the
            # prototype regularizer (the paper's Discussion, "Model Inference", for a new client)
            assert batches is not None
            params, _ = local_sgd(self.grad_fn(ctx, payload), params, batches, lr, ctx.opt)
        return ProtoEval(params, payload.protos, payload.counts)

    def predict_log_proba(self, ctx: Context, eval_state: ProtoEval, x: Tensor) -> Tensor:
        model = ctx.model
        if self.inference == "model":
            return model.log_proba(model.apply(eval_state.params, x))
        z = model.features(eval_state.params, x)
        # eq. 4: the class of the nearest global prototype, as the softmax of -||f(x) - Cbar^(j)||^2
        return F.log_softmax(prototype_logits(z, eval_state.protos.to(z.dtype), eval_state.counts), dim=-1)
