from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmtl import tree as T
from fedmtl.models import build_model
from fedmtl.testing import all_client_states, run_rounds, simulator, toy_data

# one torch thread per xdist worker (make test: tests/conftest.py and the Makefile), else the run's THREADS
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


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """What ``build(folder)`` returns, built once per test run into an empty folder (a session fixture's outputs).

    Under pytest-xdist (``make test``) the first worker that asks builds it into the run's shared temporary folder
    while the others wait on a lock, then every worker reads the same folder and gets the same value (the handbook,
    the tuning studies): a module fixture would be built again by every worker, and again each time a worker's next
    test comes from another module.  A build that fails fails every worker's tests with its error.
    The folder is shared: a test that writes works on a copy of it.  The value passes between workers as JSON
    (never pickled): ``build`` returns JSON values, the fixture turns them back into its objects."""
    import fcntl
    import json
    import shutil
    import traceback

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return json.loads(json.dumps(build(tmp_path_factory.mktemp(name))))  # the same values as under xdist
    shared = tmp_path_factory.getbasetemp().parent  # this run's folder, shared by its workers
    out, value, failed = shared / name, shared / f"{name}.json", shared / f"{name}.failed"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not value.exists() and not failed.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that died building left
            out.mkdir()
            try:
                result = build(out)
            except BaseException:
                failed.write_text(traceback.format_exc())
                raise
            value.write_text(json.dumps(result))
    if failed.exists():
        pytest.fail(f"building {name} failed (in another worker):\n{failed.read_text()}", pytrace=False)
    return json.loads(value.read_text())


def make_sim(alg, data, model=None, opt=None, **run):
    """An in-process engine (``fedmtl.testing.simulator``): linear model, momentum SGD, 6 rounds of batch 32."""
    return simulator(alg, data, model, opt, **run)


# the longest tests (a quarter of a minute or more on 2 busy cores), in the order ``make test`` starts them: it hands
# tests to its 3 workers one at a time in collection order (pytest-xdist ``--dist load``), so these start first and
# the short ones fill the gaps, instead of one long test holding the end of the run.  The ones that mostly wait (on
# Flower's and Ray's processes, timeouts, readiness polls: marked "waits") alternate with ones that compute, so that
# the two cores stay busy while they wait.  Only the order depends on this list.
LONGEST = (
    "test_flower.py::test_deployment_with_node_local_data_tls_node_authentication_and_secure_aggregation",  # waits
    "test_workflow.py::test_main_job_quick_reports_every_method_with_seed_spread",
    "test_workflow.py::test_bundled_config_and_quick_reproduction_from_any_folder",
    "test_flower.py::test_simulation_joins_a_running_ray_cluster",  # waits
    "test_distributed.py::test_resume_from_a_killed_rank_equals_the_uninterrupted_run",
    "test_bench.py::test_peers_workload_and_its_baselines_are_what_the_benchmark_says",
    "test_flower.py::test_interrupted_flower_run_resumes_exactly_from_node_state_files",  # waits
    "test_clientstack.py::test_run_compile_equals_the_eager_step",
    "test_mocha_engine.py::test_engine_mocha_with_learned_omega_matches_the_reference",
    "test_flower.py::test_flower_crashing_client_is_dropped_and_server_resumes",  # waits
    "test_api.py::test_cli_loads_plugins_with_import_and_entry_points",
    "test_distributed.py::test_several_seeds_are_refused_on_every_rank_before_anything_is_written",
    "test_mocha.py::test_table1_mtl_beats_local_and_global_on_related_tasks",
    "test_api.py::test_python_api_docs_page_runs_as_written",
    "test_workflow.py::test_logging_without_a_terminal_prints_plain_lines",  # waits
    "test_cli.py::test_resume_after_real_interruption_matches_uninterrupted",
    "test_docs.py::test_handbook_builds_strict_with_its_key_pages",
    "test_fuzz.py::test_schema_fuzz_runs_the_cheap_end_and_default_of_every_range",
    "test_fuzz.py::test_schema_fuzz_refuses_every_value_outside_a_declared_range",
    "test_distributed.py::test_two_ranks_equal_one_process",
    "test_mocha_engine.py::test_engine_mocha_reaches_the_reference_objective_fixed_omega",
    "test_bench_pfl.py::test_bench_pfl_writes_both_frameworks_side_by_side",
    "test_experiments.py::test_perfedavg_reproduction_quick",
)


def pytest_collection_modifyitems(items):
    """The contract items (one per algorithm and check) beyond the quick checks belong to the slow tier.  Order: the
    ``LONGEST`` tests, then the rest of the slow tier, then the others (file order kept within each)."""
    from .test_contract import QUICK_CHECKS

    rank = {name: i for i, name in enumerate(LONGEST)}
    for item in items:
        if getattr(item, "originalname", "") == "test_every_registered_algorithm_keeps_the_contract" and \
                item.callspec.params["check"] not in QUICK_CHECKS:
            item.add_marker(pytest.mark.slow)

    def order(item: pytest.Item) -> tuple[int, bool]:
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        return rank.get(name, len(LONGEST)), item.get_closest_marker("slow") is None

    items.sort(key=order)  # stable


def same_trees(a, b, atol=1e-6):
    """Every leaf of ``a`` within ``atol`` of ``b``'s (the same structure)."""
    for x, y in zip(T.leaves(a), T.leaves(b), strict=True):
        assert torch.allclose(x, y, atol=atol), (x - y).abs().max()
