"""The shared systems layer: stragglers, drops, never-responding nodes and the estimated clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import ALGORITHMS
from fedmtl.engine.systems import SystemsConfig, TimeModel, uniform
from fedmtl.models import build_model
from fedmtl.optim import SGD, Batches, local_sgd
from fedmtl.testing import all_client_states, simulator


def test_uniform_hash_is_uniform_and_independent():
    u = uniform(5, 2, 0, np.arange(200_000))
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002 and 0 <= u.min() and u.max() < 1
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01  # neighbouring ids
    assert abs(np.corrcoef(u, uniform(5, 3, 0, np.arange(200_000)))[0, 1]) < 0.01  # next round
    assert abs(np.corrcoef(u, uniform(5, 2, 1, np.arange(200_000)))[0, 1]) < 0.01  # other purpose
    assert np.array_equal(uniform(5, 2, 0, np.array([7, 3])), u[[7, 3]])


def test_draw_is_per_node_and_deterministic():
    sm = SystemsConfig(variability="high", drop_prob=0.3)
    a = sm.draw(5, 2, np.arange(10))
    b = sm.draw(5, 2, np.array([3, 7]))
    assert np.allclose(a.speed[[3, 7]], b.speed) and (a.dropped[[3, 7]] == b.dropped).all()
    many = sm.draw(5, 0, np.arange(4000))
    assert many.speed.min() >= 0.1 and many.speed.max() <= 1.0
    assert abs(many.speed.mean() - 0.55) < 0.02
    assert abs(many.dropped.mean() - 0.3) < 0.03
    assert not np.allclose(sm.draw(5, 3, np.arange(10)).speed, a.speed)


def test_steps_deadline_and_wait():
    sm = SystemsConfig(variability="low", never_respond=[1])
    d = sm.draw(0, 0, np.arange(3))
    budget = np.array([10, 10, 40])
    done = sm.steps(d, budget)
    assert done[1] == 0 and d.dropped[1]
    assert (done[[0, 2]] >= np.floor(0.9 * budget[[0, 2]])).all() and (done <= budget).all()
    assert sm.compute_time_steps(d, budget, done) == 40
    wait = SystemsConfig(variability="high", mode="wait")
    dw = wait.draw(0, 0, np.arange(3))
    assert (wait.steps(dw, budget) == budget).all()
    assert wait.compute_time_steps(dw, budget, budget) == pytest.approx(max(budget / dw.speed))


def test_time_model_presets():
    slow = TimeModel("3g").round_seconds(1e9, 4e6, 4e6)
    fast = TimeModel("wifi").round_seconds(1e9, 4e6, 4e6)
    assert slow > fast > 1.0  # 1 s of compute at 1 GFLOP/s plus the messages
    assert TimeModel("3g").round_seconds(0, 1e6, 0) == pytest.approx(0.15 + 8.0 + 0.15)
    assert TimeModel.paper("lte").round_seconds(800, 1e9, 1e9) == pytest.approx(900)
    with pytest.raises(ValueError, match="network"):
        TimeModel("5g")
    with pytest.raises(ValueError, match="drop_prob"):
        SystemsConfig(drop_prob=1.0)


def test_limit_runs_exactly_the_first_steps():
    torch.manual_seed(0)
    m = build_model("linear", 4, 2)
    w = m.init(0)
    x, y = torch.randn(5, 3, 4), torch.randint(0, 2, (5, 3))
    full = Batches(x, y, torch.ones(5, 3), torch.zeros(5, 3, dtype=torch.long), torch.tensor(15.0))
    cut = full._replace(limit=torch.tensor(2))
    first2 = Batches(x[:2], y[:2], torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.tensor(15.0))
    a, _ = local_sgd(m.value_and_grad, w, cut, 0.1, SGD(lr=0.1, momentum=0.5))
    b, _ = local_sgd(m.value_and_grad, w, first2, 0.1, SGD(lr=0.1, momentum=0.5))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-7)


def _sim(alg, data, systems, runner="vmap", **run):
    model = build_model("linear", data.feature_shape[0], data.num_classes)
    return simulator(alg, data, model, SGD(lr=0.05, momentum=0.9), rounds=4, batch_size=16, seed=3, runner=runner,
                     local_epochs=2, systems=systems, **run)


@pytest.mark.parametrize("name", ["fedavg", "fedem", "local", "pfedme", "apfl"])
def test_stragglers_loop_equals_vmap(small_data, name):
    kw = {"fedem": {"num_components": 2}, "pfedme": {"inner_steps": 2}}.get(name, {})
    sm = SystemsConfig(variability="high", drop_prob=0.2)
    outs = []
    for runner in ("vmap", "loop"):
        sim = _sim(ALGORITHMS[name](**kw), small_data, sm, runner)
        st = sim.init_state()
        rows = [sim.round(st) for _ in range(3)]
        outs.append((st, rows, all_client_states(sim)))
    (a, ra, ca), (b, rb, cb) = outs
    for x, y in zip(T.leaves(a.server) + T.leaves(ca), T.leaves(b.server) + T.leaves(cb), strict=True):
        assert torch.allclose(x, y, atol=1e-5)
    assert [r["dropped"] for r in ra] == [r["dropped"] for r in rb]
    assert sum(r["dropped"] for r in ra) > 0


def test_stragglers_change_training_and_never_respond_keeps_state(small_data):
    ideal = _sim(ALGORITHMS["local"](), small_data, SystemsConfig())
    slow = _sim(ALGORITHMS["local"](), small_data, SystemsConfig(variability="high", never_respond=[2]))
    s0 = ideal.init_state()
    s1 = slow.init_state()
    init = T.take(all_client_states(slow), torch.tensor([2]))
    for _ in range(3):
        ideal.round(s0)
        row = slow.round(s1)
    assert row["dropped"] == 1 and s1.counters["dropped_updates"] == 3
    c0, c1 = all_client_states(ideal), all_client_states(slow)
    for a, b in zip(T.leaves(T.take(c1, torch.tensor([2]))), T.leaves(init), strict=True):
        assert torch.equal(a, b)  # the never-responding node's model never moved
    assert not bool(slow.clients.store.written[2])  # ... and its row was never even written
    diff = [float((a - b).abs().max()) for a, b in zip(T.leaves(c0), T.leaves(c1), strict=True)]
    assert max(diff) > 1e-3
    # the ideal run is what the simulator did before the systems layer existed
    ref = _sim(ALGORITHMS["local"](), small_data, None)
    s2 = ref.init_state()
    for _ in range(3):
        ref.round(s2)
    for a, b in zip(T.leaves(c0), T.leaves(all_client_states(ref)), strict=True):
        assert torch.equal(a, b)


def test_estimated_time_grows_with_rounds_and_slower_networks(small_data):
    times = {}
    for net in ("wifi", "3g"):
        sim = _sim(ALGORITHMS["fedavg"](), small_data, SystemsConfig(network=net))
        st = sim.init_state()
        rows = [sim.round(st) for _ in range(3)]
        assert rows[0]["est_time_s"] < rows[1]["est_time_s"] < rows[2]["est_time_s"]
        times[net] = rows[-1]["est_time_s"]
    assert times["3g"] > 5 * times["wifi"]


def test_all_dropped_round_keeps_server(small_data):
    sim = _sim(ALGORITHMS["fedavg"](), small_data, SystemsConfig(never_respond=list(range(16))))
    st = sim.init_state()
    before = T.tmap(lambda v: v.clone(), st.server)
    row = sim.round(st)
    assert row["clients"] == 0 and row["dropped"] == 16 and st.round == 1
    for a, b in zip(T.leaves(st.server), T.leaves(before), strict=True):
        assert torch.equal(a, b)
