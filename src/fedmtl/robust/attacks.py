"""An attack harness for experiments and tests (the ``[attack]`` table): a fixed set of malicious clients,
drawn once per run from the run's seed, that corrupt what they send.

Every attack below acts on *deviations* ``d = update - payload`` (where an update is not model-shaped, e.g. MOCHA's
dual steps, "payload" reads zero) and sends ``payload + (malicious deviation)``; ``strength`` is each attack's own
parameter, ``None`` (the default) its default:

* ``scale`` — ``payload + strength * d`` (model replacement / boosting; ``strength = -100`` is "minus a hundred
  times its update").  Default 1 (honest).
* ``signflip`` — ``payload - strength * d``.  Default 1.
* ``gaussian`` — ``payload + strength * N(0, I)``, ignoring its data (noise drawn from ``(seed, round)``).
  Default 1.
* ``labelflip`` — the client trains honestly on its training labels flipped ``y -> C - 1 - y`` (data poisoning;
  its update is then sent as is).  ``strength`` is unused.
* ``ipm`` — inner product manipulation (Xie, Koyejo, Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by
  Inner Product Manipulation", UAI 2019): every attacker sends ``payload - strength * mean(d_h)``, ``d_h`` the
  round's honest deviations; ``strength`` is the paper's epsilon.  Default 0.1 (the paper's small epsilon, which
  Krum-type rules cannot tell from an honest update); epsilon 0.5 is the usual "large" setting.
* ``alie`` — "a little is enough" (Baruch, Baruch, Goldberg, "A Little Is Enough: Circumventing Defenses for
  Distributed Learning", NeurIPS 2019): every attacker sends, per coordinate, ``mean(d_h) - z * std(d_h)``.
  ``strength`` is z; by default z is the paper's ``z_max`` for the round's n valid updates and f attackers among
  them: ``s = floor(n / 2 + 1) - f`` honest "supporters" are needed, and z is the largest value with
  ``Phi(z) < (n - s) / n`` (Phi the standard normal CDF), i.e. ``z = Phi^-1((n - s) / n)``.
* ``minmax`` — AGR-agnostic min-max (Shejwalkar, Houmansadr, "Manipulating the Byzantine: Optimizing Model
  Poisoning Attacks and Defenses for Federated Learning", NDSS 2021): every attacker sends
  ``mean(d_h) + gamma * p`` with the paper's inverse-standard-deviation direction ``p = -std(d_h)``, gamma the
  largest value with ``max_i ||malicious - d_i|| <= strength * max_{i,j} ||d_i - d_j||`` over the honest
  deviations (distances over a client's whole update).  Default strength 1: the paper's constraint (the
  malicious update is no farther from any honest one than the two farthest honest ones are from each other).

Threat model of ``ipm``, ``alie`` and ``minmax``: the attackers are *omniscient* and collude — they see every
honest update of the round (the rows that are valid and not attackers') before sending, and all send the same
vector.  This is the standard setting of these papers' strongest variants (ALIE's paper also studies attackers
that estimate the statistics from their own updates; this harness gives them the exact honest ones).  Means and
standard deviations are unweighted (the papers' workers are equal) and the standard deviation is the population
one (divides by the number of honest rows).  A round with no honest valid row: these three attacks compute their
statistics from the attackers' own honest updates instead.

Attacks act on the update a client sends, never on its own state.  ``fraction`` of the seen clients (rounded) are
attackers; ``summary.json`` lists them under ``"attackers"``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..data.federated import FederatedData
from ..schema import Annotated, Range, check_fields
from ..tree import Tree

AttackKind = Literal["none", "scale", "signflip", "gaussian", "labelflip", "ipm", "alie", "minmax"]
KINDS: tuple[str, ...] = get_args(AttackKind)
#: attacks that need the round's honest updates (omniscient attackers)
OMNISCIENT: tuple[str, ...] = ("ipm", "alie", "minmax")
#: each attack's ``strength`` when none is given (ALIE's default z depends on the round: ``alie_z``)
DEFAULT_STRENGTH: dict[str, float] = {"scale": 1.0, "signflip": 1.0, "gaussian": 1.0, "labelflip": 1.0, "ipm": 0.1,
                                      "minmax": 1.0}


@dataclass(frozen=True)
class AttackConfig:
    """The ``[attack]`` table."""

    kind: AttackKind = "none"
    fraction: Annotated[float, Range(0, 1)] = 0.0
    # each attack's own parameter (see the module's docstring); None = the attack's default
    strength: Annotated[float | None, Range(-1e6, 1e6)] = None

    def __post_init__(self) -> None:
        check_fields(self, "attack")
        if self.kind == "minmax" and self.strength is not None and self.strength <= 0:
            raise ValueError(f"attack.strength (minmax: the allowed distance, a multiple of the honest updates' "
                             f"largest pairwise distance) must be > 0, got {self.strength}")

    @property
    def active(self) -> bool:
        return self.kind != "none" and self.fraction > 0

    def strength_or_default(self) -> float | None:
        """``strength``, else the attack's default (None for ``alie``: z from n and f, per round)."""
        return self.strength if self.strength is not None else DEFAULT_STRENGTH.get(self.kind)

    def attackers(self, num_clients: int, seed: int) -> Tensor:
        """The malicious clients (sorted ids), the same for the whole run."""
        if not self.active:
            return torch.zeros(0, dtype=torch.long)
        k = int(round(self.fraction * num_clients))
        rng = np.random.default_rng(np.random.SeedSequence([seed, 13]))
        return torch.from_numpy(np.sort(rng.choice(num_clients, size=k, replace=False))).long()


