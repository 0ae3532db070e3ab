"""Asynchronous federated learning on the systems clock (``[async]``: FedAsync, FedBuff;
``fedmtl.engine.asynchronous``): reductions to the synchronous methods, the staleness functions, the event order on
the clock, personalized methods, exact resumption, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import Ditto, FedAvg, FedEM, FedNova, FedRep
from fedmtl.engine.async_config import AsyncConfig
from fedmtl.engine.systems import SystemsConfig
from fedmtl.models import build_model
from fedmtl.optim import SGD
from fedmtl.runs import checkpoint

from .conftest import all_client_states, make_sim, run_rounds


def _same(a, b, atol=1e-6):
    for x, y in zip(T.leaves(a), T.leaves(b), strict=True):
        assert torch.allclose(x.double(), y.double(), atol=atol), float((x.double() - y.double()).abs().max())


def test_staleness_functions_are_the_papers():
    tau = np.array([0, 1, 3, 4, 5, 9])
    assert np.allclose(AsyncConfig(staleness="constant").weight(tau), 1.0)
    assert np.allclose(AsyncConfig(staleness="polynomial", staleness_a=0.5).weight(tau), 1 / np.sqrt(tau + 1))
    hinge = AsyncConfig(staleness="hinge", staleness_a=10.0, staleness_b=4).weight(tau)
    assert np.allclose(hinge, [1, 1, 1, 1, 1 / 11, 1 / 51])


@pytest.mark.correctness(
    ("fedbuff",), "a buffer of every client, all dispatched together, no staleness: the synchronous method (FedAvg, "
    "Ditto, FedEM)",
    guards="changes measured from the current model instead of the one the client was sent",
)
@pytest.mark.parametrize("alg", [FedAvg(), Ditto(lam=0.1), FedEM(num_components=2)], ids=["fedavg", "ditto", "fedem"])
def test_fedbuff_with_a_buffer_of_every_client_is_the_synchronous_method(small_data, alg):
    """Every client dispatched together, a buffer of all of them, s = 1, eta_g = 1: each server step is one
    synchronous round with full participation (the server state and every client's own state)."""
    n = small_data.seen.num_clients
    a = make_sim(alg, small_data, opt=SGD(0.1))
    sa, _ = run_rounds(a, 3)
    buff = AsyncConfig(mode="fedbuff", concurrency=n, buffer_size=n, staleness="constant")
    b = make_sim(alg, small_data, opt=SGD(0.1), asynchronous=buff)
    sb, rows = run_rounds(b, 3)
    _same(sa.server, sb.server, atol=1e-5)
    _same(all_client_states(a), all_client_states(b), atol=1e-5)
    assert [r["staleness_max"] for r in rows] == [0, 0, 0] and [r["clients"] for r in rows] == [n, n, n]


@pytest.mark.correctness(
    ("fedasync",), "each arrival mixed with weight alpha s(staleness): alpha times FedBuff's step with a buffer of "
    "one",
    guards="staleness counted in wall-clock time instead of server versions",
)
def test_fedasync_mixes_each_arrival_into_the_server_with_the_staleness_weight(small_data):
    """x <- (1 - alpha s) x + alpha s x_new, x_new the arriving client's model trained from the version it was sent.
    One client at a time (no staleness): FedAsync's step is alpha times the step of FedBuff with a buffer of one
    (whose server becomes x_new: the same client, drawn by the same seed, with the same batches)."""
    one = dict(concurrency=1, staleness="constant")
    a = make_sim(FedAvg(), small_data, opt=SGD(0.1), asynchronous=AsyncConfig(mode="fedasync", mixing=0.3, **one))
    sa = a.init_state()
    x0 = T.clone(sa.server.params)
    a.round(sa)
    b = make_sim(FedAvg(), small_data, opt=SGD(0.1), asynchronous=AsyncConfig(mode="fedbuff", buffer_size=1, **one))
    sb = b.init_state()
    b.round(sb)
    assert max(float((x - y).abs().max()) for x, y in zip(T.leaves(x0), T.leaves(sb.server.params), strict=True)) > 1e-3
    _same(sa.server.params, {k: 0.7 * x0[k] + 0.3 * sb.server.params[k] for k in x0}, atol=1e-6)
    # several clients at once: later arrivals are stale, and the clock runs forward
    cfg4 = AsyncConfig(mode="fedasync", concurrency=4, mixing=0.5, staleness="polynomial", staleness_a=1.0)
    _, rows = run_rounds(make_sim(FedAvg(), small_data, opt=SGD(0.1), asynchronous=cfg4,
                                  systems=SystemsConfig(variability="high")), 6)
    assert max(r["staleness_max"] for r in rows) >= 1
    times = [r["est_time_s"] for r in rows]
    assert times == sorted(times) and times[-1] > 0


def test_arrivals_follow_the_systems_clock(small_data):
    """Slow devices finish late: with high speed variability the server handles updates in the order of their
    simulated finishing times, and the clock never runs backwards."""
    sys = SystemsConfig(variability="high", drop_prob=0.2)
    cfg = AsyncConfig(mode="fedbuff", concurrency=8, buffer_size=3)
    e = make_sim(FedAvg(), small_data, opt=SGD(0.1), asynchronous=cfg, systems=sys)
    st, rows = run_rounds(e, 8)
    times = [r["est_time_s"] for r in rows]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert sum(r["dropped"] for r in rows) > 0
    assert all(r["clients"] == 3 for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 1
    # deterministic given the seed
    e2 = make_sim(FedAvg(), small_data, opt=SGD(0.1), asynchronous=cfg, systems=sys)
    st2, rows2 = run_rounds(e2, 8)
    _same(st.server, st2.server, atol=0)
    assert rows == rows2


@pytest.mark.slow
def test_fedbuff_learns_with_a_personalized_method(small_data):
    cfg = AsyncConfig(mode="fedbuff", concurrency=8, buffer_size=4)
    e = make_sim(FedRep(), small_data, model=build_model("mlp", 10, 2, hidden=(16,)), opt=SGD(0.1),
                 asynchronous=cfg, systems=SystemsConfig(variability="high"))
    st = e.init_state()
    acc0 = float(e.evaluate(st, ("seen",))["seen"]["test"]["acc"].mean())
    for _ in range(30):
        e.round(st)
    acc = float(e.evaluate(st, ("seen",))["seen"]["test"]["acc"].mean())
    assert acc > acc0 + 0.1, (acc0, acc)


@pytest.mark.correctness(
    ("fedasync", "fedbuff"), "a run resumed with clients in flight repeats the uninterrupted one",
    guards="in-flight updates lost at a restart",
)
def test_resumed_asynchronous_run_repeats_an_uninterrupted_one(small_data, tmp_path):
    cfg = AsyncConfig(mode="fedbuff", concurrency=8, buffer_size=3)
    sys = SystemsConfig(variability="high")
    full = make_sim(Ditto(lam=0.1), small_data, opt=SGD(0.1), asynchronous=cfg, systems=sys)
    sf, rows = run_rounds(full, 6)
    part = make_sim(Ditto(lam=0.1), small_data, opt=SGD(0.1), asynchronous=cfg, systems=sys)
    sp, _ = run_rounds(part, 3)
    assert len(sp.asynchronous) > 0  # clients in flight at the checkpoint
    checkpoint.save(tmp_path / "ck.pt", sp, {}, part.clients.state_dict())
    again = make_sim(Ditto(lam=0.1), small_data, opt=SGD(0.1), asynchronous=cfg, systems=sys)
    sr = again.init_state(checkpoint.load(tmp_path / "ck.pt"))
    rest = [again.round(sr) for _ in range(3)]
    _same(sf.server, sr.server, atol=0)
    _same(all_client_states(full), all_client_states(again), atol=0)
    assert rest == rows[3:]


def test_asynchronous_modes_refuse_what_they_do_not_run(small_data):
    with pytest.raises(ValueError, match="does not run asynchronously"):
        make_sim(FedNova(), small_data, asynchronous=AsyncConfig(mode="fedasync"))
    with pytest.raises(ValueError, match="buffer_size = 50 exceeds"):
        make_sim(FedAvg(), small_data, asynchronous=AsyncConfig(mode="fedbuff", buffer_size=50))
    with pytest.raises(ValueError, match="staleness"):
        AsyncConfig(staleness="linear")


def test_asynchronous_runs_with_several_seeds_equal_separate_runs(tmp_path):
    """``run.seeds`` batches synchronous replicas; asynchronous ones keep their own event order, so each seed's
    replica is the run with that seed alone."""
    import fedmtl

    cfg = {"data": {"name": "fedem_synthetic", "num_clients": 12, "dim": 5, "n_test": 20, "max_samples": 80},
           "model": {"name": "linear"}, "algorithm": {"name": "fedavg"},
           "async": {"mode": "fedbuff", "concurrency": 6, "buffer_size": 3},
           "systems": {"variability": "high"}, "optim": {"lr": 0.1},
           "run": {"rounds": 6, "batch_size": 16, "eval_every": 3, "checkpoint_every": 0, "runner": "vmap"}}
    both = fedmtl.run(cfg, seeds=[1, 2])
    for seed, rep in zip((1, 2), both.runs, strict=True):
        one = fedmtl.run({**cfg, "run": {**cfg["run"], "seed": seed}})
        assert rep.final == one.final
        assert [r["est_time_s"] for r in rep.history] == [r["est_time_s"] for r in one.history]
