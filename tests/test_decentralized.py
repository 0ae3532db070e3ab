import numpy as np
import pytest
import torch

from fedmtl import topology as G
from fedmtl import tree as T
from fedmtl.algorithms import DSGD, DFedEM, FedAvg, FedEM
from fedmtl.data.synthetic import fedem_synthetic

from .conftest import make_sim, run_rounds


@pytest.mark.parametrize("kind", ["complete", "ring", "erdos_renyi"])
@pytest.mark.parametrize("rule", ["metropolis", "max_degree"])
def test_mixing_matrices_are_doubly_stochastic_on_the_graph(kind, rule):
    adj = G.build_graph(kind, 9, 0.5, seed=3)
    assert G.is_connected(adj) and np.array_equal(adj, adj.T) and adj.trace() == 0
    w = G.mixing_matrix(adj, rule).numpy()
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.allclose(w, w.T)
    assert (w >= -1e-12).all()
    off = ~np.eye(9, dtype=bool)
    assert np.all((w[off] > 0) == (adj[off] > 0))
    # averaging contracts disagreement: second-largest |eigenvalue| < 1 on a connected graph
    ev = np.sort(np.abs(np.linalg.eigvalsh(w)))
    assert ev[-1] == pytest.approx(1.0) and ev[-2] < 1 - 1e-6


def test_metropolis_on_complete_graph_is_uniform():
    assert torch.allclose(G.mixing_matrix(G.complete(5)), torch.full((5, 5), 0.2, dtype=torch.float64))


def test_user_adjacency(tmp_path):
    a = G.ring(4)
    np.savetxt(tmp_path / "a.txt", a)
    assert np.array_equal(G.load_adjacency(tmp_path / "a.txt", 4), a)
    bad = np.zeros((4, 4))
    bad[0, 1] = bad[1, 0] = 1
    np.save(tmp_path / "b.npy", bad)
    with pytest.raises(ValueError, match="not connected"):
        G.load_adjacency(tmp_path / "b.npy", 4)
    with pytest.raises(ValueError, match="must be 5 x 5"):
        G.load_adjacency(tmp_path / "b.npy", 5)


@pytest.fixture(scope="module")
def equal_data():
    return fedem_synthetic(num_clients=8, dim=6, n_test=30, min_samples=64, max_samples=64, seed=4)


def test_dfedem_complete_uniform_is_fedem(equal_data):
    sa, _ = run_rounds(make_sim(FedEM(num_components=2), equal_data), 4)
    sb, _ = run_rounds(make_sim(DFedEM(num_components=2, topology="complete"), equal_data), 4)
    for i in range(equal_data.num_clients):
        for x, y in zip(T.leaves(sa.server["components"]), T.leaves(T.take(sb.clients["components"], i)), strict=True):
            assert torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(sa.clients["pi"], sb.clients["pi"], atol=1e-5)


def test_dsgd_complete_is_fedavg(equal_data):
    sa, _ = run_rounds(make_sim(FedAvg(), equal_data), 3)
    sb, _ = run_rounds(make_sim(DSGD(topology="complete"), equal_data), 3)
    for x, y in zip(T.leaves(sa.server["params"]), T.leaves(sb.server["average"]), strict=True):
        assert torch.allclose(x, y, atol=1e-5)


def test_dsgd_ring_disagreement_is_smaller_with_gossip(equal_data):
    """Gossip keeps the clients' models close; without it (W = I) they drift apart."""
    sim = make_sim(DSGD(topology="ring"), equal_data)
    st, _ = run_rounds(sim, 5)
    w = st.clients["params"]["weight"]
    spread_gossip = float((w - w.mean(0)).norm())
    sim2 = make_sim(DSGD(topology="ring"), equal_data)
    st2 = sim2.init_state()
    st2.server["W"] = torch.eye(equal_data.num_clients)
    for _ in range(5):
        sim2.round(st2)
    w2 = st2.clients["params"]["weight"]
    assert spread_gossip < 0.5 * float((w2 - w2.mean(0)).norm())
