"""FENDA-FL: federated frustratingly easy neural domain adaptation.

Tavakoli, Emerson, Ayromlou, Jewell, Krishnan, Zhang, Verma, Razak, "FENDA-FL: Personalized Federated Learning on
Heterogeneous Clinical Datasets", 2023 (arXiv 2309.16825; later "A Comprehensive View of Personalized Federated
Learning on Heterogeneous Clinical Datasets", MLHC 2024): the FENDA-FL method, the ablation of PerFCL (Zhang et al.,
2022) that extends FENDA (Kim et al., 2016) to federated learning.  Sources read: the paper's abstract and the
method's description (two extractors, concatenation, what is federated); its section and equation numbers could not
be read, so the formula below is cited by its symbols.

Every client's model has two feature extractors of the same architecture, a *global* one theta_G and a *local* one
theta_L, whose representations are concatenated and mapped to the logits by a classification head phi:

    y_hat = phi([f_{theta_G}(x), f_{theta_L}(x)]).

A sampled client receives theta_G, trains theta_G, theta_L and phi jointly on its cross-entropy for
``run.local_epochs`` epochs and sends back theta_G only; theta_L and phi stay on the client and are never sent.  The
server averages the global extractors weighted by sample counts (FedAvg on theta_G).  The frustratingly easy domain
adaptation of Daume III (2007) in feature space: the shared extractor learns what transfers, the local one what is
particular to the client.

Engine form: the feature extractor is the model's body (``Model.features``), so a model with a body/head split is
needed; its head must be an ``nn.Linear`` (d -> C), whose FENDA-FL counterpart is the Linear (2d -> C) over the
concatenation (the same parameter names, the weight twice as wide).  A model without that is refused before any
work, naming the method.

Choices, stated where implemented:
* initialization: theta_G is the run's initial body; theta_L an independent draw of the model's initializer (the
  run's seed + 1), as two separately built modules are; phi's weight the two initial heads' weights side by side,
  scaled by 1/sqrt(2) so that its scale matches a Linear whose fan-in is 2d, its bias the run's initial bias;
* clients outside the federation (unseen; the paper has none) keep the averaged theta_G fixed and train the initial
  theta_L and phi for ``unseen_epochs`` epochs of their training data before testing;
* PerFCL's contrastive losses between the two extractors' features are not part of FENDA-FL (the ablation drops
  them) and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.base import Model, ModelError
from ..models.parts import value_and_grad_of
from ..optim import Batches, local_sgd
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, Context, Toy

#: prefixes of the local extractor's and the head's entries while they train beside the global extractor
LOCAL, HEAD = "local.", "head."


class FendaServer(NamedTuple):
    """Server state: ``params``, the global extractor theta_G (the part averaged and sent), and where a client
    starts its own parts: the initial local extractor theta_L and the initial head phi (2d -> C)."""

    params: Params
    init_local: Params
    init_head: Params


class FendaClient(NamedTuple):
    """Client state: its local extractor theta_L and its head phi (never sent)."""

    local: Params
    head: Params


class FendaEval(NamedTuple):
    glob: Params
    local: Params
    head: Params


def linear_head(model: Model, method: str) -> nn.Linear:
    """The model's head as an ``nn.Linear`` with weight and bias, or a clear error naming ``method``."""
    names = model.head_names(method)
    head = model.head_module()
    if not isinstance(head, nn.Linear) or head.bias is None or len(names) != 2:
        raise ModelError(f"{method} concatenates the representations of a global and a local feature extractor "
                         f"before the head, so it needs a model whose head is one nn.Linear with a bias; the head of "
                         f"model {model.name!r} is a {type(head).__name__}")
    return head


def head_names(model: Model) -> tuple[str, str]:
    """(weight, bias) parameter names of the model's Linear head."""
    w = next(n for n in model.head_names("fenda_fl") if n.endswith("weight"))
    b = next(n for n in model.head_names("fenda_fl") if n.endswith("bias"))
    return w, b


def fenda_logits(model: Model, glob: Params, local: Params, head: Params, x: Tensor) -> Tensor:
    """phi([f_{theta_G}(x), f_{theta_L}(x)]): the head over the concatenated representations."""
    wn, bn = head_names(model)
    d = head[wn].shape[-1] // 2
    # the model's own head shape as filler for the forward pass that captures the representation (not used: the
    # representation does not depend on it)
    filler = {wn: head[wn][..., :d], bn: head[bn]}
    z = torch.cat([model.features({**glob, **filler}, x), model.features({**local, **filler}, x)], -1)
    out = F.linear(z, head[wn], head[bn])
    if model.output == "binary" and out.shape[-1] == 1:
        return out.reshape(out.shape[:-1])
    return out


