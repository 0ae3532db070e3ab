"""Networked FL by GTV minimization: graphs, prox operators, the primal-dual solver against CVXPY."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from fedmtl.graph import Graph, GraphError, chain, knn, sbm
from fedmtl.networked.gtv import GTVConfig, NodeData, cvxpy_solution, dual_prox, solve

pytest.importorskip("cvxpy")


def toy(seed=0, sizes=(10, 10), p_in=0.6, p_out=0.1, frac=0.5, m=5, noise=0.1):
    rng = np.random.default_rng(seed)
    g = sbm(list(sizes), p_in, p_out, seed=seed + 1)
    wbar = np.where(g.clusters[:, None] == 0, [2.0, 2.0], [-2.0, 2.0])
    xs = [rng.normal(size=(m, 2)) for _ in range(g.num_nodes)]
    ys = [x @ wb + noise * rng.normal(size=m) for x, wb in zip(xs, wbar, strict=True)]
    lab = np.flatnonzero(rng.random(g.num_nodes) < frac)
    return g, xs, ys, lab, wbar


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["squared", "logistic"])
@pytest.mark.parametrize("penalty", ["tv", "l1", "squared"])
def test_matches_cvxpy(loss, penalty):
    g, xs, ys, lab, _ = toy()
    if loss == "logistic":
        ys = [np.sign(y) for y in ys]
    data = NodeData.from_lists(xs, ys, lab)
    cfg = GTVConfig(lam=0.5, penalty=penalty, loss=loss, iterations=6000, record_every=1)
    w_ref, _, _ = cvxpy_solution(g, data, cfg)
    res = solve(g, data, cfg, w_ref=w_ref)
    assert res.trace[-1]["rel_error"] < 1e-3
    residuals = [r["residual"] for r in res.trace]
    assert residuals[-1] < 1e-4 * residuals[0]
    obj = [r["objective"] for r in res.trace]
    assert obj[-1] <= min(obj) + 1e-6 * abs(obj[-1])  # the last iterate is (numerically) the best


@pytest.mark.slow
def test_two_node_closed_form():
    lam, a = 0.3, 1.0
    g = Graph.from_edges(2, [[0, 1]], [a])
    for y1, y2 in ((3.0, 0.0), (0.5, 0.2)):
        # L_i(w) = (w - y_i)^2 with x = 1: the closed form for 1/2 (w - y)^2 with lam' = lam / 2 per unit weight
        data = NodeData.from_lists([np.ones((1, 1))] * 2, [np.array([y1]), np.array([y2])], [0, 1])
        res = solve(g, data, GTVConfig(lam=lam, penalty="tv", iterations=5000))
        t = lam * a / 2
        if abs(y1 - y2) > 2 * t:
            expect = [y1 - t * np.sign(y1 - y2), y2 + t * np.sign(y1 - y2)]
        else:
            expect = [(y1 + y2) / 2] * 2
        assert np.allclose(res.w[:, 0], expect, atol=1e-6)


@pytest.mark.parametrize("penalty", ["tv", "l1", "squared"])
def test_dual_prox_matches_numeric_prox(penalty):
    import cvxpy as cp

    rng = np.random.default_rng(2)
    sigma = 0.5
    for _ in range(5):
        v, r = rng.normal(size=(1, 3)) * 2, np.array([rng.uniform(0.2, 2)])
        z = cp.Variable(3)
        fit = 0.5 * cp.sum_squares(z - v[0])
        if penalty == "tv":  # g = r ||.||_2  ->  g* = indicator of the ball of radius r
            prob = cp.Problem(cp.Minimize(fit), [cp.norm(z, 2) <= r[0]])
        elif penalty == "l1":
            prob = cp.Problem(cp.Minimize(fit), [cp.abs(z) <= r[0]])
        else:  # g = r ||.||^2  ->  g*(z) = ||z||^2 / (4 r)
            prob = cp.Problem(cp.Minimize(fit + sigma * cp.sum_squares(z) / (4 * r[0])))
        prob.solve(solver=cp.CLARABEL)
        ours = dual_prox(v, r, penalty, sigma)[0]
        assert np.allclose(ours, z.value, atol=1e-6)
    ref = dual_prox(np.ones((1, 2)), np.array([1.0]), "squared", 0.5, "reference")
    assert np.allclose(ref, 1 / (1 + 2 * 0.5 / 1.0))  # the reference code's (c = 1/4) scaling, kept as an option


def test_step_sizes_satisfy_preconditioning_condition():
    g, *_ = toy(3, (15, 15))
    D = g.incidence().toarray()
    tau = 1 / g.degree()
    M = np.sqrt(0.5) * D * np.sqrt(tau)[None, :]
    assert np.linalg.norm(M, 2) <= 1 + 1e-9


def test_lambda_zero_gives_local_least_squares():
    g, xs, ys, lab, _ = toy(4)
    data = NodeData.from_lists(xs, ys, lab)
    res = solve(g, data, GTVConfig(lam=0.0, iterations=3000))
    for i in lab:
        ls = np.linalg.lstsq(xs[i], ys[i], rcond=None)[0]
        assert np.allclose(res.w[i], ls, atol=1e-6)
    unl = np.setdiff1d(np.arange(g.num_nodes), lab)
    assert np.allclose(res.w[unl], 0)


@pytest.mark.slow
def test_huge_lambda_gives_one_pooled_model():
    g, xs, ys, lab, _ = toy(5, p_in=0.8, p_out=0.3)
    assert g.is_connected()
    data = NodeData.from_lists(xs, ys, lab)
    res = solve(g, data, GTVConfig(lam=1e3, penalty="tv", iterations=30000))
    pooled = np.linalg.lstsq(np.concatenate([xs[i] for i in lab]), np.concatenate([ys[i] for i in lab]),
                             rcond=None)[0]
    assert np.abs(res.w - pooled).max() < 1e-3


def test_unlabelled_nodes_take_their_cluster_weights():
    g, xs, ys, lab, wbar = toy(6, (40, 40), p_in=0.5, p_out=0.005, frac=0.3)
    data = NodeData.from_lists(xs, ys, lab)
    res = solve(g, data, GTVConfig(lam=0.05, penalty="tv", iterations=3000))
    unl = np.setdiff1d(np.arange(g.num_nodes), lab)
    err = np.linalg.norm(res.w[unl] - wbar[unl], axis=1)
    assert np.median(err) < 0.2
    pooled = np.linalg.lstsq(np.concatenate([xs[i] for i in lab]), np.concatenate([ys[i] for i in lab]),
                             rcond=None)[0]
    assert np.median(err) < 0.1 * np.median(np.linalg.norm(pooled - wbar[unl], axis=1))


@pytest.mark.slow
def test_message_counts_and_failures():
    g, xs, ys, lab, _ = toy(7)
    data = NodeData.from_lists(xs, ys, lab)
    res = solve(g, data, GTVConfig(lam=0.1, iterations=37))
    assert res.messages == 2 * g.num_edges * 37 and res.bytes == res.messages * 2 * 8
    flaky = solve(g, data, GTVConfig(lam=0.1, iterations=2000, edge_fail_prob=0.3, node_fail_prob=0.2))
    assert flaky.messages < 2 * g.num_edges * 2000
    exact = solve(g, data, GTVConfig(lam=0.1, iterations=4000))
    assert np.abs(flaky.w - exact.w).max() < 1e-2  # failures slow the method down but it still converges


@pytest.mark.slow
def test_stochastic_version_is_close():
    g, xs, ys, lab, wbar = toy(8, m=20)
    data = NodeData.from_lists(xs, ys, lab)
    exact = solve(g, data, GTVConfig(lam=0.2, iterations=3000))
    sto = solve(g, data, GTVConfig(lam=0.2, iterations=3000, batch_size=5, average=True))
    assert np.abs(sto.w_avg - exact.w).max() < 0.3
    assert np.abs(sto.w_avg - exact.w).max() > 1e-6  # it really is a different (noisy) run


def test_graph_builders_and_errors():
    a = np.array([[0, 2.0, 0], [2.0, 0, 1.0], [0, 1.0, 0]])
    g = Graph.from_adjacency(a)
    assert g.num_edges == 2 and np.allclose(g.adjacency().toarray(), a)
    assert Graph.from_adjacency(sp.csr_matrix(a)).num_edges == 2
    nx = pytest.importorskip("networkx")
    h = nx.path_graph(4)
    assert Graph.from_networkx(h).num_edges == 3
    c = chain((5, 5), 1.25, 0.25)
    assert c.num_edges == 9 and np.isclose(c.weights[4], 0.25)
    k = knn(np.random.default_rng(0).normal(size=(30, 2)), 4)
    assert k.num_edges >= 30 * 4 / 2 and k.degree().min() >= 4
    s = sbm([200, 300], 0.1, 0.01, seed=1)
    inside = s.clusters[s.edges[:, 0]] == s.clusters[s.edges[:, 1]]
    expect_in = 0.1 * (200 * 199 / 2 + 300 * 299 / 2)
    assert abs(inside.sum() - expect_in) < 5 * np.sqrt(expect_in)
    assert abs((~inside).sum() - 0.01 * 200 * 300) < 5 * np.sqrt(600)
    with pytest.raises(GraphError, match="symmetric"):
        Graph.from_adjacency(np.array([[0, 1.0], [0, 0]]))
    with pytest.raises(GraphError, match="self-loops"):
        Graph.from_edges(2, [[1, 1]])
    with pytest.raises(GraphError, match="duplicate"):
        Graph.from_edges(3, [[0, 1], [1, 0]])
    with pytest.raises(GraphError, match="weights"):
        Graph.from_edges(2, [[0, 1]], [-1.0])
    with pytest.raises(GraphError, match="logistic"):
        data = NodeData.from_lists([np.ones((1, 1))] * 2, [np.array([0.5]), np.array([1.0])], [0])
        solve(Graph.from_edges(2, [[0, 1]]), data, GTVConfig(loss="logistic"))


@pytest.mark.slow
def test_boundary_flow_is_the_largest_routable_rho():
    """By hand on a path, and against networkx's max flow (binary search on rho) on a random SBM."""
    import networkx as nx

    from fedmtl.graph import Graph, sbm
    from fedmtl.networked.flow import boundary_flow

    edges = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]])
    cl = np.array([0, 0, 0, 1, 1, 1])
    # cluster 0: the boundary edge (weight 1) enters at node 2, the labelled node 0 is two edges away
    assert np.allclose(boundary_flow(Graph(6, edges, np.array([3.0, 2.0, 1.0, 2.0, 3.0])), cl, np.array([0, 5])),
                       [2.0, 2.0])
    g2 = Graph(6, edges, np.array([1.0, 2.0, 1.0, 2.0, 3.0]))
    assert np.allclose(boundary_flow(g2, cl, np.array([0, 5])), [1.0, 2.0])  # the weakest edge on the way
    assert np.allclose(boundary_flow(g2, cl, np.array([5])), [0.0, 2.0])  # no labelled node: nothing routes
    g = sbm([30, 30], 0.2, 0.05, seed=4)
    assert g.clusters is not None
    lab = np.array([0, 1, 2, 30, 31])
    rho = boundary_flow(g, g.clusters, lab)

    def by_max_flow(c: int) -> float:
        h, b = nx.DiGraph(), {}
        for (i, j), w in zip(g.edges, g.weights, strict=True):
            if g.clusters[i] != g.clusters[j]:
                for u in (i, j):
                    if g.clusters[u] == c:
                        b[u] = b.get(u, 0.0) + w
            elif g.clusters[i] == c:
                h.add_edge(i, j, capacity=w)
                h.add_edge(j, i, capacity=w)
        for u in lab:
            if g.clusters[u] == c:
                h.add_edge(int(u), "t")  # no capacity: unbounded
        lo, hi = 0.0, 50.0
        for _ in range(40):
            mid = (lo + hi) / 2
            k = h.copy()
            for u, v in b.items():
                k.add_edge("s", u, capacity=mid * v)
            lo, hi = (mid, hi) if nx.maximum_flow_value(k, "s", "t") >= mid * sum(b.values()) - 1e-9 else (lo, mid)
        return lo

    assert np.allclose(rho, [by_max_flow(0), by_max_flow(1)], atol=1e-6)


@pytest.mark.slow
def test_networked_flow_reproduction_shows_the_recovery_threshold(tmp_path):
    """The scalar toy: with one labelled node per cluster the flow connectivity is far below 1 and TV minimization
    does not recover the clusters' signs; with twenty it is above 1 and every unlabelled sign is right."""
    from fedmtl.experiments.networked import flow

    s = flow(tmp_path, quick=True)
    assert s["S"] == [1, 3, 20]
    assert s["rho_mean"][0] < 0.5 < 1.0 < s["rho_mean"][-1]
    assert s["rho_mean"] == sorted(s["rho_mean"])
    assert s["sign_recovery_unlabelled"][0] < 0.9 and s["sign_recovery_unlabelled"][-1] > 0.99
    assert s["mse_unlabelled"][-1] < 0.1 * s["mse_unlabelled"][0]
    assert (tmp_path / "labelled.png").stat().st_size > 0
