"""Partitioners: pure functions from labels (or group ids) to per-client index arrays, for built-in datasets and
for your own arrays.

Every partitioner returns ``list[np.ndarray]`` of disjoint, sorted example indices, one array per client, and draws
its randomness only from the ``rng`` it is given: an ``np.random.Generator``, or an int seed (the same seed gives the
same split).  With your own arrays::

    from fedmtl.data import partition
    parts = partition.dirichlet(y, num_clients=20, alpha=0.1, rng=0, min_size=10)   # label skew
    parts = partition.k_classes(y, num_clients=20, k=2, rng=0)                      # pathological: 2 classes each
    parts = partition.quantity_skew(len(y), num_clients=20, beta=0.5, rng=0)        # iid labels, skewed sizes
    train, test = partition.split_arrays(x, y, parts, test_frac=0.25, rng=0)       # per client, 75/25
    data = fedmtl.FederatedData.from_arrays(train, test)

* ``iid`` — shuffled, near-equal parts.
* ``dirichlet`` — label skew: per class, client shares ~ Dirichlet(alpha), redrawn until every client has
  ``min_size`` examples (Hsu, Qi, Brown 2019; the split most personalized-FL libraries call "dir").
* ``k_classes`` — pathological label skew: every client holds examples of exactly k classes (McMahan et al.
  2017's shards generalized; the split peer libraries call "pat").
* ``shards`` — McMahan et al.'s sorted-label shards.
* ``quantity_skew`` — every client's labels iid, its size ~ Dirichlet(beta) share of the data (Li, Diao, Chen,
  He, "Federated learning on non-IID data silos: an experimental study", ICDE 2022).
* ``label_groups_dirichlet`` (FedEM's split), ``class_fraction`` (Omni-Fedge's), ``natural`` (writers, roles).
* ``train_test_split`` / ``split_arrays`` — per-client random splits of the index arrays / of the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Partition = list[np.ndarray]
Seed = np.random.Generator | int


def _rng(rng: Seed) -> np.random.Generator:
    """A generator from a generator or an int seed (``np.random.default_rng``)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, bool) or not isinstance(rng, int | np.integer):
        raise TypeError(f"rng must be a numpy Generator or an int seed, got {type(rng).__name__}")
    return np.random.default_rng(int(rng))


def _check(num_clients: int, n: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"{n} examples cannot be split over {num_clients} clients")


def iid(num_examples: int, num_clients: int, rng: Seed) -> Partition:
    """Shuffle and cut into ``num_clients`` near-equal parts."""
    _check(num_clients, num_examples)
    rng = _rng(rng)
    return [np.sort(p) for p in np.array_split(rng.permutation(num_examples), num_clients)]


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: Seed, min_size: int = 1,
    max_tries: int = 1000,
) -> Partition:
    """Label skew: for each class, client shares ~ Dirichlet(alpha * 1); redrawn until every client
    has at least ``min_size`` examples (Hsu et al. 2019).  Smaller alpha = more skew."""
    labels = np.asarray(labels)
    _check(num_clients, labels.size)
    rng = _rng(rng)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(alpha * np.ones(num_clients))
            cuts = (np.cumsum(p) * idx.size).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(o) for o in out) >= min_size:
            return out
    raise ValueError(f"could not reach min_size={min_size} per client in {max_tries} draws; raise alpha")


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: Seed) -> Partition:
    """Pathological non-IID split (McMahan et al. 2017): sort by label, cut into
    ``num_clients * shards_per_client`` shards, give each client ``shards_per_client`` at random."""
    labels = np.asarray(labels)
    _check(num_clients * shards_per_client, labels.size)
    rng = _rng(rng)
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, num_clients * shards_per_client)
    assign = rng.permutation(len(pieces)).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in assign]


def label_groups_dirichlet(
    labels: np.ndarray, num_clients: int, num_groups: int, alpha: float, rng: Seed
) -> Partition:
    """FedEM-style split: shuffle the label set and cut it into ``num_groups`` groups of labels
    (sizes as equal as possible, e.g. 3, 3, 4 for 10 labels); each group's examples go to the
    clients in proportions ~ Dirichlet(alpha * 1) with multinomial counts.  ``num_groups = -1``
    makes every label its own group (the EMNIST setting)."""
    labels = np.asarray(labels)
    _check(num_clients, labels.size)
    rng = _rng(rng)
    classes = rng.permutation(np.unique(labels))
    g = classes.size if num_groups == -1 else num_groups
    if not 1 <= g <= classes.size:
        raise ValueError(f"num_groups must be in [1, {classes.size}] or -1, got {num_groups}")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for group in np.array_split(classes, g):
        idx = rng.permutation(np.flatnonzero(np.isin(labels, group)))
        p = rng.dirichlet(alpha * np.ones(num_clients))
        counts = rng.multinomial(idx.size, p)
        for k, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            parts[k].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def class_fraction(labels: np.ndarray, num_clients: int, high: float, rng: Seed) -> Partition:
    """Omni-Fedge non-IID split: cut the data into ``num_clients`` equal disjoint parts, then each
    client keeps a U(0, high) fraction of each class of its part (all classes stay present)."""
    labels = np.asarray(labels)
    rng = _rng(rng)
    out = []
    for part in iid(labels.size, num_clients, rng):
        keep = []
        for c in np.unique(labels[part]):
            idx = part[labels[part] == c]
            n = max(1, int(round(rng.uniform(0.0, high) * idx.size)))
            keep.append(rng.choice(idx, size=n, replace=False))
        out.append(np.sort(np.concatenate(keep)))
    return out


