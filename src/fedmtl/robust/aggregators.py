"""Robust aggregation (the ``[robust]`` table): how a round's client updates are combined, for any algorithm
whose server averages updates (FedAvg and its variants, FedEM's M components, Clustered FL's clusters, ...).

* ``mean`` — the algorithm's own weighted mean (weights n_k): the default, bit-for-bit the plain run.
* ``median`` — coordinate-wise median of the valid updates (Yin, Chen, Ramchandran, Bartlett, "Byzantine-
  robust distributed learning: towards optimal statistical rates", ICML 2018); for an even count the mean of
  the two middle values.
* ``trimmed_mean`` — coordinate-wise beta-trimmed mean (same paper): per coordinate, the ``floor(trim * K)``
  largest and smallest values are dropped and the rest averaged (unweighted).
* ``krum`` / ``multi_krum`` — Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine learning with
  adversaries: Byzantine tolerant gradient descent", NeurIPS 2017): each update's score is the sum of squared
  distances to its ``K - f - 2`` nearest other updates (f = ``num_byzantine``); Krum returns the update of least
  score, multi-Krum (same paper, section 4) averages the ``multi_krum_m`` updates of least score (default
  ``K - f``), weighted by n_k as FedAvg would.  Distances are over a client's whole update (all of FedEM's
  components together).  With fewer than ``2f + 3`` valid updates the neighbour count is clamped to 1 (logged).
* ``clip_norm`` (> 0) — each update's deviation from the round's payload (from zero where the update is not
  model-shaped, e.g. MOCHA's dual steps) is scaled down to L2 norm at most ``clip_norm`` before combining.

Only rows with positive weight take part: excluded (non-finite) and failed updates never reach a combiner.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .. import tree as T
from ..tree import Tree

log = logging.getLogger("fedmtl")

AggregatorName = Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"]
Combine = Callable[[Tree, Tensor], Tree]


@dataclass(frozen=True)
class RobustConfig:
    """The ``[robust]`` table."""

    aggregator: AggregatorName = "mean"
    trim: float = 0.1  # trimmed_mean: fraction cut at each end
    num_byzantine: int = 0  # krum / multi_krum: f, the attackers tolerated
    multi_krum_m: int = 0  # multi_krum: updates averaged (0 = K - f)
    clip_norm: float = 0.0  # 0 = off

    def __post_init__(self) -> None:
        if self.aggregator not in ("mean", "median", "trimmed_mean", "krum", "multi_krum"):
            raise ValueError(f"robust.aggregator must be mean, median, trimmed_mean, krum or multi_krum, "
                             f"got {self.aggregator!r}")
        if not (math.isfinite(self.trim) and 0 <= self.trim < 0.5):
            raise ValueError(f"robust.trim must be in [0, 0.5), got {self.trim}")
        if self.num_byzantine < 0 or self.multi_krum_m < 0:
            raise ValueError("robust.num_byzantine and robust.multi_krum_m must be >= 0")
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ValueError(f"robust.clip_norm must be a finite number >= 0 (0 = off), got {self.clip_norm}")

    @property
    def is_plain(self) -> bool:
        return self.aggregator == "mean" and self.clip_norm == 0

    def combiner(self) -> Combine:
        """``combine(stacked updates (K, ...), weights (K,)) -> one update``."""
        if self.aggregator == "mean":
            return T.weighted_mean
        if self.aggregator == "median":
            return median
        if self.aggregator == "trimmed_mean":
            return lambda u, w: trimmed_mean(u, w, self.trim)
        if self.aggregator == "krum":
            return lambda u, w: krum(u, w, self.num_byzantine, 1)
        return lambda u, w: krum(u, w, self.num_byzantine, self.multi_krum_m or None)


def _valid(stacked: Tree, weights: Tensor) -> tuple[Tree, Tensor]:
    ok = torch.nonzero(weights > 0).flatten()
    return T.tmap(lambda x: x.index_select(0, ok.to(x.device)), stacked), weights.index_select(0, ok)


def median(stacked: Tree, weights: Tensor) -> Tree:
    """Coordinate-wise median of the rows with positive weight."""
    valid, _ = _valid(stacked, weights)

    def med(x: Tensor) -> Tensor:
        k = x.shape[0]
        s = x.sort(0).values
        if k % 2:
            return s[k // 2]
        return (s[k // 2 - 1] + s[k // 2]) / 2

    return T.tmap(med, valid)


def trimmed_mean(stacked: Tree, weights: Tensor, trim: float) -> Tree:
    """Coordinate-wise mean of the rows with positive weight after dropping ``floor(trim * K)`` at each end."""
    valid, _ = _valid(stacked, weights)

    def tm(x: Tensor) -> Tensor:
        k = x.shape[0]
        b = int(math.floor(trim * k))
        s = x.sort(0).values
        return s[b : k - b].mean(0)

    return T.tmap(tm, valid)


def flat_rows(stacked: Tree) -> Tensor:
    """(K, D) float64: each row one client's whole update."""
    leaves = T.leaves(stacked)
    return torch.cat([x.reshape(x.shape[0], -1).double() for x in leaves], 1)