@dataclass(frozen=True)
class FendaFL(Algorithm[FendaServer, FendaClient]):
    """FENDA-FL: a global feature extractor averaged by the server and a local one kept by each client, their
    representations concatenated into a personal head; only the global extractor is ever sent."""

    name: ClassVar[str] = "fenda_fl"
    runs_async: ClassVar[bool] = True  # sends theta_G in the payload's coordinates (fedmtl.engine.asynchronous)
    toy: ClassVar[Toy] = Toy(model="mlp")
    needs_adaptation: ClassVar[bool] = True  # unseen clients train their local extractor and head first
    keeps_client_state: ClassVar[bool] = True
    public_server_state: ClassVar[dict[str, str]] = {
        "init_local": "the local extractor's initial values, drawn from the run's seed and never updated",
        "init_head": "the head's initial values, drawn from the run's seed and never updated",
    }
    #: unseen clients: epochs of training of their local extractor and head (the global one fixed) before testing
    unseen_epochs: Annotated[int, Range(1, 1000)] = 1

    @property
    def adapt_epochs(self) -> int:  # type: ignore[override]
        return self.unseen_epochs

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        linear_head(model, self.name)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> FendaServer:
        model = ctx.model
        body, head = model.split(params, self.name)
        other = {k: v.to(params[k].device, params[k].dtype) for k, v in model.init(seed + 1).items()}
        local, head2 = model.split(other, self.name)  # an independent draw for theta_L (and phi's second half)
        wn, bn = head_names(model)
        weight = torch.cat([head[wn], head2[wn]], -1) / math.sqrt(2.0)  # Linear(2d -> C), fan-in 2d
        return FendaServer(body, local, {wn: weight, bn: head[bn].clone()})

    def payload(self, server: FendaServer) -> Params:
        return server.params  # theta_G only

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: FendaServer) -> FendaClient:
        return FendaClient(server.init_local, server.init_head)

    def train(self, ctx: Context, glob: Params | None, fixed_glob: Params, state: FendaClient, batches: Batches,
              lr: float) -> tuple[Params, FendaClient, Tensor]:
        """Local SGD on the cross-entropy of phi([f_G, f_L]) over theta_L, phi and (unless ``glob`` is None, then
        ``fixed_glob`` is held) theta_G jointly; (theta_G, new client state, mean loss)."""
        model = ctx.model

        def grad_fn(p: Params, x: Tensor, y: Tensor, mask: Tensor, w: Tensor | None) -> tuple[Params, Tensor]:
            def loss(q: Params) -> Tensor:
                g = {k: v for k, v in q.items() if not k.startswith((LOCAL, HEAD))} if glob is not None else fixed_glob
                loc = {k[len(LOCAL):]: v for k, v in q.items() if k.startswith(LOCAL)}
                head = {k[len(HEAD):]: v for k, v in q.items() if k.startswith(HEAD)}
                return model.masked_mean(model.nll(fenda_logits(model, g, loc, head, x), y), mask, w)

            return value_and_grad_of(loss, p)

        start = {**(glob or {}), **{LOCAL + k: v for k, v in state.local.items()},
                 **{HEAD + k: v for k, v in state.head.items()}}
        new, loss = local_sgd(grad_fn, start, batches, lr, ctx.opt)
        g = {k: v for k, v in new.items() if not k.startswith((LOCAL, HEAD))} if glob is not None else fixed_glob
        loc = {k[len(LOCAL):]: v for k, v in new.items() if k.startswith(LOCAL)}
        head = {k[len(HEAD):]: v for k, v in new.items() if k.startswith(HEAD)}
        return g, FendaClient(loc, head), loss

    def client_update(
        self, ctx: Context, payload: Params, state: FendaClient, batches: Batches, lr: float
    ) -> tuple[Params, FendaClient, Tensor]:
        # FENDA-FL's round: theta_G, theta_L and phi trained jointly; theta_G sent, theta_L and phi kept
        return self.train(ctx, payload, payload, state, batches, lr)

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: Params, state: FendaClient, batches: Batches | None, lr: float, seen: bool
    ) -> FendaEval:
        if not seen:  # outside the federation: the initial theta_L and phi trained under the averaged theta_G
            assert batches is not None
            _, state, _ = self.train(ctx, None, payload, state, batches, lr)
        return FendaEval(payload, state.local, state.head)

    def predict_log_proba(self, ctx: Context, eval_state: FendaEval, x: Tensor) -> Tensor:
        return ctx.model.log_proba(fenda_logits(ctx.model, eval_state.glob, eval_state.local, eval_state.head, x))
