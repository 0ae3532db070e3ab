"""Batch normalization that works inside fedmtl's pure, batched training (Ioffe & Szegedy, ICML 2015).

``torch.nn.BatchNorm*`` cannot serve here: it updates its running statistics in place (``torch.func.vmap`` refuses
that) and normalizes with the statistics of the whole batch, padding included (the vmap runner pads every client's
batches to one shape).  ``BatchNorm`` keeps the same mathematics with both problems removed:

* its running statistics are entries of the parameter tree (``*.running_mean``, ``*.running_var``, created with
  ``requires_grad=False``), so they travel, are averaged, checkpointed and kept per client like any other entry;
* in training (inside ``Model.value_and_grad``, which opens a ``training`` context holding the batch's mask) it
  normalizes with the mean and biased variance of the *real* samples only and records the updated running statistics
  ``(1 - momentum) * running + momentum * batch`` (unbiased variance, as PyTorch) in the context; ``value_and_grad``
  returns them in place of the (zero) gradients of those entries and ``local_sgd`` assigns them (no learning rate,
  weight decay, momentum or proximal term touches a statistic);
* everywhere else (prediction, FedEM's E-step, IFCA's cluster choice) it normalizes with the running statistics, as
  ``nn.BatchNorm*`` in ``eval()`` mode.

Equal to ``nn.BatchNorm1d/2d`` in train and eval mode, running statistics included (tested).  ``normalize`` is the
mathematics, for one layer and for K clients' layers side by side (the stacked executor's
``models.clientstack.StackedBatchNorm``: each client's statistics of its own real samples, its own running buffers).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

#: the last component of a parameter name that holds a batch-norm statistic, not a learnable weight
STATISTICS = ("running_mean", "running_var")


def is_statistic(name: str) -> bool:
    """True for a running-statistic entry of a ``BatchNorm`` (``features.1.running_mean``): training assigns it."""
    return name.rsplit(".", 1)[-1] in STATISTICS


@dataclass
class _Training:
    mask: Tensor  # (n,) 1.0 for real samples, 0.0 for padding
    updates: dict[str, Tensor] = field(default_factory=dict)


_TRAINING: ContextVar[_Training | None] = ContextVar("fedmtl_batchnorm_training", default=None)


@contextlib.contextmanager
def training(mask: Tensor) -> Iterator[dict[str, Tensor]]:
    """Within: every ``BatchNorm`` normalizes with the batch statistics of the samples where ``mask`` is 1 and writes
    its updated running statistics into the yielded dict (``{parameter name: tensor}``)."""
    state = _Training(mask)
    token = _TRAINING.set(state)
    try:
        yield state.updates
    finally:
        _TRAINING.reset(token)


class BatchNorm(nn.Module):
    """Batch normalization over the channel axis 1 of (n, C) or (n, C, *spatial) inputs, with affine ``weight`` and
    ``bias`` and running statistics held as non-trainable parameters (see the module docstring)."""

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        if not 0 < momentum <= 1:
            raise ValueError(f"BatchNorm momentum must be in (0, 1], got {momentum}")
        self.num_features, self.momentum, self.eps = num_features, momentum, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.running_mean = nn.Parameter(torch.zeros(num_features), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(num_features), requires_grad=False)
        #: the module's name in its model ("features.1."), set by ``Model`` so that updates are keyed by parameter name
        self.prefix = ""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()
            self.running_mean.zero_()
            self.running_var.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm({self.num_features}) needs inputs (n, {self.num_features}, ...), "
                             f"got {tuple(x.shape)}")
        return normalize(x, self.weight, self.bias, self.running_mean, self.running_var, self.momentum, self.eps,
                         self.prefix)


def _along(t: Tensor, lead: int, nd: int) -> Tensor:
    """A per-channel tensor (*L, C) (``lead`` = len(L) leading client axes) viewed to broadcast over inputs
    (*L, n, C, *spatial) of ``nd`` axes."""
    return t.reshape(*t.shape[:lead], 1, t.shape[-1], *([1] * (nd - lead - 2)))


def normalize(x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float,
              eps: float, prefix: str) -> Tensor:
    """Batch normalization of ``x`` (*L, n, C, *spatial) with per-channel tensors (*L, C): one layer (no leading
    axis: ``BatchNorm``) or K clients' layers side by side (L = (K,): the stacked executor's clients form, each
    client normalized with the statistics of its own batch).  In a ``training`` context, whose mask is then (*L, n),
    the statistics are those of the real samples (Ioffe & Szegedy, Alg. 1: mean and biased variance over the batch
    and the spatial positions) and the updated running statistics ``(1 - momentum) * running + momentum * batch``
    (unbiased variance, as PyTorch) are recorded under ``prefix``; elsewhere the running statistics normalize."""
    lead, nd = running_mean.dim() - 1, x.dim()
    state = _TRAINING.get()
    if state is None:
        mean, var = _along(running_mean, lead, nd), _along(running_var, lead, nd)
    else:
        if state.mask.dim() != lead + 1:
            raise ValueError(f"a batch-norm layer with {lead} client axes got a training mask shaped "
                             f"{tuple(state.mask.shape)}")
        m = state.mask.to(x.dtype).reshape(*state.mask.shape, *([1] * (nd - lead - 1)))  # (*L, n, 1, ...)
        dims = [lead, *range(lead + 2, nd)]  # the batch axis and the spatial ones
        count = m.sum(dims, keepdim=True) * math.prod(x.shape[lead + 2:])  # real samples x positions, per client
        denom = count.clamp_min(1.0)
        mean = (x * m).sum(dims, keepdim=True) / denom
        var = ((x - mean) ** 2 * m).sum(dims, keepdim=True) / denom
        unbiased = var * (denom / (count - 1).clamp_min(1.0))
        mo, shape = momentum, running_mean.shape
        state.updates[prefix + "running_mean"] = (1 - mo) * running_mean + mo * mean.reshape(shape).detach()
        state.updates[prefix + "running_var"] = (1 - mo) * running_var + mo * unbiased.reshape(shape).detach()
    y = (x - mean) * torch.rsqrt(var + eps)
    return y * _along(weight, lead, nd) + _along(bias, lead, nd)


def name_batchnorms(module: nn.Module) -> tuple[str, ...]:
    """Sets every ``BatchNorm``'s ``prefix`` to its name in ``module``; returns the names of their parameters
    (affine weights and statistics), empty for a model without batch norm."""
    names: list[str] = []
    for mod_name, m in module.named_modules():
        if isinstance(m, BatchNorm):
            m.prefix = f"{mod_name}." if mod_name else ""
            names += [m.prefix + p for p, _ in m.named_parameters(recurse=False)]
    return tuple(names)
