from __future__ import annotations

import pytest
import torch

from fedmtl.models import build_model
from fedmtl.testing import all_client_states, run_rounds, simulator, toy_data

torch.set_num_threads(2)

__all__ = ["all_client_states", "make_sim", "run_rounds"]


@pytest.fixture(scope="session")
def small_data():
    """20 clients (16 seen, 4 unseen), d = 10, with validation splits."""
    return toy_data()


@pytest.fixture(scope="session")
def small_model():
    return build_model("linear", 10, 2)


def make_sim(alg, data, model=None, opt=None, **run):
    """An in-process engine (``fedmtl.testing.simulator``): linear model, momentum SGD, 6 rounds of batch 32."""
    return simulator(alg, data, model, opt, **run)


def pytest_collection_modifyitems(items):
    """The contract items (one per algorithm and check) beyond the quick checks belong to the slow tier."""
    from .test_contract import QUICK_CHECKS

    for item in items:
        if getattr(item, "originalname", "") == "test_every_registered_algorithm_keeps_the_contract" and \
                item.callspec.params["check"] not in QUICK_CHECKS:
            item.add_marker(pytest.mark.slow)
