"""The algorithm contract: pure functions written once, for one client.

An algorithm is a frozen dataclass whose fields are its hyper-parameters.  The runners
(``fedmtl.simulate``; later Flower) call, per round::

    payload = alg.payload(server)                                  # what the server broadcasts
    update, state', loss = alg.client_update(ctx, payload, state, batches, lr)   # ONE client
    server' = alg.aggregate(ctx, server, updates, weights)        # stacked (K, ...) updates

``client_update`` must be vmap-safe (no ``.item()``, no Python branching on tensor values, no
in-place updates, fixed number of steps).  Evaluation calls ``personalize`` (one client: the state a
client predicts with, possibly after local adaptation on its training batches) then
``predict_log_proba``.  Client and server states are pytrees (dicts / NamedTuples of tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..model import Model
from ..optim import SGD, Batches
from ..tree import Params, Tree


class Context(NamedTuple):
    """What every algorithm function may read besides its state: the model and local solver."""

    model: Model
    opt: SGD
    num_clients: int
    total_train: float  # total number of training examples over all seen clients
    local_epochs: int = 1  # epochs in the batches that client_update receives


@dataclass(frozen=True)
class Algorithm:
    """Base class; subclasses override what differs.  Defaults describe a single global model."""

    name: ClassVar[str] = "base"
    #: personalize() uses the client's training batches (fine-tuning, EM for pi, ...)
    needs_adaptation: ClassVar[bool] = False
    #: epochs of training batches personalize() gets when needs_adaptation is True
    adapt_epochs: ClassVar[int] = 1

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> Tree:
        return {"params": params}

    def payload(self, server: Tree) -> Tree:
        return server["params"]

    def aggregate(
        self, ctx: Context, server: Tree, updates: Tree, weights: Tensor, clients: Tensor | None = None
    ) -> Tree:
        """``weights`` (K,) are n_k for valid updates and 0 for excluded (NaN/Inf) ones; ``clients`` (K,)
        are the indices of the clients the updates come from (server-side bookkeeping, e.g. clusters)."""
        if float(weights.sum()) <= 0:
            return server
        return {"params": T.weighted_mean(updates, weights)}

    def post_round(self, ctx: Context, server: Tree, clients: Tree) -> tuple[Tree, Tree]:
        """Runs after aggregation on the stacked states of all clients (decentralized gossip)."""
        return server, clients

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: Tree) -> Tree:
        """State one client starts with (unbatched); the runner replicates it for every client."""
        return {}

    def init_clients(self, ctx: Context, server: Tree) -> Tree:
        """Stacked states of all ``ctx.num_clients`` clients (default: ``init_client`` replicated)."""
        one = self.init_client(ctx, server)
        return T.tmap(lambda x: x.unsqueeze(0).repeat(ctx.num_clients, *([1] * x.dim())), one)

    def client_update(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches, lr: float
    ) -> tuple[Tree, Tree, Tensor]:
        raise NotImplementedError

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: Tree, state: Tree, batches: Batches | None, lr: float, seen: bool
    ) -> Tree:
        """The state one client predicts with (default: the broadcast global model)."""
        return payload

    def predict_log_proba(self, ctx: Context, eval_state: Tree, x: Tensor) -> Tensor:
        """(n, C) log class probabilities for one client."""
        return ctx.model.log_proba(ctx.model.apply(eval_state, x))

    # -- bookkeeping ----------------------------------------------------------------------------
    def upload_numel(self, ctx: Context, server: Tree) -> int:
        """Floats one client uploads per round (communication accounting)."""
        return T.num_params(self.payload(server))

    def hparams(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def check_positive(name: str, value: float, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ValueError(f"algorithm.{name} must be {'>' if strict else '>='} 0, got {value}")


def zero_loss() -> Tensor:
    return torch.zeros(())
