"""Contract suite over every registered algorithm."""

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import ALGORITHMS
from fedmtl.evaluation import summarize

from .conftest import make_sim, run_rounds

NAMES = sorted(ALGORITHMS)


# hyper-parameters for the toy task where a default is tuned for other data (Per-FedAvg's beta = 0.001
# is the paper's MNIST value; with it 15 rounds barely move the loss)
TOY = {"perfedavg": {"beta": 0.05}, "clustered": {"warmup_rounds": 2}, "pfedme": {"personal_lr": 0.05}}


def _alg(name):
    return ALGORITHMS[name](**TOY.get(name, {}))


@pytest.mark.parametrize("name", NAMES)
def test_loop_and_vmap_runners_agree(name, small_data):
    results = {}
    for runner in ("vmap", "loop"):
        sim = make_sim(_alg(name), small_data, runner=runner, sampling_rate=0.5, local_epochs=2)
        st, rows = run_rounds(sim, 3)
        results[runner] = (st, rows, summarize(sim.evaluate(st)))
    (sa, ra, ea), (sb, rb, eb) = results["vmap"], results["loop"]
    leaves_a = T.leaves(sa.server) + T.leaves(sa.clients)
    for x, y in zip(leaves_a, T.leaves(sb.server) + T.leaves(sb.clients), strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-5)
    for a, b in zip(ra, rb, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    assert ea.keys() == eb.keys()
    for k in ea:
        assert ea[k] == pytest.approx(eb[k], abs=1e-5), k


@pytest.mark.parametrize("name", NAMES)
def test_vmap_chunking_and_bucketing_do_not_change_results(name, small_data):
    outs = []
    for extra in (dict(bucketing="none"), dict(bucketing="steps", chunk_size=3)):
        sim = make_sim(_alg(name), small_data, **extra)
        st, _ = run_rounds(sim, 2)
        outs.append(T.leaves(st.server) + T.leaves(st.clients))
    for x, y in zip(*outs, strict=True):
        assert torch.allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_not_mutated(name, small_data):
    sim = make_sim(_alg(name), small_data)
    st = sim.init_state()
    server0, clients0 = T.clone(st.server), T.clone(st.clients)
    payload = sim.alg.payload(st.server)
    p0 = T.clone(payload)
    x0 = sim.data.seen.train.x.clone()
    sim.round(st)
    for a, b in zip(T.leaves(payload), T.leaves(p0), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(sim.data.seen.train.x, x0)
    # the state object was replaced, the old tensors left intact
    st2 = sim.init_state()
    for a, b in zip(T.leaves(st2.server) + T.leaves(st2.clients), T.leaves(server0) + T.leaves(clients0), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_metrics(name, small_data):
    res = []
    for _ in range(2):
        sim = make_sim(_alg(name), small_data, sampling_rate=0.5)
        st, rows = run_rounds(sim, 2)
        res.append((rows, summarize(sim.evaluate(st))))
    assert res[0] == res[1]
    sim = make_sim(_alg(name), small_data, sampling_rate=0.5, seed=99)
    st, rows = run_rounds(sim, 2)
    assert rows != res[0][0]


@pytest.mark.parametrize("name", NAMES)
def test_loss_decreases_on_toy_task(name, small_data):
    rounds = 45 if name == "omnifedge" else 15  # Omni-Fedge makes one gradient query per round
    sim = make_sim(_alg(name), small_data, rounds=rounds)
    st = sim.init_state()
    before = summarize(sim.evaluate(st))["seen_train_loss"]
    for _ in range(rounds):
        sim.round(st)
    after = summarize(sim.evaluate(st))["seen_train_loss"]
    assert after < before - 0.05


@pytest.mark.parametrize("name", NAMES)
def test_nan_update_is_excluded_and_counted(name, small_data, caplog):
    """A client whose update is NaN never reaches the global model; it is counted and logged."""
    cls = ALGORITHMS[name]

    class Poisoned(cls):  # type: ignore[misc, valid-type]
        def client_update(self, ctx, payload, state, batches, lr):
            upd, new_state, loss = super().client_update(ctx, payload, state, batches, lr)
            bad = batches.n == float(small_data.seen.train.counts[0])
            def poison(t):
                return torch.where(bad, torch.full_like(t, float("nan")), t) if t.is_floating_point() else t

            return T.tmap(poison, upd), T.tmap(poison, new_state), torch.where(bad, loss * float("nan"), loss)

    sim = make_sim(Poisoned(), small_data)
    st = sim.init_state()
    with caplog.at_level("WARNING", logger="fedmtl"):
        rows = [sim.round(st) for _ in range(2)]
    assert all(r["excluded"] >= 1 for r in rows)
    assert st.counters["excluded_updates"] >= 2
    assert "NaN/Inf" in caplog.text
    for x in T.leaves(st.server) + T.leaves(st.clients):
        assert torch.isfinite(x).all()
    assert np.isfinite(summarize(sim.evaluate(st))["seen_test_loss"])
