"""User-level differential privacy (the ``[privacy]`` table): DP-FedAvg's Gaussian mechanism on client updates,
with a privacy accountant from Google's ``dp-accounting`` library.

Mechanism (McMahan, Ramage, Talwar, Zhang, "Learning differentially private recurrent language models", ICLR
2018, Algorithm 1 with the flat clip): every participating client's update is taken as a deviation from the
round's payload and clipped to L2 norm ``clip_norm`` (over all of it: FedEM's M components together); the server
adds Gaussian noise of standard deviation ``noise_multiplier * clip_norm`` to each coordinate of the *sum* of the
clipped deviations and divides by a fixed denominator: the expected number of participants ``q N`` with
``sampling = "poisson"`` (each client joins a round independently with probability q), the number sampled with
``sampling = "fixed"`` (a uniform subset of fixed size).  Clients count equally (no n_k weights: a weight would
change the sensitivity).  The neighbouring relation is user-level: adding or removing one client's whole data
(Poisson), replacing one client (fixed size).

Accounting: each round is a subsampled Gaussian mechanism (``PoissonSampledDpEvent`` /
``SampledWithoutReplacementDpEvent`` of ``GaussianDpEvent(noise_multiplier)``), composed over rounds by the RDP
accountant (``accountant = "rdp"``) or the PLD accountant (``"pld"``, Poisson sampling only); epsilon at
``delta`` is reported every round (``metrics.csv`` column ``epsilon``, ``summary.json`` key ``"epsilon"``).
With ``noise_multiplier = 0`` the updates are clipped and averaged without noise and epsilon is infinite.
``target_epsilon`` (> 0) calibrates ``noise_multiplier`` *before the run* so that all ``run.rounds`` rounds
spend at most that epsilon (the run then never stops early).

What it does not cover: state a client keeps to itself (FedEM's mixture weights, Ditto's or pFedMe's personal
models, APFL's local model) never leaves the client and costs no privacy; the *evaluation* the simulator reports
(per-client test accuracy) is a measurement, not a release, and is not privatized; dropped, straggling or
excluded clients are treated as having sent a zero deviation (the accounting holds for the sampling, which is
what an attacker observes least favourably).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from . import tree as T
from .tree import Tree


@dataclass(frozen=True)
class PrivacyConfig:
    """The ``[privacy]`` table (``clip_norm = 0``: no differential privacy)."""

    clip_norm: float = 0.0
    noise_multiplier: float = 0.0
    sampling: Literal["poisson", "fixed"] = "poisson"
    accountant: Literal["rdp", "pld"] = "rdp"
    delta: float = 1e-5
    target_epsilon: float = 0.0

    def __post_init__(self) -> None:
        for name in ("clip_norm", "noise_multiplier", "delta", "target_epsilon"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"privacy.{name} must be a finite number >= 0, got {v}")
        if self.sampling not in ("poisson", "fixed"):
            raise ValueError(f"privacy.sampling must be 'poisson' or 'fixed', got {self.sampling!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"privacy.accountant must be 'rdp' or 'pld', got {self.accountant!r}")
        if self.enabled:
            if not 0 < self.delta < 1:
                raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")
            if self.accountant == "pld" and self.sampling == "fixed":
                raise ValueError("privacy.accountant = 'pld' supports sampling = 'poisson' only (dp-accounting's "
                                 "PLD accountant has no sampling without replacement); use accountant = 'rdp'")
        elif self.noise_multiplier or self.target_epsilon:
            raise ValueError("privacy: noise_multiplier / target_epsilon need clip_norm > 0 (the sensitivity)")

    @property
    def enabled(self) -> bool:
        return self.clip_norm > 0


def _event(cfg: PrivacyConfig, sigma: float, num_clients: int, per_round: int, q: float) -> Any:
    import dp_accounting as dpa

    gauss = dpa.GaussianDpEvent(sigma)
    if cfg.sampling == "poisson":
        return dpa.PoissonSampledDpEvent(q, gauss)
    return dpa.SampledWithoutReplacementDpEvent(num_clients, per_round, gauss)


class _QuietFractionalOrders(logging.Filter):
    """dp-accounting logs a warning whenever its series for a fractional RDP order does not converge and drops
    that order from the minimum (the bound stays valid, only possibly looser); with Poisson rates near 0.2 and
    noise near 2 this happens for orders 1.1-1.4 on every composition, hundreds of lines per run.  Dropped here
    (only that message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


def _accountant(cfg: PrivacyConfig) -> Any:
    from dp_accounting import NeighboringRelation, pld, rdp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietFractionalOrders) for f in absl.filters):
        absl.addFilter(_QuietFractionalOrders())

    if cfg.accountant == "pld":
        return pld.PLDAccountant()
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE if cfg.sampling == "poisson" else NeighboringRelation.REPLACE_ONE
    return rdp.RdpAccountant(neighboring_relation=relation)


