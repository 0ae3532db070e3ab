from __future__ import annotations

import os

import pytest
import torch

from fedmtl import tree as T
from fedmtl.models import build_model
from fedmtl.testing import all_client_states, run_rounds, simulator, toy_data

# one torch thread per xdist worker (make test runs one worker per core), else the run's THREADS
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else int(os.environ.get("OMP_NUM_THREADS", "2")))

__all__ = ["all_client_states", "make_sim", "run_rounds"]


@pytest.fixture(scope="session")
def small_data():
    """20 clients (16 seen, 4 unseen), d = 10, with validation splits."""
    return toy_data()


@pytest.fixture(scope="session")
def small_model():
    return build_model("linear", 10, 2)


@pytest.fixture(autouse=True)
def _no_run_figures(request):
    """A run inside a test draws no accuracy.png (a quarter of a second each, most of a small run's time), unless the
    test is marked ``figures``: the tests of the figures themselves, and those that check a run's files."""
    from fedmtl.runs.report import run_figures

    if request.node.get_closest_marker("figures") is not None:
        yield
        return
    with run_figures(False):
        yield


def make_sim(alg, data, model=None, opt=None, **run):
    """An in-process engine (``fedmtl.testing.simulator``): linear model, momentum SGD, 6 rounds of batch 32."""
    return simulator(alg, data, model, opt, **run)


def pytest_collection_modifyitems(items):
    """The contract items (one per algorithm and check) beyond the quick checks belong to the slow tier.  The slow
    tier runs first: with several workers (``make test``: pytest-xdist) the long tests start at once and the short
    ones fill the gaps, instead of one long test holding the end of the run."""
    from .test_contract import QUICK_CHECKS

    for item in items:
        if getattr(item, "originalname", "") == "test_every_registered_algorithm_keeps_the_contract" and \
                item.callspec.params["check"] not in QUICK_CHECKS:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order kept within a tier


def same_trees(a, b, atol=1e-6):
    """Every leaf of ``a`` within ``atol`` of ``b``'s (the same structure)."""
    for x, y in zip(T.leaves(a), T.leaves(b), strict=True):
        assert torch.allclose(x, y, atol=atol), (x - y).abs().max()
