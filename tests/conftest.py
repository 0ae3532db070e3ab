from __future__ import annotations

import pytest
import torch

from fedmtl.data.synthetic import fedem_synthetic
from fedmtl.model import build_model
from fedmtl.optim import SGD
from fedmtl.simulate import RunConfig, Simulator

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def small_data():
    """20 clients (16 seen, 4 unseen), d = 10, with validation splits."""
    return fedem_synthetic(num_clients=20, dim=10, n_test=40, max_samples=300, seed=3, unseen_frac=0.2, val_frac=0.2)


@pytest.fixture(scope="session")
def small_model():
    return build_model("linear", 10, 2)


def make_sim(alg, data, model=None, opt=None, **run):
    model = model or build_model("linear", data.feature_shape[0], data.num_classes)
    opt = opt or SGD(lr=0.1, momentum=0.9, weight_decay=5e-4, lr_milestones=(0.5, 0.75))
    defaults = dict(rounds=6, batch_size=32, seed=7)
    defaults.update(run)
    return Simulator(alg, model, data, opt, RunConfig(**defaults))


def run_rounds(sim, n):
    st = sim.init_state()
    rows = [sim.round(st) for _ in range(n)]
    return st, rows
