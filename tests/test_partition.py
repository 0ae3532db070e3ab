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