def krum_scores(flat: Tensor, f: int) -> Tensor:
    """Krum's score of each row: the sum of squared distances to its ``K - f - 2`` nearest other rows."""
    k = flat.shape[0]
    d = torch.cdist(flat, flat).pow(2)
    d.fill_diagonal_(float("inf"))
    near = k - f - 2
    if near < 1:
        log.warning("krum: %d updates cannot tolerate %d attackers (needs >= %d); scoring by the nearest one",
                    k, f, 2 * f + 3)
        near = 1
    near = min(near, k - 1)
    return d.topk(near, dim=1, largest=False).values.sum(1)


def krum(stacked: Tree, weights: Tensor, f: int, m: int | None) -> Tree:
    """Krum (``m = 1``) or multi-Krum (the ``m`` rows of least score, default ``K - f``, averaged with their
    weights) over the rows with positive weight."""
    valid, w = _valid(stacked, weights)
    k = int(w.numel())
    if k == 1:
        return T.take(valid, 0)
    scores = krum_scores(flat_rows(valid), f)
    m = max(1, min(k, m if m is not None else k - f))
    pick = torch.argsort(scores, stable=True)[:m]
    if m == 1:
        return T.take(valid, int(pick[0]))
    return T.weighted_mean(T.tmap(lambda x: x.index_select(0, pick.to(x.device)), valid), w.index_select(0, pick))


def clip_updates(updates: Tree, reference: Tree | None, weights: Tensor, clip_norm: float) -> Tree:
    """Scale each row's deviation from ``reference`` (None: from zero) to L2 norm at most ``clip_norm``."""
    dev = updates if reference is None else T.tmap(lambda u, r: u - r.unsqueeze(0), updates, reference)
    norms = flat_rows(dev).norm(dim=1)
    factor = torch.clamp(clip_norm / norms.clamp_min(1e-30), max=1.0)
    factor = torch.where(weights.to(factor.device) > 0, factor, torch.ones_like(factor))

    def scale(d: Tensor) -> Tensor:
        return d * factor.to(d.device, d.dtype).reshape(-1, *([1] * (d.dim() - 1)))

    if reference is None:
        return T.tmap(scale, dev)
    return T.tmap(lambda d, r: r.unsqueeze(0) + scale(d), dev, reference)


def reference_of(updates: Tree, payload: Tree) -> Tree | None:
    """The payload when the updates are model-shaped like it (one row per client), else None."""
    try:
        ups, pay = T.to_named(T.take(updates, 0)), T.to_named(payload)
    except Exception:
        return None
    if ups.keys() != pay.keys() or any(ups[n].shape != pay[n].shape for n in ups):
        return None
    return T.from_named(pay, T.take(updates, 0))


__all__ = ["AggregatorName", "RobustConfig", "clip_updates", "krum", "krum_scores", "median", "reference_of",
           "trimmed_mean"]
