import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmtl.data import partition as P


def _check_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert allidx.size == n and np.unique(allidx).size == n


@settings(max_examples=25, deadline=None)
@given(n=st.integers(20, 400), k=st.integers(1, 20), seed=st.integers(0, 10_000))
def test_iid_disjoint_cover_balanced(n, k, seed):
    if n < k:
        return
    parts = P.iid(n, k, np.random.default_rng(seed))
    _check_disjoint_cover(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=20, deadline=None)
@given(k=st.integers(2, 12), alpha=st.floats(0.1, 10.0), seed=st.integers(0, 10_000))
def test_dirichlet_disjoint_cover_min_size(k, alpha, seed):
    labels = np.random.default_rng(seed).integers(0, 5, size=600)
    parts = P.dirichlet(labels, k, alpha, np.random.default_rng(seed), min_size=5)
    _check_disjoint_cover(parts, labels.size)
    assert min(len(p) for p in parts) >= 5


def _skew(parts, labels):
    """Mean total-variation distance between client label histograms and the global one."""
    glob = np.bincount(labels, minlength=10) / labels.size
    d = [0.5 * np.abs(np.bincount(labels[p], minlength=10) / max(len(p), 1) - glob).sum() for p in parts if len(p)]
    return float(np.mean(d))


def test_dirichlet_skew_grows_as_alpha_falls():
    labels = np.random.default_rng(0).integers(0, 10, size=5000)
    skews = [np.mean([_skew(P.dirichlet(labels, 20, a, np.random.default_rng(s)), labels) for s in range(3)])
             for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]


def test_shards_two_labels_per_client():
    labels = np.repeat(np.arange(10), 100)
    parts = P.shards(labels, 10, 2, np.random.default_rng(0))
    _check_disjoint_cover(parts, labels.size)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)


def test_label_groups_dirichlet_groups_and_cover():
    labels = np.random.default_rng(1).integers(0, 10, size=3000)
    parts = P.label_groups_dirichlet(labels, 15, 3, 0.4, np.random.default_rng(2))
    _check_disjoint_cover(parts, labels.size)
    with pytest.raises(ValueError):
        P.label_groups_dirichlet(labels, 15, 11, 0.4, np.random.default_rng(2))


def test_class_fraction_keeps_every_class():
    labels = np.repeat(np.arange(10), 200)
    parts = P.class_fraction(labels, 5, 0.5, np.random.default_rng(0))
    assert all(len(np.unique(labels[p])) == 10 for p in parts)
    assert sum(len(p) for p in parts) < 0.5 * labels.size + 50
    assert np.unique(np.concatenate(parts)).size == sum(len(p) for p in parts)


def test_natural_groups():
    groups = np.array(["b", "a", "b", "c", "a"])
    parts = P.natural(groups)
    assert [sorted(p.tolist()) for p in parts] == [[1, 4], [0, 2], [3]]


def test_train_test_split_disjoint():
    parts = P.iid(100, 4, np.random.default_rng(0))
    tr, va, te = P.train_test_split(parts, 0.2, np.random.default_rng(1), val_frac=0.2)
    for a, b, c, p in zip(tr, va, te, parts, strict=True):
        _check_disjoint_cover([a, b, c], len(p))
        assert set(np.concatenate([a, b, c])) == set(p)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 30), st.integers(1, 5), st.integers(0, 10**6))
def test_k_classes_gives_every_client_exactly_k_classes(clients, k, seed):
    labels = np.random.default_rng(seed).integers(0, 10, 3000)
    parts = P.k_classes(labels, clients, k, seed, min_size=1)
    cat = np.concatenate(parts)
    assert len(parts) == clients and cat.size == np.unique(cat).size  # disjoint
    assert all(np.unique(labels[p]).size == k for p in parts)
    if clients * k >= 10:  # every class dealt to someone: the split covers the data
        assert cat.size == labels.size
    assert all(np.array_equal(a, b) for a, b in zip(parts, P.k_classes(labels, clients, k, seed), strict=True))
    with pytest.raises(ValueError, match="k must be in"):
        P.k_classes(labels, clients, 11, seed)


@pytest.mark.slow
def test_quantity_skew_keeps_labels_iid_and_skews_sizes():
    labels = np.random.default_rng(1).integers(0, 10, 20000)
    parts = P.quantity_skew(labels.size, 20, beta=0.3, rng=3, min_size=20)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == labels.size and sizes.min() >= 20
    assert sizes.max() > 5 * np.median(sizes)  # skewed sizes...
    big = parts[int(np.argmax(sizes))]
    freq = np.bincount(labels[big], minlength=10) / big.size
    assert np.abs(freq - 0.1).max() < 0.03  # ...labels as in the whole data
    even = [len(p) for p in P.quantity_skew(labels.size, 20, beta=1000.0, rng=3)]
    assert max(even) < 1.2 * min(even)


def test_split_arrays_feeds_from_arrays_and_seeds_are_reproducible():
    import fedmtl

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(600, 4)).astype(np.float32), rng.integers(0, 3, 600)
    parts = P.dirichlet(y, 6, 0.5, rng=7, min_size=10)
    assert all(np.array_equal(a, b) for a, b in zip(parts, P.dirichlet(y, 6, 0.5, rng=7, min_size=10), strict=True))
    train, test = P.split_arrays(x, y, parts, test_frac=0.25, rng=7)
    data = fedmtl.FederatedData.from_arrays(train, test, num_classes=3)
    assert int(data.seen.train.counts.sum()) + int(data.seen.test.counts.sum()) == 600
    assert [len(t[1]) for t in test] == [round(0.25 * len(p)) for p in parts]
    with pytest.raises(TypeError, match="int seed"):
        P.iid(10, 2, rng="7")