def epsilon(cfg: PrivacyConfig, sigma: float, rounds: int, num_clients: int, per_round: int, q: float) -> float:
    """Epsilon at ``cfg.delta`` after ``rounds`` rounds (the library's accountant)."""
    if rounds == 0:
        return 0.0
    if sigma == 0:
        return math.inf  # clipping without noise: no privacy
    import dp_accounting as dpa

    acc = _accountant(cfg)
    acc.compose(dpa.SelfComposedDpEvent(_event(cfg, sigma, num_clients, per_round, q), rounds))
    return float(acc.get_epsilon(cfg.delta))


def calibrate(cfg: PrivacyConfig, rounds: int, num_clients: int, per_round: int, q: float) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds spend at most ``cfg.target_epsilon``."""
    import dp_accounting as dpa

    def make_event(sigma: float) -> Any:
        return dpa.SelfComposedDpEvent(_event(cfg, sigma, num_clients, per_round, q), rounds)

    return float(dpa.calibrate_dp_mechanism(
        lambda: _accountant(cfg), make_event, cfg.target_epsilon, cfg.delta,
        dpa.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))


class Accountant:
    """Tracks epsilon round by round for one run.

    RDP: one round's RDP curve (over the library's orders) is computed once; after r rounds the curve is r times
    it (RDP composes additively, exactly what the library does for ``SelfComposedDpEvent``), converted to epsilon
    by the library's ``compute_epsilon``.  PLD: the library composes ``SelfComposedDpEvent(event, r)``."""

    def __init__(self, cfg: PrivacyConfig, sigma: float, num_clients: int, per_round: int, q: float):
        self.cfg, self.sigma = cfg, sigma
        self.event = _event(cfg, sigma, num_clients, per_round, q)
        self._rdp: Any = None  # (orders, one round's RDP)

    def epsilon_after(self, rounds: int) -> float:
        if rounds == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf  # clipping without noise: no privacy
        import dp_accounting as dpa

        if self.cfg.accountant == "pld":
            acc = _accountant(self.cfg)
            acc.compose(dpa.SelfComposedDpEvent(self.event, rounds))
            return float(acc.get_epsilon(self.cfg.delta))
        from dp_accounting.rdp import rdp_privacy_accountant as rdpa

        if self._rdp is None:
            acc = _accountant(self.cfg)
            acc.compose(self.event)
            self._rdp = (acc.orders, acc.rdp)
        orders, one = self._rdp
        return float(rdpa.compute_epsilon(orders, rounds * one, self.cfg.delta)[0])


def dp_combine(reference: Tree, clip_norm: float, sigma: float, denominator: float,
               generator: torch.Generator) -> Any:
    """A combiner (``ctx.combine``) for one round: ``reference + (sum of the valid rows' deviations + N(0,
    (sigma * clip_norm)^2)) / denominator``; the rows are already clipped (``robust.aggregators.clip_updates``)."""

    def combine(updates: Tree, weights: Tensor) -> Tree:
        ok = torch.nonzero(weights > 0).flatten()

        def one(u: Tensor, r: Tensor) -> Tensor:
            dev = (u.index_select(0, ok.to(u.device)) - r.unsqueeze(0)).double().sum(0)
            noise = torch.randn(dev.shape, generator=generator, dtype=torch.float64).to(dev.device)
            return (r.double() + (dev + sigma * clip_norm * noise) / denominator).to(u.dtype)

        return T.tmap(one, updates, reference)

    return combine


__all__ = ["Accountant", "PrivacyConfig", "calibrate", "dp_combine", "epsilon"]