def natural(groups: np.ndarray) -> Partition:
    """One client per distinct group id (writers, speaking roles), in sorted group order."""
    groups = np.asarray(groups)
    uniq, inv = np.unique(groups, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    return np.split(order, np.cumsum(np.bincount(inv, minlength=uniq.size))[:-1])


def train_test_split(
    part: Partition, test_frac: float, rng: Seed, val_frac: float = 0.0
) -> tuple[Partition, Partition, Partition]:
    """Per-client random split of each index array into (train, val, test)."""
    if not 0 < test_frac < 1 or not 0 <= val_frac < 1 or test_frac + val_frac >= 1:
        raise ValueError(f"need 0 < test_frac, 0 <= val_frac, test_frac + val_frac < 1; got {test_frac}, {val_frac}")
    rng = _rng(rng)
    tr, va, te = [], [], []
    for idx in part:
        p = rng.permutation(idx)
        n_te = int(round(test_frac * p.size))
        n_va = int(round(val_frac * p.size))
        te.append(np.sort(p[:n_te]))
        va.append(np.sort(p[n_te : n_te + n_va]))
        tr.append(np.sort(p[n_te + n_va :]))
    return tr, va, te


def k_classes(labels: np.ndarray, num_clients: int, k: int, rng: Seed, min_size: int = 1) -> Partition:
    """Pathological label skew: every client holds examples of exactly ``k`` distinct classes.  The classes are
    dealt round-robin from a random permutation (client i gets classes ``perm[(i k + j) mod C]``, j < k), so every
    class is used as evenly as possible; each class's examples are then split among the clients holding it in
    random proportions (Dirichlet(1) shares), redrawn until every client has ``min_size`` examples."""
    labels = np.asarray(labels)
    _check(num_clients, labels.size)
    classes = np.unique(labels)
    if not 1 <= k <= classes.size:
        raise ValueError(f"k must be in [1, {classes.size}] (the classes present), got {k}")
    rng = _rng(rng)
    perm = rng.permutation(classes)
    holds = [[perm[(i * k + j) % classes.size] for j in range(k)] for i in range(num_clients)]  # k <= C: distinct
    holders = {c: [i for i in range(num_clients) if c in holds[i]] for c in classes}
    for _ in range(1000):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        empty = False
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            who = holders[c]
            if not who:
                continue  # more classes than num_clients * k: a class nobody holds is left out
            share = rng.dirichlet(np.ones(len(who)))
            cuts = (np.cumsum(share) * idx.size).astype(int)[:-1]
            for i, chunk in zip(who, np.split(idx, cuts), strict=True):
                parts[i].append(chunk)
                empty |= chunk.size == 0  # a client must hold examples of each of its k classes
        out = [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]
        if not empty and min(len(o) for o in out) >= min_size:
            return out
    raise ValueError(f"could not give every client {min_size} examples of its {k} classes in 1000 draws")


def quantity_skew(num_examples: int, num_clients: int, beta: float, rng: Seed, min_size: int = 1) -> Partition:
    """Quantity skew (Li et al., ICDE 2022): shuffle the examples iid and give client i a ~ Dirichlet(beta) share of
    them, redrawn until every client has ``min_size``.  Smaller beta = more unequal sizes; labels stay iid."""
    _check(num_clients, num_examples)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    rng = _rng(rng)
    for _ in range(1000):
        share = rng.dirichlet(beta * np.ones(num_clients))
        cuts = (np.cumsum(share) * num_examples).astype(int)[:-1]
        out = [np.sort(p) for p in np.split(rng.permutation(num_examples), cuts)]
        if min(len(o) for o in out) >= min_size:
            return out
    raise ValueError(f"could not reach min_size={min_size} per client in 1000 draws; raise beta")


def split_arrays(x: Any, y: Any, parts: Sequence[np.ndarray], test_frac: float, rng: Seed
                 ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """Per-client ``(x, y)`` pairs of ``parts`` split at random ``1 - test_frac`` / ``test_frac``: the ``train`` and
    ``test`` lists ``FederatedData.from_arrays`` takes."""
    tr, _, te = train_test_split(list(parts), test_frac, rng)
    return [(x[i], y[i]) for i in tr], [(x[i], y[i]) for i in te]
