"""User-level differential privacy (the ``[privacy]`` table): DP-FedAvg's Gaussian mechanism on client updates,
with a privacy accountant from Google's ``dp-accounting`` library.

Mechanism (McMahan, Ramage, Talwar, Zhang, "Learning differentially private recurrent language models", ICLR
2018, Algorithm 1 with the flat clip): every participating client's update is taken as a deviation from the
round's payload and clipped to L2 norm ``clip_norm`` (over all of it: FedEM's M components together); the server
adds Gaussian noise of standard deviation ``noise_multiplier * clip_norm`` to each coordinate of the *sum* of the
clipped deviations and divides by a fixed denominator: the expected number of participants ``q N`` with
``sampling = "poisson"`` (each client joins a round independently with probability q, the true q: ``clients_per_round
/ N`` or ``sampling_rate``, never a rounded count), the sample size k with ``sampling = "fixed"`` (a uniform subset of
fixed size).  Clients count equally (no n_k weights: a weight would change the sensitivity).  The neighbouring
relation is user-level: adding or removing one client's whole data (Poisson), replacing one client (fixed size).
The mechanism is one step of the update pipeline, ``fedmtl.engine.steps.privacy.ClipAndNoise``; the noise is added
in one place, ``fedmtl.engine.steps.privacy.add_gaussian_noise``.

**Every round releases**: a round in which no client was sampled, or every sampled client dropped out or sent a
non-finite update, still releases the noised sum (of nothing), exactly the mechanism the accountant composes; such
clients count as having sent a zero deviation.

**The noise comes from the operating system's CSPRNG**: each round's Gaussian noise is drawn from a generator seeded
with 63 fresh bits of ``secrets`` (never derivable from ``run.seed``, which is public: it is in ``config.toml`` and
``summary.json``).  ``reproducible_noise = true`` draws it from ``(run.seed, round)`` instead, so that tests and
debugging can repeat a private run exactly; that is **insecure** (anyone who knows the seed can subtract the noise),
logged as a warning and recorded in ``summary.json`` (``"reproducible_noise": true``).  A run resumed with secure
noise continues correctly; only the noise of the rounds after the resume differs from an uninterrupted run.

Accounting: each round is a subsampled Gaussian mechanism (``PoissonSampledDpEvent`` /
``SampledWithoutReplacementDpEvent`` of ``GaussianDpEvent(noise_multiplier)``), composed over rounds by the RDP
accountant (``accountant = "rdp"``) or the PLD accountant (``"pld"``, Poisson sampling only); epsilon at
``delta`` is reported every round (``metrics.csv`` column ``epsilon``, ``summary.json`` key ``"epsilon"``), and the
composed events are written to the run directory (``privacy.json``).
With ``noise_multiplier = 0`` the updates are clipped and averaged without noise and epsilon is infinite.
``target_epsilon`` (> 0) calibrates ``noise_multiplier`` *before the run* so that all ``run.rounds`` rounds
spend at most that epsilon (the run then never stops early).

What it covers: everything the server releases (the model it broadcasts and returns, and every other server state
that reaches a client) is computed from the noised sum alone: ``fedmtl.testing.check_algorithm``'s
``private_release`` check trains every method with no noise and with a huge noise and fails if any server state is
the same in both, unless the method declares it public (``Algorithm.public_server_state``, with the reason).
Methods whose server needs more than the noised mean (Clustered FL's bipartition of raw updates, ...) refuse
``[privacy]`` with an error (``Algorithm.check_privacy``).

What it does not cover: state a client keeps to itself (FedEM's mixture weights, Ditto's or pFedMe's personal
models, APFL's local model) never leaves the client and costs no privacy; the *evaluation* the simulator reports
(per-client test accuracy) is a measurement, not a release, and is not privatized.  Floating-point Gaussian
sampling is not hardened against attacks on the noise's low-order bits (Mironov, CCS 2012).
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .schema import Annotated, Range, check_fields


@dataclass(frozen=True)
class PrivacyConfig:
    """The ``[privacy]`` table (``clip_norm = 0``: no differential privacy)."""

    #: each client's update deviation is clipped to this L2 norm (0 = no differential privacy)
    clip_norm: Annotated[float, Range(0)] = 0.0
    #: Gaussian noise std = noise_multiplier * clip_norm on the sum of the clipped deviations
    noise_multiplier: Annotated[float, Range(0, 1e6)] = 0.0
    #: poisson: each client joins a round with probability q; fixed: a uniform subset of fixed size
    sampling: Literal["poisson", "fixed"] = "poisson"
    #: rdp or pld (dp-accounting's accountants; pld with poisson sampling only)
    accountant: Literal["rdp", "pld"] = "rdp"
    #: the delta epsilon is reported at
    delta: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 1e-5
    #: > 0: calibrate noise_multiplier before the run to spend at most this epsilon over all rounds
    target_epsilon: Annotated[float, Range(0, 1e6)] = 0.0
    #: true: the noise is drawn from (run.seed, round), repeatable and INSECURE (anyone who knows the seed can
    #: subtract it); for tests and debugging only.  false: from the operating system's CSPRNG
    reproducible_noise: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "privacy")
        if self.enabled:
            if not 0 < self.delta < 1:
                raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")
            if self.accountant == "pld" and self.sampling == "fixed":
                raise ValueError("privacy.accountant = 'pld' supports sampling = 'poisson' only (dp-accounting's "
                                 "PLD accountant has no sampling without replacement); use accountant = 'rdp'")
        elif self.noise_multiplier or self.target_epsilon or self.reproducible_noise:
            raise ValueError("privacy: noise_multiplier / target_epsilon / reproducible_noise need clip_norm > 0 "
                             "(the sensitivity)")

    @property
    def enabled(self) -> bool:
        return self.clip_norm > 0


def _event(sampling: str, sigma: float, num_clients: int, per_round: int, q: float) -> Any:
    import dp_accounting as dpa

    gauss = dpa.GaussianDpEvent(sigma)
    if sampling == "poisson":
        return dpa.PoissonSampledDpEvent(q, gauss)
    return dpa.SampledWithoutReplacementDpEvent(num_clients, per_round, gauss)


class _QuietFractionalOrders(logging.Filter):
    """dp-accounting logs a warning whenever its series for a fractional RDP order does not converge and drops
    that order from the minimum (the bound stays valid, only possibly looser); with Poisson rates near 0.2 and
    noise near 2 this happens for orders 1.1-1.4 on every composition, hundreds of lines per run.  Dropped here
    (only that message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


def _accountant(accountant: str, sampling: str) -> Any:
    from dp_accounting import NeighboringRelation, pld, rdp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietFractionalOrders) for f in absl.filters):
        absl.addFilter(_QuietFractionalOrders())

    if accountant == "pld":
        return pld.PLDAccountant()
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson" else NeighboringRelation.REPLACE_ONE
    return rdp.RdpAccountant(neighboring_relation=relation)


