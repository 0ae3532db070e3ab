"""The FedEM synthetic generator against the fact sheet's statistics (seed 12345, 300 clients)."""

import numpy as np
import pytest
import torch

from fedmtl.data.synthetic import fedem_synthetic


def assert_reference_statistics(d, legacy: bool, pos_rate: float) -> None:
    """The fact sheet's statistics of ``fedem_synthetic(legacy=legacy)`` (its defaults).  The legacy data's are
    asserted on the data ``fedmtl main --quick`` builds (tests/test_workflow.py), not built a second time here."""
    c = d.seen.train.counts
    # sizes drawn exactly as the reference generator: 67,758 training examples, median 93, 17 capped
    assert int(c.sum()) == 67_758
    assert int(c.median()) == 93 and int(c.min()) == 50 and int(c.max()) == 1000
    assert int((c == 1000).sum()) == 17
    assert d.seen.test.x.shape == (1_500_000, 150)
    # label balance: ~36.8% positive with the reference's index bug, ~49.9% without
    assert abs(float(d.seen.test.y.float().mean()) - pos_rate) < 0.004
    per_client = d.seen.test.y.view(300, 5000).float().mean(1)
    if legacy:
        assert 0.15 < float(per_client.min()) < 0.21 and 0.49 < float(per_client.max()) < 0.54


@pytest.mark.slow
def test_reference_statistics_of_the_correct_generator():
    assert_reference_statistics(fedem_synthetic(legacy=False), legacy=False, pos_rate=0.499)


def test_shuffle_matches_sklearn_draw():
    """The reference shuffles with sklearn.utils.shuffle on numpy's global RandomState; ours must
    consume the same draw, so the legacy data is the reference data."""
    from sklearn.utils import shuffle

    x = np.arange(50.0).reshape(25, 2)
    y = np.arange(25.0)
    xs, ys = shuffle(x, y, random_state=np.random.RandomState(9))
    rng = np.random.RandomState(9)
    perm = np.arange(25)
    rng.shuffle(perm)
    assert np.array_equal(xs, x[perm]) and np.array_equal(ys, y[perm])


def test_legacy_forces_zero_labels_and_correct_labels_follow_components():
    a = fedem_synthetic(num_clients=30, dim=20, n_test=200, seed=5, legacy=True)
    b = fedem_synthetic(num_clients=30, dim=20, n_test=200, seed=5, legacy=False)
    # same features (identical random stream), different labels
    assert torch.equal(a.seen.train.x, b.seen.train.x)
    assert a.seen.train.y.float().mean() < b.seen.train.y.float().mean() - 0.05
    # correct generator: each example's label is its own component's noisy linear rule
    theta = b.meta["theta"]
    z = np.concatenate(b.meta["latent"])
    x = b.seen.train.x.double().numpy()
    margin = np.einsum("nd,nd->n", x, theta[z])
    agree = ((margin > 0).astype(int) == b.seen.train.y.numpy()).mean()
    assert agree > 0.97  # disagreements only where the 0.1 noise flips small margins


def test_unseen_and_validation_splits():
    d = fedem_synthetic(num_clients=10, dim=5, n_test=20, seed=1, unseen_frac=0.3, val_frac=0.25)
    assert d.seen.num_clients == 7 and d.unseen is not None and d.unseen.num_clients == 3
    n_tr, n_va = d.seen.train.counts, d.seen.val.counts
    assert torch.all((n_va.float() - 0.25 * (n_tr + n_va).float()).abs() <= 0.5)
