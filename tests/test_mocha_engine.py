"""MOCHA on the round engine (``fedmtl.algorithms.mocha``) against the float64 reference solver (``fedmtl.mtl``),
under systems heterogeneity, through checkpoints, and from the command line."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl import FederatedData
from fedmtl import tree as T
from fedmtl.algorithms import Mocha
from fedmtl.cli import main
from fedmtl.data.synthetic import related_task_arrays
from fedmtl.engine.systems import SystemsConfig
from fedmtl.models import build_model
from fedmtl.mtl import MochaConfig, MTLData, solve
from fedmtl.mtl.omega import GraphicalLasso, TaskCovariance, mean_regularized
from fedmtl.mtl.problem import LOSSES, dual, primal
from fedmtl.optim import SGD
from fedmtl.runs import checkpoint
from fedmtl.testing import all_client_states, run_rounds, simulator


@pytest.fixture(scope="module")
def tasks():
    """8 related tasks, features rounded to float32 so that both solvers see exactly the same numbers."""
    xs, ys = related_task_arrays(m=8, d=5, clusters=2, seed=3)
    xs = [x.astype(np.float32).astype(np.float64) for x in xs]
    empty = [(x[:0], np.zeros(0, dtype=np.int64)) for x in xs]
    fed = FederatedData.from_arrays([(x, (y > 0).astype(np.int64)) for x, y in zip(xs, ys, strict=True)], empty)
    return fed, MTLData.from_tasks(xs, ys)


def _engine(fed, rounds, **kw):
    alg = Mocha(**kw)
    model = build_model("linear", fed.feature_shape, 2, bias=False)
    return simulator(alg, fed, model, SGD(1.0), rounds=rounds, batch_size=1000, seed=0)


@pytest.mark.correctness(
    ("mocha",), "the engine's MOCHA reaches the float64 reference solver's objective",
    guards="a W-step or dual update that does not solve the MTL problem",
)
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["hinge", "squared_hinge"])
def test_engine_mocha_reaches_the_reference_objective_fixed_omega(tasks, loss):
    fed, data = tasks
    lam = 0.5
    reg = mean_regularized(data.m, 1.0)
    ref = solve(data, MochaConfig(lam=lam, loss=loss, inner=300, local_frac=1.0, seed=0), reg)
    eng = _engine(fed, 300, lam=lam, loss=loss, regularizer="mean", eta=1.0, local_frac=1.0)
    st, _ = run_rounds(eng, 300)
    omega = reg.init(data.m)[0]
    p_ref = primal(data, ref.W, omega, lam, LOSSES[loss])
    p_eng = primal(data, st.server.W.numpy(), omega, lam, LOSSES[loss])
    assert ref.trace[-1]["gap"] < 1e-10  # the reference converged
    assert abs(p_eng - p_ref) / abs(p_ref) < 1e-6
    # the engine's duals are the nodes' own: D(beta) from them closes the gap too
    beta = all_client_states(eng).beta.numpy()[:, : data.y.shape[1]]
    assert abs(p_eng - dual(data, beta, np.linalg.inv(omega), lam, LOSSES[loss])) < 1e-7 * abs(p_ref)


@pytest.mark.correctness(
    ("mocha",), "with a learned Omega, the engine equals the reference",
    guards="an Omega-step that is not the closed form",
)
@pytest.mark.slow
@pytest.mark.parametrize("regularizer", ["task_covariance", "graphical"])
def test_engine_mocha_with_learned_omega_matches_the_reference(tasks, regularizer):
    fed, data = tasks
    lam = 0.5
    reg = TaskCovariance() if regularizer == "task_covariance" else GraphicalLasso(alpha=0.1, ridge=0.1)
    ref = solve(data, MochaConfig(lam=lam, outer=3, inner=200, local_frac=1.0, seed=0), reg)
    eng = _engine(fed, 600, lam=lam, regularizer=regularizer, omega_every=200, local_frac=1.0, sparsity=0.1)
    st, _ = run_rounds(eng, 600)
    # the same three Omega-steps, the last after the last round (Algorithm 1, line 13)
    assert np.allclose(st.server.omega.numpy(), ref.omega, rtol=1e-5, atol=1e-8)
    short = _engine(fed, 30, lam=lam, regularizer=regularizer, omega_every=1000, sparsity=0.1)
    st_short, _ = run_rounds(short, 30)
    assert not np.allclose(st_short.server.omega.numpy(), reg.init(data.m)[0])  # also when rounds < omega_every
    p_ref = primal(data, ref.W, ref.omega, lam, LOSSES["hinge"])
    p_eng = primal(data, st.server.W.numpy(), st.server.omega.numpy(), lam, LOSSES["hinge"])
    assert abs(p_eng - p_ref) / abs(p_ref) < 1e-6


def test_engine_mocha_under_stragglers_and_drops_resumes_exactly(tasks):
    fed, _ = tasks
    systems = SystemsConfig(variability="high", drop_prob=0.3)

    def sim():
        return simulator(Mocha(lam=0.05, regularizer="task_covariance", omega_every=3),
                         fed, build_model("linear", fed.feature_shape, 2, bias=False), SGD(1.0), rounds=8,
                         batch_size=1000, seed=2, systems=systems)

    full = sim()
    st_full, rows = run_rounds(full, 8)
    assert sum(r["dropped"] for r in rows) > 0
    cut = sim()
    st = cut.init_state()
    for _ in range(4):
        cut.round(st)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(Path(tmp) / "c.pt", st, {}, cut.clients.state_dict())
        saved = checkpoint.load(Path(tmp) / "c.pt")
    again = sim()
    st2 = again.init_state(saved)
    for _ in range(4):
        again.round(st2)
    for a, b in zip(T.leaves(st2.server), T.leaves(st_full.server), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(T.leaves(all_client_states(again)), T.leaves(all_client_states(full)), strict=True):
        assert torch.equal(a, b)
    # a straggler does fewer SDCA steps than a full-speed node: fewer duals move
    fast = simulator(Mocha(lam=0.05), fed, build_model("linear", fed.feature_shape, 2, bias=False), SGD(1.0),
                     rounds=1, batch_size=1000, seed=2)
    slow = simulator(Mocha(lam=0.05), fed, build_model("linear", fed.feature_shape, 2, bias=False), SGD(1.0),
                     rounds=1, batch_size=1000, seed=2, systems=SystemsConfig(speed_low=0.1))
    run_rounds(fast, 1)
    run_rounds(slow, 1)
    moved_fast = int((all_client_states(fast).beta != 0).sum())
    moved_slow = int((all_client_states(slow).beta != 0).sum())
    assert moved_slow < moved_fast


@pytest.mark.slow
def test_fedmtl_run_mocha_config_with_systems_and_resume(tmp_path):
    cfg = Path(__file__).resolve().parents[1] / "configs" / "mocha" / "synthetic_systems.toml"
    out = tmp_path / "run"
    sets = ["--set", "run.rounds=6", "--set", "run.eval_every=3", "--set", "run.checkpoint_every=3",
            "--set", "algorithm.omega_every=3"]
    assert main(["run", str(cfg), "--out", str(out), "--no-progress", *sets]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["algorithm"] == "mocha" and s["dropped_updates"] > 0 and 0.5 < s["final"]["seen_test_acc_mean"] <= 1
    assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--resume", *sets]) == 0  # finished: as kept
    assert json.loads((out / "summary.json").read_text())["final"] == s["final"]
