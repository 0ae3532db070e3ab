"""Which clients a round samples, and the per-round generators everything random in a round is drawn from.

Randomness comes only from the run's seed: round r draws from generators seeded with ``(seed, r, purpose)``, so a
resumed run repeats an uninterrupted one exactly.  Sampling costs O(clients sampled), not O(population)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..privacy import sampling_probability
from .spec import RunConfig


def round_generator(seed: int, round_idx: int, stream: int = 0) -> torch.Generator:
    """Generator for one round and one purpose, independent of everything that came before."""
    mixed = np.random.SeedSequence([seed, round_idx, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))


def sample_without_replacement(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """A uniform k-subset of range(n), sorted, in O(k) expected time for k <= n/2: the first k distinct values
    of i.i.d. uniform draws (a uniformly random subset by symmetry).  Larger k: a permutation prefix."""
    if 2 * k > n:
        return np.sort(rng.permutation(n)[:k])
    chosen = np.zeros(0, dtype=np.int64)
    while len(chosen) < k:
        draw = rng.integers(0, n, size=int(1.1 * (k - len(chosen))) + 16)
        pool = np.concatenate([chosen, draw])
        _, first = np.unique(pool, return_index=True)
        chosen = pool[np.sort(first)][:k]  # first occurrences, in draw order
    return np.sort(chosen)


def poisson_sample(cfg: RunConfig, num_clients: int, round_idx: int) -> Tensor:
    """Poisson sampling: every client joins round ``round_idx`` independently with probability q (``clients_per_round
    / N``, else ``sampling_rate``).  Drawn as a Binomial(N, q) count and a uniform subset of that size (the same
    distribution, in O(count))."""
    q = sampling_probability(cfg.sampling_rate, cfg.clients_per_round, num_clients)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, round_idx, 1]))
    k = int(rng.binomial(num_clients, q))
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    if k == num_clients:
        return torch.arange(num_clients)
    return torch.from_numpy(sample_without_replacement(rng, num_clients, k))


def clients_per_round(cfg: RunConfig, num_clients: int) -> int:
    """K, the clients a round samples: ``clients_per_round``, else ``round(sampling_rate * N)`` (at least 1)."""
    return min(cfg.clients_per_round or max(1, int(round(cfg.sampling_rate * num_clients))), num_clients)


def sample_clients(cfg: RunConfig, num_clients: int, round_idx: int) -> Tensor:
    """The clients of round ``round_idx`` (sorted ids): everyone, or a uniform sample without replacement of
    ``clients_per_round`` (else ``round(sampling_rate * num_clients)``) clients."""
    k = clients_per_round(cfg, num_clients)
    if k == num_clients:
        return torch.arange(num_clients)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, round_idx, 1]))
    return torch.from_numpy(sample_without_replacement(rng, num_clients, k))
