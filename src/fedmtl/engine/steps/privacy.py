"""User-level differential privacy (the ``[privacy]`` table; DP-FedAvg, McMahan et al., ICLR 2018) as one step of the
update pipeline, read top to bottom:

1. ``ClipAndNoise.build`` reads ``[privacy]`` from the run's spec: ``noise_multiplier`` (or the one
   ``target_epsilon`` calibrates), ``clip_norm`` and the fixed denominator, and makes the run's accountant;
2. ``ClipAndNoise.__call__`` clips every update's deviation from the broadcast model to ``clip_norm`` and sets the
   round's combiner (``ctx.combine``, what the algorithm's ``aggregate`` calls) to ``ClipAndNoise.noised_mean``;
3. ``noised_mean`` sums the clipped deviations, adds the Gaussian noise (``add_gaussian_noise``, the one place it is
   added) and divides by the fixed denominator.

The noise is drawn from the operating system's CSPRNG (``privacy.reproducible_noise``: from the run's seed, for
tests only).  The mechanism, what it covers and the accounting: ``fedmtl.privacy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from ... import tree as T
from ...privacy import Accountant, PrivacyConfig, calibrate, sampling_probability, secure_generator, secure_seed
from ...robust.aggregators import clip_updates, reference_of
from ...tree import Tree, TreeT
from ..sampling import clients_per_round, round_generator
from .base import RoundInfo, Setting, Updates

log = logging.getLogger("fedmtl")

#: the stream of ``round_generator(seed, round, stream)`` of the insecure ``privacy.reproducible_noise``
NOISE_STREAM = 5


def add_gaussian_noise(total: Tensor, noise_multiplier: float, clip_norm: float, generator: torch.Generator) -> Tensor:
    """The Gaussian mechanism of user-level DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning differentially
    private recurrent language models", ICLR 2018, Algorithm 1 with the flat clip): ``total`` (float64), one leaf of
    the sum of the round's clipped deviations, plus N(0, sigma^2) on every coordinate, drawn from ``generator``.

    Sensitivity: every client's deviation is clipped to L2 norm ``clip_norm`` (over its whole update), so one
    client's contribution moves the sum by at most ``clip_norm``; the noise's standard deviation is
    ``sigma = noise_multiplier * clip_norm``, the multiplier the accountant composes (``fedmtl.privacy``)."""
    noise = torch.randn(total.shape, generator=generator, dtype=torch.float64).to(total.device)
    return total + noise_multiplier * clip_norm * noise


class ClipAndNoise:
    """Clip every update to ``clip_norm`` and combine the round by the noised mean; holds the run's accountant."""

    #: a round in which nobody trained still releases its noise (the accountant counts every round)
    releases_empty_rounds = True

    def __init__(self, cfg: PrivacyConfig, noise_multiplier: float, denominator: float, accountant: Accountant,
                 algorithm: str):
        self.cfg, self.noise_multiplier, self.denominator = cfg, noise_multiplier, denominator
        self.accountant, self.algorithm = accountant, algorithm
        #: where each round's noise seed comes from: the OS's CSPRNG (a distributed run: rank 0's, sent to every rank)
        self.secret: Callable[[], int] = secure_seed

    @classmethod
    def build(cls, s: Setting) -> ClipAndNoise | None:
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
        noise_multiplier = p.noise_multiplier
        if p.target_epsilon > 0:
            noise_multiplier = calibrate(p, run.rounds, n, k, q)
            log.info("privacy: noise multiplier %.4f spends epsilon %.3g at delta %.1e over %d rounds",
                     noise_multiplier, p.target_epsilon, p.delta, run.rounds)
        if p.reproducible_noise:
            log.warning("privacy.reproducible_noise = true: the DP noise is drawn from run.seed, so anyone who "
                        "knows the seed can remove it; the run's privacy guarantee does not hold")
        return cls(p, noise_multiplier, denominator, Accountant(p, noise_multiplier, n, k, q), s.algorithm.name)

    def __call__(self, u: Updates, info: RoundInfo) -> Updates:
        ref = reference_of(u.updates, info.payload)
        if ref is None:
            raise ValueError(f"[privacy]: {self.algorithm}'s client updates are not model-shaped like its payload; "
                             "user-level DP needs updates it can clip against the broadcast model")
        updates = clip_updates(u.updates, ref, u.weights, self.cfg.clip_norm)
        gen = round_generator(info.seed, info.round, NOISE_STREAM) if self.cfg.reproducible_noise \
            else secure_generator(self.secret())

        def combine(stacked: TreeT, weights: Tensor) -> TreeT:  # what the algorithm's aggregate calls
            return self.noised_mean(stacked, weights, ref, gen)

        return u._replace(updates=updates, ctx=u.ctx._replace(combine=combine, dp_denominator=self.denominator))

    def noised_mean(self, stacked: TreeT, weights: Tensor, reference: Tree, generator: torch.Generator) -> TreeT:
        """``reference + (sum of the valid rows' deviations + noise) / denominator``, leaf by leaf (the rows are
        already clipped; a row of weight 0 counts as a zero deviation)."""
        ok = torch.nonzero(weights > 0).flatten()

        def one(u: Tensor, r: Tensor) -> Tensor:
            total = (u.index_select(0, ok.to(u.device)) - r.unsqueeze(0)).double().sum(0)
            noised = add_gaussian_noise(total, self.noise_multiplier, self.cfg.clip_norm, generator)
            return (r.double() + noised / self.denominator).to(u.dtype)

        return T.tmap(one, stacked, reference)
