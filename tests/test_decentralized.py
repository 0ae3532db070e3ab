import numpy as np
import pytest
import torch

from fedmtl import graph as G
from fedmtl import tree as T
from fedmtl.algorithms import DSGD, DFedEM, FedAvg, FedEM
from fedmtl.data.synthetic import fedem_synthetic
from fedmtl.graph import GraphError, Mixing

from .conftest import all_client_states, make_sim, run_rounds


@pytest.mark.parametrize("kind", ["complete", "ring", "erdos_renyi"])
@pytest.mark.parametrize("rule", ["metropolis", "max_degree"])
def test_mixing_matrices_are_doubly_stochastic_on_the_graph(kind, rule):
    g = G.build(kind, 9, 0.5, seed=3)
    adj = g.adjacency().toarray()
    assert g.is_connected() and np.array_equal(adj, adj.T) and adj.trace() == 0
    mixing = g.mixing(rule)
    w = mixing.dense().numpy()
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.allclose(w, w.T)
    assert (w >= -1e-12).all()
    off = ~np.eye(9, dtype=bool)
    assert np.all((w[off] > 0) == (adj[off] > 0))
    # averaging contracts disagreement: second-largest |eigenvalue| < 1 on a connected graph
    ev = np.sort(np.abs(np.linalg.eigvalsh(w)))
    assert ev[-1] == pytest.approx(1.0) and ev[-2] < 1 - 1e-6
    # the sparse gossip step is the product with W
    x = torch.randn(9, 3, 2, dtype=torch.float64)
    assert torch.allclose(mixing.mix(x), (mixing.dense() @ x.reshape(9, -1)).reshape(9, 3, 2))


def test_metropolis_on_complete_graph_is_uniform():
    assert torch.allclose(G.complete(5).mixing().dense(), torch.full((5, 5), 0.2, dtype=torch.float64))


def test_erdos_renyi_is_sparse_and_has_the_right_density():
    g = G.erdos_renyi(20_000, 5e-4, seed=1)  # 10^5 expected edges; a dense draw would need 3.2 GB
    assert g.is_connected()  # redrawn until connected (about one isolated node is expected in a draw of this size)
    assert abs(g.num_edges / (20_000 * 19_999 / 2 * 5e-4) - 1) < 0.02


def test_user_adjacency(tmp_path):
    a = G.ring(4).adjacency().toarray()
    np.savetxt(tmp_path / "a.txt", a)
    assert np.array_equal(G.from_file(tmp_path / "a.txt", 4).adjacency().toarray(), a)
    bad = np.zeros((4, 4))
    bad[0, 1] = bad[1, 0] = 1
    np.save(tmp_path / "b.npy", bad)
    with pytest.raises(GraphError, match="not connected"):
        G.from_file(tmp_path / "b.npy", 4)
    with pytest.raises(GraphError, match="must be 5 x 5"):
        G.from_file(tmp_path / "b.npy", 5)


@pytest.fixture(scope="module")
def equal_data():
    return fedem_synthetic(num_clients=8, dim=6, n_test=30, min_samples=64, max_samples=64, seed=4)


@pytest.mark.correctness(
    ("dfedem",), "complete graph with uniform mixing is FedEM",
    guards="mixing matrices that are not doubly stochastic",
)
def test_dfedem_complete_uniform_is_fedem(equal_data):
    ea, eb = make_sim(FedEM(num_components=2), equal_data), make_sim(DFedEM(num_components=2, topology="complete"),
                                                                     equal_data)
    sa, _ = run_rounds(ea, 4)
    run_rounds(eb, 4)
    ca, cb = all_client_states(ea), all_client_states(eb)
    for i in range(equal_data.num_clients):
        for x, y in zip(T.leaves(sa.server.components), T.leaves(T.take(cb.components, i)), strict=True):
            assert torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(ca.pi, cb.pi, atol=1e-5)


@pytest.mark.correctness(
    ("dsgd",), "complete graph with uniform mixing is FedAvg",
    guards="gossip that is not an average",
)
def test_dsgd_complete_is_fedavg(equal_data):
    sa, _ = run_rounds(make_sim(FedAvg(), equal_data), 3)
    sb, _ = run_rounds(make_sim(DSGD(topology="complete"), equal_data), 3)
    for x, y in zip(T.leaves(sa.server.params), T.leaves(sb.server.average), strict=True):
        assert torch.allclose(x, y, atol=1e-5)


def test_dsgd_ring_disagreement_is_smaller_with_gossip(equal_data):
    """Gossip keeps the clients' models close; without it (W = I) they drift apart."""
    sim = make_sim(DSGD(topology="ring"), equal_data)
    run_rounds(sim, 5)
    w = all_client_states(sim).params["weight"]
    spread_gossip = float((w - w.mean(0)).norm())
    sim2 = make_sim(DSGD(topology="ring"), equal_data)
    st2 = sim2.init_state()
    n = equal_data.num_clients
    no_gossip = Mixing(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), torch.ones(n))  # W = I
    st2.server = st2.server._replace(mixing=no_gossip)
    for _ in range(5):
        sim2.round(st2)
    w2 = all_client_states(sim2).params["weight"]
    assert spread_gossip < 0.5 * float((w2 - w2.mean(0)).norm())
