"""kNN-Per: personalized federated learning through local memorization.

Marfoq, Neglia, Vidal, Kameni, "Personalized Federated Learning through Local Memorization", ICML 2022.

A global model is trained by FedAvg.  At inference, client m builds a datastore of the representations
phi(x_i) (the input of the model's head, ``Model.features``) of its training examples under the global model,
with their labels, and predicts with the interpolation

    p_m(y | x) = lambda p_kNN(y | x) + (1 - lambda) p_global(y | x),
    p_kNN(y | x) proportional to sum over the k nearest stored points (Euclidean distance d) of 1[y_i = y] exp(-d / T)

(``interpolation`` = lambda, ``k``, ``temperature`` = T).  A client with fewer than k training examples uses all
of them.  With lambda = 0 the prediction is the global model's (tested).  The datastore is the whole training
set (the paper's capacity-limited datastores are left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.base import Model
from ..optim import Batches, first_epoch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Context, Toy
from .fedavg import FedAvg


class Datastore(NamedTuple):
    """What a client predicts with: the global model and its training set's representations and labels."""

    params: Params
    keys: Tensor  # (n, d)
    labels: Tensor  # (n,)
    mask: Tensor  # (n,) 1 for real examples, 0 for padding


@dataclass(frozen=True)
class KNNPer(FedAvg):
    """kNN-Per: FedAvg's global model interpolated at inference with a kNN over the client's own representations."""

    name: ClassVar[str] = "knnper"
    toy: ClassVar[Toy] = Toy(model="mlp")
    supports_batch_norm: ClassVar[bool] = True
    needs_adaptation: ClassVar[bool] = True  # the datastore is built from the client's training data
    #: lambda, the weight of the kNN distribution in the interpolation (0 = the global model)
    interpolation: Annotated[float, Range(0, 1)] = 0.5
    #: k, the number of neighbours
    k: Annotated[int, Range(1, 10**4)] = 10
    #: T, the temperature of the kNN weights exp(-d / T)
    temperature: Annotated[float, Range(0, 1e6, lo_open=True)] = 1.0

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)

    def personalize(
        self, ctx: Context, payload: Params, state: tuple[()], batches: Batches | None, lr: float, seen: bool
    ) -> Datastore:
        assert batches is not None
        x, y, mask = first_epoch(batches, self.adapt_epochs)
        return Datastore(payload, ctx.model.features(payload, x), y, mask)

    def predict_log_proba(self, ctx: Context, eval_state: Datastore, x: Tensor) -> Tensor:
        q = ctx.model.features(eval_state.params, x)  # (b, d)
        logp = ctx.model.log_proba(ctx.model.apply_head(eval_state.params, q))
        if self.interpolation == 0:
            return logp
        keys = eval_state.keys
        d2 = (q * q).sum(-1, keepdim=True) - 2 * q @ keys.T + (keys * keys).sum(-1)  # (b, n) squared distances
        dist = d2.clamp_min(0.0).sqrt()
        far = torch.finfo(dist.dtype).max / 4
        dist = torch.where(eval_state.mask.to(torch.bool), dist, torch.full_like(dist, far))
        k = min(self.k, keys.shape[0])
        neg, idx = (-dist).topk(k, dim=-1)  # the k nearest (padding sorts last)
        valid = eval_state.mask[idx] > 0
        logits = torch.where(valid, neg / self.temperature, torch.full_like(neg, -torch.inf))
        w = torch.softmax(logits, dim=-1)  # exp(-d / T), normalized over the valid neighbours
        w = torch.where(valid, w, torch.zeros_like(w))
        onehot = F.one_hot(eval_state.labels.long()[idx], ctx.model.num_classes).to(w.dtype)  # (b, k, C)
        p_knn = (w.unsqueeze(-1) * onehot).sum(1)  # (b, C)
        lam = self.interpolation
        return torch.log((lam * p_knn + (1 - lam) * logp.exp()).clamp_min(1e-30))
