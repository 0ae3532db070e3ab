"""User-level differential privacy (the ``[privacy]`` table; DP-FedAvg, McMahan et al., ICLR 2018): every update's
deviation from the broadcast model is clipped to ``clip_norm`` and the updates are combined by a noised sum over a
fixed denominator (q N under Poisson sampling, the sample size under fixed sampling), the Gaussian noise drawn from
the operating system's CSPRNG.  Privacy is accounted with dp-accounting (``fedmtl.privacy``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...privacy import (
    Accountant,
    PrivacyConfig,
    calibrate,
    dp_combine,
    sampling_probability,
    secure_generator,
    secure_seed,
)
from ...robust.aggregators import clip_updates, reference_of
from ..sampling import clients_per_round, round_generator
from .base import RoundInfo, Setting, Updates

log = logging.getLogger("fedmtl")

#: the stream of ``round_generator(seed, round, stream)`` of the insecure ``privacy.reproducible_noise``
NOISE_STREAM = 5


class DPNoise:
    """Clip every update to ``clip_norm`` and combine by the noised mean; holds the run's accountant."""

    #: a round in which nobody trained still releases its noise (the accountant counts every round)
    releases_empty_rounds = True

    def __init__(self, cfg: PrivacyConfig, noise_multiplier: float, denominator: float, accountant: Accountant,
                 algorithm: str):
        self.cfg, self.noise_multiplier, self.denominator = cfg, noise_multiplier, denominator
        self.accountant, self.algorithm = accountant, algorithm
        #: where each round's noise seed comes from: the OS's CSPRNG (a distributed run: rank 0's, sent to every rank)
        self.secret: Callable[[], int] = secure_seed

    @classmethod
    def build(cls, s: Setting) -> DPNoise | None:
        p, run, robust = s.spec.privacy, s.spec.run, s.spec.robust
        if not p.enabled:
            return None
        s.algorithm.check_privacy()
        if robust.aggregator != "mean" or robust.bucketing > 1:
            raise ValueError(f"[privacy] combines the updates by its noised mean, whose noise is calibrated to that "
                             f"sum's sensitivity; robust.aggregator = {robust.aggregator!r} / robust.bucketing = "
                             f"{robust.bucketing} cannot replace it (robust.clip_norm can be used with [privacy])")
        n = s.num_clients
        k = clients_per_round(run, n)
        # the true inclusion probability (Poisson) or the sample size (fixed): what runs is what is accounted
        poisson = p.sampling == "poisson"
        q = sampling_probability(run.sampling_rate, run.clients_per_round, n) if poisson else k / n
        denominator = q * n if poisson else float(k)  # the expected participants, or the sample size
        sigma = p.noise_multiplier
        if p.target_epsilon > 0:
            sigma = calibrate(p, run.rounds, n, k, q)
            log.info("privacy: noise multiplier %.4f spends epsilon %.3g at delta %.1e over %d rounds",
                     sigma, p.target_epsilon, p.delta, run.rounds)
        if p.reproducible_noise:
            log.warning("privacy.reproducible_noise = true: the DP noise is drawn from run.seed, so anyone who "
                        "knows the seed can remove it; the run's privacy guarantee does not hold")
        return cls(p, sigma, denominator, Accountant(p, sigma, n, k, q), s.algorithm.name)

    def __call__(self, u: Updates, info: RoundInfo) -> Updates:
        ref = reference_of(u.updates, info.payload)
        if ref is None:
            raise ValueError(f"[privacy]: {self.algorithm}'s client updates are not model-shaped like its payload; "
                             "user-level DP needs updates it can clip against the broadcast model")
        updates = clip_updates(u.updates, ref, u.weights, self.cfg.clip_norm)
        gen = round_generator(info.seed, info.round, NOISE_STREAM) if self.cfg.reproducible_noise \
            else secure_generator(self.secret())
        combine = dp_combine(ref, self.cfg.clip_norm, self.noise_multiplier, self.denominator, gen)
        return u._replace(updates=updates, ctx=u.ctx._replace(combine=combine, dp_denominator=self.denominator))