def alie_z(n: int, f: int) -> float:
    """ALIE's ``z_max`` for ``n`` updates of which ``f`` are the attackers': ``Phi^-1((n - s) / n)`` with
    ``s = floor(n / 2 + 1) - f`` (Baruch et al. 2019, section 3)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    # deviation: the paper assumes f < n / 2 + 1 (s >= 1); with an attacker majority p >= 1 and z would be
    # infinite, so p is capped at 0.999 (z = 3.09)
    p = min(max(p, 0.5), 0.999)
    return NormalDist().inv_cdf(p)


def _deviations(updates: Tree, ref: Tree) -> list[Tensor]:
    """Per leaf, the rows' deviations from ``ref`` in float64."""
    return [x.double() - r.unsqueeze(0).double().to(x.device) for x, r in zip(T.leaves(updates), T.leaves(ref),
                                                                               strict=True)]


def omniscient_deviation(cfg: AttackConfig, dev: list[Tensor], honest: Tensor, n_valid: int, n_attack: int
                         ) -> list[Tensor]:
    """The one malicious deviation (per leaf, float64, without the row axis) that ``ipm`` / ``alie`` / ``minmax``
    attackers send, from the honest rows ``honest`` of the per-leaf deviations ``dev``."""
    hon = [d.index_select(0, honest.to(d.device)) for d in dev]
    mean = [h.mean(0) for h in hon]
    if cfg.kind == "ipm":
        eps = cfg.strength_or_default()
        assert eps is not None
        return [-eps * m for m in mean]
    std = [h.std(0, correction=0) for h in hon]
    if cfg.kind == "alie":
        z = cfg.strength if cfg.strength is not None else alie_z(n_valid, n_attack)
        return [m - z * s for m, s in zip(mean, std, strict=True)]
    # minmax: mean + gamma * p, p = -std, gamma the largest value keeping the distance bound
    bound = cfg.strength_or_default()
    assert bound is not None
    flat = torch.cat([h.reshape(h.shape[0], -1) for h in hon], 1)
    mu = torch.cat([m.reshape(-1) for m in mean])
    p = -torch.cat([s.reshape(-1) for s in std])
    gamma = minmax_gamma(flat, mu, p, bound)
    return [m + gamma * (-s) for m, s in zip(mean, std, strict=True)]