def epsilon(cfg: PrivacyConfig, sigma: float, rounds: int, num_clients: int, per_round: int, q: float) -> float:
    """Epsilon at ``cfg.delta`` after ``rounds`` rounds (the library's accountant)."""
    if rounds == 0:
        return 0.0
    if sigma == 0:
        return math.inf  # clipping without noise: no privacy
    import dp_accounting as dpa

    acc = _accountant(cfg.accountant, cfg.sampling)
    acc.compose(dpa.SelfComposedDpEvent(_event(cfg.sampling, sigma, num_clients, per_round, q), rounds))
    return float(acc.get_epsilon(cfg.delta))


def calibrate(cfg: PrivacyConfig, rounds: int, num_clients: int, per_round: int, q: float) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds spend at most ``cfg.target_epsilon``."""
    import dp_accounting as dpa

    def make_event(sigma: float) -> Any:
        return dpa.SelfComposedDpEvent(_event(cfg.sampling, sigma, num_clients, per_round, q), rounds)

    return float(dpa.calibrate_dp_mechanism(
        lambda: _accountant(cfg.accountant, cfg.sampling), make_event, cfg.target_epsilon, cfg.delta,
        dpa.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))


@functools.lru_cache(maxsize=256)
def _one_round_rdp(sampling: str, sigma: float, num_clients: int, per_round: int,
                   q: float) -> tuple[tuple[Any, ...], tuple[float, ...]]:
    """One round's RDP curve (the library's orders, its values) for these settings: the same for every run that
    uses them (the seeds of a study, the trials of a sweep), so computed once per process."""
    acc = _accountant("rdp", sampling)
    acc.compose(_event(sampling, sigma, num_clients, per_round, q))
    return tuple(acc.orders), tuple(float(v) for v in acc.rdp)


class Accountant:
    """Tracks epsilon round by round for one run.

    RDP: one round's RDP curve (over the library's orders) is computed once; after r rounds the curve is r times
    it (RDP composes additively, exactly what the library does for ``SelfComposedDpEvent``), converted to epsilon
    by the library's ``compute_epsilon``.  PLD: the library composes ``SelfComposedDpEvent(event, r)``."""

    def __init__(self, cfg: PrivacyConfig, sigma: float, num_clients: int, per_round: int, q: float):
        self.cfg, self.sigma = cfg, sigma
        self.event = _event(cfg.sampling, sigma, num_clients, per_round, q)
        self._key = (cfg.sampling, float(sigma), int(num_clients), int(per_round), float(q))

    def epsilon_after(self, rounds: int) -> float:
        if rounds == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf  # clipping without noise: no privacy
        import dp_accounting as dpa

        if self.cfg.accountant == "pld":
            acc = _accountant(self.cfg.accountant, self.cfg.sampling)
            acc.compose(dpa.SelfComposedDpEvent(self.event, rounds))
            return float(acc.get_epsilon(self.cfg.delta))
        from dp_accounting.rdp import rdp_privacy_accountant as rdpa

        orders, one = _one_round_rdp(*self._key)
        return float(rdpa.compute_epsilon(orders, rounds * np.asarray(one), self.cfg.delta)[0])

    def record(self, rounds: int) -> dict[str, Any]:
        """What ``privacy.json`` holds: the accountant, the neighbouring relation, delta and the events composed
        over ``rounds`` rounds (run-length encoded: every round is the same event), with the epsilon they spend."""
        relation = "add_or_remove_one" if self.cfg.sampling == "poisson" else "replace_one"
        return {
            "accountant": self.cfg.accountant, "neighboring_relation": relation, "delta": self.cfg.delta,
            "noise_multiplier": self.sigma, "clip_norm": self.cfg.clip_norm, "sampling": self.cfg.sampling,
            "reproducible_noise": self.cfg.reproducible_noise,
            "events": [{"rounds": [1, rounds], "event": _as_dict(self.event.to_named_tuple())}] if rounds else [],
            "epsilon": self.epsilon_after(rounds),
        }


