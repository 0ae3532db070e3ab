"""Partitioners: pure functions from labels (or group ids) to per-client index arrays.

Every partitioner returns ``list[np.ndarray]`` of disjoint example indices, one array per client,
and draws its randomness only from the ``np.random.Generator`` it is given.
"""

from __future__ import annotations

import numpy as np

Partition = list[np.ndarray]


def _check(num_clients: int, n: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"{n} examples cannot be split over {num_clients} clients")


def iid(num_examples: int, num_clients: int, rng: np.random.Generator) -> Partition:
    """Shuffle and cut into ``num_clients`` near-equal parts."""
    _check(num_clients, num_examples)
    return [np.sort(p) for p in np.array_split(rng.permutation(num_examples), num_clients)]


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 1,
    max_tries: int = 1000,
) -> Partition:
    """Label skew: for each class, client shares ~ Dirichlet(alpha * 1); redrawn until every client
    has at least ``min_size`` examples (Hsu et al. 2019).  Smaller alpha = more skew."""
    labels = np.asarray(labels)
    _check(num_clients, labels.size)
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


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator) -> Partition:
    """Pathological non-IID split (McMahan et al. 2017): sort by label, cut into
    ``num_clients * shards_per_client`` shards, give each client ``shards_per_client`` at random."""
    labels = np.asarray(labels)
    _check(num_clients * shards_per_client, labels.size)
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, num_clients * shards_per_client)
    assign = rng.permutation(len(pieces)).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in assign]


def label_groups_dirichlet(
    labels: np.ndarray, num_clients: int, num_groups: int, alpha: float, rng: np.random.Generator
) -> Partition:
    """FedEM-style split: shuffle the label set and cut it into ``num_groups`` groups of labels
    (sizes as equal as possible, e.g. 3, 3, 4 for 10 labels); each group's examples go to the
    clients in proportions ~ Dirichlet(alpha * 1) with multinomial counts.  ``num_groups = -1``
    makes every label its own group (the EMNIST setting)."""
    labels = np.asarray(labels)
    _check(num_clients, labels.size)
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


def class_fraction(labels: np.ndarray, num_clients: int, high: float, rng: np.random.Generator) -> Partition:
    """Omni-Fedge non-IID split: cut the data into ``num_clients`` equal disjoint parts, then each
    client keeps a U(0, high) fraction of each class of its part (all classes stay present)."""
    labels = np.asarray(labels)
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
    part: Partition, test_frac: float, rng: np.random.Generator, val_frac: float = 0.0
) -> tuple[Partition, Partition, Partition]:
    """Per-client random split of each index array into (train, val, test)."""
    if not 0 < test_frac < 1 or not 0 <= val_frac < 1 or test_frac + val_frac >= 1:
        raise ValueError(f"need 0 < test_frac, 0 <= val_frac, test_frac + val_frac < 1; got {test_frac}, {val_frac}")
    tr, va, te = [], [], []
    for idx in part:
        p = rng.permutation(idx)
        n_te = int(round(test_frac * p.size))
        n_va = int(round(val_frac * p.size))
        te.append(np.sort(p[:n_te]))
        va.append(np.sort(p[n_te : n_te + n_va]))
        tr.append(np.sort(p[n_te + n_va :]))
    return tr, va, te