def minmax_gamma(honest: Tensor, mean: Tensor, direction: Tensor, bound: float = 1.0) -> float:
    """The largest ``gamma >= 0`` with ``max_i ||mean + gamma * direction - honest_i|| <= bound * D``, D the largest
    pairwise distance of the rows of ``honest`` (K, D).

    Deviation from the paper: it finds gamma by a binary search (from gamma_init, to a tolerance); here it is the
    exact solution.  ``||mean - h_i + gamma p||^2 = (bound D)^2`` is a quadratic in gamma whose positive root is the
    largest gamma allowed by row i, and the bound holds for every row up to the smallest of these roots (each row's
    distance is convex in gamma and within the bound at gamma = 0 when bound >= 1, ``mean`` being a convex
    combination of the rows).  0 when the direction is zero or no gamma > 0 is allowed."""
    h = honest.double()
    limit = bound * float(torch.cdist(h, h).max()) if h.shape[0] > 1 else 0.0
    p = direction.double()
    a = float(p.pow(2).sum())
    if a == 0.0:
        return 0.0
    c0 = mean.double().unsqueeze(0) - h  # (K, D): mean - h_i
    b = c0 @ p  # (K,)
    c = c0.pow(2).sum(1) - limit**2
    disc = (b * b - a * c).clamp_min(0.0)
    roots = (-b + disc.sqrt()) / a
    return max(0.0, float(roots.min()))


def corrupt(cfg: AttackConfig, updates: Tree, reference: Tree | None, rows: Tensor, seed: int,
            round_idx: int, honest: Tensor | None = None) -> Tree:
    """The updates with rows ``rows`` (positions of the round's attackers) replaced by what they send.

    ``honest``: positions of the round's honest *valid* rows (what omniscient attackers see; default: every row
    not in ``rows``, which is right only when every row is valid)."""
    if cfg.kind in ("none", "labelflip") or rows.numel() == 0:
        return updates
    out = T.tmap(lambda x: x.clone(), updates)
    ref = reference if reference is not None else T.tmap(lambda x: torch.zeros_like(x[0]), updates)
    if cfg.kind in OMNISCIENT:
        n_rows = T.leaves(updates)[0].shape[0]
        if honest is None:
            honest = torch.tensor([i for i in range(n_rows) if i not in set(rows.tolist())], dtype=torch.long)
        seen = honest if honest.numel() else rows  # no honest row: the attackers' own honest updates
        mal = omniscient_deviation(cfg, _deviations(updates, ref), seen, int(honest.numel() + rows.numel()),
                                   int(rows.numel()))
        for dst, r, m in zip(T.leaves(out), T.leaves(ref), mal, strict=True):
            rr = rows.to(dst.device)
            new = (r.double().to(dst.device) + m).unsqueeze(0).expand(rr.numel(), *m.shape)
            dst.index_copy_(0, rr, new.to(dst.dtype))
        return out
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, round_idx, 14]).generate_state(1)[0]))
    strength = cfg.strength_or_default()
    assert strength is not None
    for dst, r in zip(T.leaves(out), T.leaves(ref), strict=True):
        rr = rows.to(dst.device)
        sel = dst.index_select(0, rr)
        base = r.unsqueeze(0).to(dst.dtype)
        if cfg.kind == "scale":
            new = base + strength * (sel - base)
        elif cfg.kind == "signflip":
            new = base - strength * (sel - base)
        else:  # gaussian
            noise = torch.randn(sel.shape, generator=gen, dtype=torch.float64).to(dst.device, dst.dtype)
            new = base + strength * noise
        dst.index_copy_(0, rr, new.to(dst.dtype))
    return out


def flip_labels(data: FederatedData, attackers: Tensor) -> FederatedData:
    """``data`` with the training labels of the seen clients ``attackers`` flipped ``y -> C - 1 - y``."""
    tr = data.seen.train
    y = tr.y.clone()
    for k in attackers.tolist():
        a, b = int(tr.offsets[k]), int(tr.offsets[k + 1])
        y[a:b] = data.num_classes - 1 - y[a:b]
    seen = dataclasses.replace(data.seen, train=dataclasses.replace(tr, y=y))
    return dataclasses.replace(data, seen=seen)


__all__ = ["DEFAULT_STRENGTH", "KINDS", "OMNISCIENT", "AttackConfig", "AttackKind", "alie_z", "corrupt",
           "flip_labels", "minmax_gamma", "omniscient_deviation"]