def _as_dict(nt: Any) -> Any:
    """dp-accounting's ``to_named_tuple()`` form of an event, as plain JSON data."""
    if hasattr(nt, "_asdict"):
        return {k: _as_dict(v) for k, v in nt._asdict().items() if k != "module_name"}
    return nt


def sampling_probability(sampling_rate: float, clients_per_round: int, num_clients: int) -> float:
    """q, the probability with which Poisson sampling includes each client in a round: ``clients_per_round / N``
    when given, else ``sampling_rate`` (the exact value: the accountant and the noise's denominator ``q N`` use it
    as it is, never a rounded count)."""
    return min(clients_per_round / num_clients, 1.0) if clients_per_round else sampling_rate


def secure_seed() -> int:
    """63 bits from the operating system's CSPRNG (``secrets``)."""
    return secrets.randbits(63)


def secure_generator(seed: int | None = None) -> torch.Generator:
    """A generator seeded with ``seed`` or, by default, 63 bits from the operating system's CSPRNG: its draws cannot
    be recomputed from anything the run records.  (A distributed run draws the seed on rank 0 and sends it to the
    other ranks, so that every rank adds the same noise: ``fedmtl.engine.distributed``.)"""
    return torch.Generator().manual_seed(secure_seed() if seed is None else seed)


__all__ = ["Accountant", "PrivacyConfig", "calibrate", "epsilon", "sampling_probability", "secure_generator",
           "secure_seed"]
