"""MOCHA: W-step against centralized solvers, sigma', the Omega-steps, drops, baselines."""

from __future__ import annotations

import numpy as np
import pytest

from fedmtl.data.federated import DataError
from fedmtl.engine.systems import SystemsConfig
from fedmtl.mtl import MochaConfig, MTLData, solve
from fedmtl.mtl.omega import (
    ClusterRelaxation,
    FixedOmega,
    GraphicalLasso,
    TaskCovariance,
    identity,
    mean_regularized,
    sigma_prime,
)
from fedmtl.mtl.problem import LOSSES, dual, dual_B, primal, w_of

cp = pytest.importorskip("cvxpy")


def tasks(seed=0, sizes=(30, 50, 40, 25), d=5):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=d)
    xs = [rng.normal(size=(n, d)) for n in sizes]
    ys = [np.sign(x @ (base + 0.5 * rng.normal(size=d)) + 0.3 * rng.normal(size=len(x))) for x in xs]
    return xs, ys, MTLData.from_tasks(xs, ys)


def cvx_solution(xs, ys, omega, lam, loss):
    m, d = len(xs), xs[0].shape[1]
    W = cp.Variable((m, d))
    terms = []
    for t in range(m):
        marg = cp.multiply(ys[t], xs[t] @ W[t])
        z = cp.pos(1 - marg)
        terms.append(cp.sum(z if loss == "hinge" else cp.square(z)) / len(ys[t]))
    L = np.linalg.cholesky(omega)
    obj = cp.sum(terms) + lam / 2 * cp.sum_squares(L.T @ W)
    prob = cp.Problem(cp.Minimize(obj))
    prob.solve(solver=cp.CLARABEL)
    return W.value, prob.value


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["hinge", "squared_hinge"])
@pytest.mark.parametrize("omega_kind", ["mean", "random"])
def test_w_step_matches_cvxpy(loss, omega_kind):
    xs, ys, data = tasks()
    m = data.m
    if omega_kind == "mean":
        omega = mean_regularized(m, 0.2).omega
    else:
        a = np.random.default_rng(1).normal(size=(m, m))
        omega = a @ a.T / m + 0.5 * np.eye(m)
    lam = 0.05
    W_ref, p_ref = cvx_solution(xs, ys, omega, lam, loss)
    res = solve(data, MochaConfig(lam=lam, loss=loss, inner=1500, local_frac=1.0, record_every=50), FixedOmega(omega))
    last = res.trace[-1]
    assert last["gap"] < 1e-4 and last["gap"] >= -1e-9
    assert abs(last["primal"] - p_ref) < 1e-4 * max(1.0, abs(p_ref))
    assert np.linalg.norm(res.W - W_ref) / np.linalg.norm(W_ref) < 1e-2
    gaps = [r["gap"] for r in res.trace]
    assert gaps[-1] < 1e-3 * gaps[0]


@pytest.mark.slow
def test_identity_coupling_is_independent_svms():
    from sklearn.svm import LinearSVC

    xs, ys, data = tasks(2)
    lam = 0.02
    res = solve(data, MochaConfig(lam=lam, inner=2000, local_frac=1.0), identity(data.m))
    for t in range(data.m):
        svc = LinearSVC(C=1 / (lam * len(ys[t])), loss="hinge", fit_intercept=False, tol=1e-10, max_iter=200000)
        svc.fit(xs[t], ys[t])
        assert np.allclose(res.W[t], svc.coef_[0], atol=1e-6)


def test_sigma_prime_satisfies_inequality_28():
    rng = np.random.default_rng(3)
    for _ in range(200):
        m = int(rng.integers(2, 7))
        a = rng.normal(size=(m, m))
        sigma = a @ a.T + 0.1 * np.eye(m)
        dB = rng.normal(size=(m, 4))
        lhs = np.sum(sigma * (dB @ dB.T))
        for per_task in (False, True):
            sp = sigma_prime(sigma, 1.0, per_task)
            rhs = np.sum(sp * np.diag(sigma) * (dB * dB).sum(1))
            assert lhs <= rhs + 1e-9


def test_sdca_coordinate_step_is_the_exact_maximiser():
    rng = np.random.default_rng(4)
    grid = np.linspace(0, 3, 300001)
    for name, loss in LOSSES.items():
        for _ in range(20):
            beta, margin, curv = rng.uniform(0, 1), rng.normal(), rng.uniform(0.05, 3)
            got = loss.coordinate(np.array([beta]), np.array([margin]), np.array([curv]))[0]
            g = grid[grid <= 1] if name == "hinge" else grid
            f = -loss.conj(g) - (g - beta) * margin - curv * (g - beta) ** 2 / 2
            assert abs(got - g[np.argmax(f)]) < 1e-4


def test_task_covariance_step_is_closed_form_minimiser():
    rng = np.random.default_rng(5)
    W = rng.normal(size=(4, 6))
    reg = TaskCovariance(eps=0.0)
    omega, sigma = reg.step(W, np.eye(4))
    A = W @ W.T
    best = np.trace(omega @ A)
    vals = np.linalg.eigvalsh(A)
    assert best == pytest.approx(np.sqrt(vals).sum() ** 2, rel=1e-8)
    assert np.trace(sigma) == pytest.approx(1.0) and np.allclose(sigma @ omega, np.eye(4), atol=1e-8)
    for _ in range(200):  # random feasible Sigma (PSD, trace 1) never does better
        b = rng.normal(size=(4, 4))
        s = b @ b.T + 1e-3 * np.eye(4)
        s /= np.trace(s)
        assert np.trace(np.linalg.solve(s, A)) >= best - 1e-9
    o2, _ = reg.step(3.0 * W, np.eye(4))
    assert np.allclose(o2, omega)  # invariant to W -> cW


def test_cluster_step_matches_cvxpy():
    rng = np.random.default_rng(6)
    W = rng.normal(size=(5, 3))
    reg = ClusterRelaxation(k=2, eta=0.5)
    M_ours = reg.solve_m(W)
    M = cp.Variable((5, 5), symmetric=True)
    A = W @ W.T
    Lc = np.linalg.cholesky(A + 1e-12 * np.eye(5))
    obj = cp.matrix_frac(Lc, reg.eta * np.eye(5) + M)
    cons = [M >> 0, np.eye(5) - M >> 0, cp.trace(M) == 2]
    p = cp.Problem(cp.Minimize(obj), cons)
    p.solve(solver=cp.CLARABEL)
    ours = np.trace(A @ np.linalg.inv(reg.eta * np.eye(5) + M_ours))
    assert ours == pytest.approx(p.value, rel=1e-4)
    assert np.trace(M_ours) == pytest.approx(2.0)
    ev = np.linalg.eigvalsh(M_ours)
    assert ev.min() > -1e-9 and ev.max() < 1 + 1e-9


def test_graphical_lasso_step_matches_cvxpy():
    """Eq. (15)'s Omega-step, min tr(Omega S) - log|Omega| + alpha ||Omega||_1 (whole matrix), S = W W^T / d."""
    rng = np.random.default_rng(11)
    W = rng.normal(size=(5, 8)) + rng.normal(size=(1, 8))  # correlated tasks
    reg = GraphicalLasso(alpha=0.2, ridge=0.3, tol=1e-9, max_iter=2000)
    omega, sigma = reg.step(W, np.eye(5))
    S = W @ W.T / 8
    K = cp.Variable((5, 5), PSD=True)
    p = cp.Problem(cp.Minimize(cp.trace(K @ S) - cp.log_det(K) + 0.2 * cp.sum(cp.abs(K))))
    p.solve(solver=cp.CLARABEL)
    ours = omega - 0.3 * np.eye(5)  # the ridge is the W-step's, outside the Omega-step
    f = lambda k: np.trace(k @ S) - np.linalg.slogdet(k)[1] + 0.2 * np.abs(k).sum()  # noqa: E731
    assert f(ours) == pytest.approx(p.value, abs=1e-6)
    assert np.allclose(ours, K.value, atol=1e-3)
    assert np.allclose(sigma @ omega, np.eye(5), atol=1e-8)


def test_graphical_lasso_finds_independent_task_groups():
    """Two groups of tasks with independent weights: the precision between the groups is exactly 0 (a sparse
    graph), within a group it is not, and a larger alpha is sparser."""
    rng = np.random.default_rng(12)
    d = 400
    z = rng.normal(size=(2, d))
    W = np.concatenate([z[0] + 0.5 * rng.normal(size=(3, d)), z[1] + 0.5 * rng.normal(size=(3, d))])
    omega, _ = GraphicalLasso(alpha=0.15).step(W, np.eye(6))
    cross = omega[:3, 3:]
    within = [omega[i, j] for g in (range(3), range(3, 6)) for i in g for j in g if i < j]
    assert np.abs(cross).max() < 1e-10 and min(np.abs(within)) > 0.2
    dense, _ = GraphicalLasso(alpha=1e-3).step(W, np.eye(6))
    heavy, _ = GraphicalLasso(alpha=2.0).step(W, np.eye(6))
    nnz = [int((np.abs(o - np.diag(np.diag(o))) > 1e-10).sum()) for o in (dense, omega, heavy)]
    assert nnz[0] >= nnz[1] >= nnz[2] and nnz[2] == 0
    with pytest.raises(ValueError, match="alpha > 0"):
        GraphicalLasso(alpha=0.0)


@pytest.mark.parametrize("reg", [TaskCovariance(), GraphicalLasso(alpha=0.05, ridge=0.1)], ids=["cov", "glasso"])
def test_final_omega_update_and_w_of_alpha(reg):
    """Algorithm 1 updates Omega after its last iteration (line 13) and returns W(alpha) for that Omega
    (line 15): with one outer iteration Omega is no longer the initial one, and W = Sigma B / lam."""
    xs, ys, data = tasks(13)
    lam = 0.05
    res = solve(data, MochaConfig(lam=lam, outer=1, inner=50, local_frac=1.0, record_every=10), reg)
    assert not np.allclose(res.omega, reg.init(data.m)[0])
    assert np.allclose(res.W, w_of(dual_B(data, res.beta), res.sigma, lam), atol=1e-12)
    last = res.trace[-1]
    assert last["round"] == 50 and [r["round"] for r in res.trace].count(50) == 1
    assert last["primal"] == pytest.approx(primal(data, res.W, res.omega, lam, LOSSES["hinge"]), rel=1e-12)
    assert last["gap"] >= -1e-9  # W(beta) and beta: still a primal-dual pair under the new Omega


@pytest.mark.slow
def test_drops_keep_dual_feasible_and_never_responding_node_stalls():
    xs, ys, data = tasks(7)
    lam = 0.05
    cfg = MochaConfig(lam=lam, inner=600, local_frac=1.0, record_every=100)
    drop = solve(data, cfg, identity(data.m), SystemsConfig(drop_prob=0.5))
    assert ((drop.beta >= -1e-12) & (drop.beta <= 1 + 1e-12)).all()
    assert all(r["gap"] >= -1e-9 for r in drop.trace)
    assert drop.trace[-1]["gap"] < 1e-4  # drops with p < 1 still converge
    never = solve(data, cfg, identity(data.m), SystemsConfig(never_respond=[1]))
    assert np.all(never.beta[1] == 0) and np.all(never.W[1] == 0)
    assert never.trace[-1]["gap"] > 1e-2  # ... but a node that never answers stops convergence


@pytest.mark.slow
def test_full_mocha_learns_omega_and_decreases_objective():
    rng = np.random.default_rng(8)
    d, centers = 6, rng.normal(size=(2, 6)) * 2
    xs, ys = [], []
    for t in range(6):
        w = centers[t % 2] + 0.1 * rng.normal(size=d)
        x = rng.normal(size=(30, d))
        xs.append(x)
        ys.append(np.sign(x @ w))
    data = MTLData.from_tasks(xs, ys)
    res = solve(data, MochaConfig(lam=0.01, outer=5, inner=200, local_frac=1.0, record_every=200), TaskCovariance())
    corr = res.sigma / np.sqrt(np.outer(np.diag(res.sigma), np.diag(res.sigma)))
    same = np.mean([corr[i, j] for i in range(6) for j in range(6) if i != j and i % 2 == j % 2])
    diff = np.mean([corr[i, j] for i in range(6) for j in range(6) if i % 2 != j % 2])
    assert same > diff + 0.3  # the learned task covariance recovers the two groups


@pytest.mark.slow
def test_baselines_approach_the_optimum():
    xs, ys, data = tasks(9)
    lam = 0.05
    ref = solve(data, MochaConfig(lam=lam, inner=1500, local_frac=1.0), identity(data.m))
    p_star = ref.trace[-1]["primal"]  # the reference optimum, solved once for the three methods
    for method in ("cocoa", "mbsdca", "mbsgd"):
        res = solve(data, MochaConfig(lam=lam, method=method, inner=400, scaling=5.0 if method == "mbsdca" else 1.0),
                    identity(data.m), p_star=p_star)
        sub = [r["subopt"] for r in res.trace]
        assert sub[-1] >= -1e-6 and sub[-1] < 0.2 * sub[0], (method, sub[0], sub[-1])


def test_bad_tasks_raise():
    with pytest.raises(DataError, match="labels"):
        MTLData.from_tasks([np.zeros((3, 2))], [np.array([0, 2, 1])])
    with pytest.raises(DataError, match="NaN"):
        MTLData.from_tasks([np.full((2, 2), np.nan)], [np.array([1, -1])])
    with pytest.raises(ValueError, match="method"):
        MochaConfig(method="admm")


def test_reference_w_update_equals_paper_for_fixed_omega():
    xs, ys, data = tasks(10)
    a = solve(data, MochaConfig(lam=0.05, inner=50), identity(data.m))
    b = solve(data, MochaConfig(lam=0.05, inner=50, reference_w_update=True), identity(data.m))
    assert np.allclose(a.W, b.W, atol=1e-10)
    p, dv = primal(data, a.W, np.eye(data.m), 0.05, LOSSES["hinge"]), dual(data, a.beta, np.eye(data.m), 0.05,
                                                                           LOSSES["hinge"])
    assert p >= dv - 1e-12


@pytest.mark.slow
def test_table1_mtl_beats_local_and_global_on_related_tasks():
    from fedmtl.experiments.mocha import synthetic_tasks, table1

    res = table1(synthetic_tasks(m=12, d=10, seed=1), splits=2, seed=0, rounds_scale=0.3, folds=3)
    assert set(res) >= {"global", "local", "mtl", "mtl_se", "mtl_lambdas"}
    assert res["mtl"] < res["local"] and res["mtl"] < res["global"]


def test_stored_table1_is_regenerated_from_the_stored_measurements():
    """benchmarks/results/mocha/table1.md is what ``table1_markdown`` makes of the stored summary.json and its
    re-measurements (the handbook includes that file, so the page and the file cannot disagree)."""
    from pathlib import Path

    from fedmtl.experiments.mocha import table1_markdown

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "mocha"
    assert (results / "table1.md").read_text() == table1_markdown(results)
    page = (Path(__file__).resolve().parents[1] / "docs" / "results" / "mocha.md").read_text()
    assert '--8<-- "benchmarks/results/mocha/table1.md"' in page


# ------------------------------------------------------------------ shared tasks (Remark 4)
def split_over_nodes(xs, ys, seed=0, per_task=(1, 2, 3)):
    """Each task's examples cut at random into 1-3 nodes: (node arrays, node -> task)."""
    rng = np.random.default_rng(seed)
    nx, ny, owner = [], [], []
    for t, (x, y) in enumerate(zip(xs, ys, strict=True)):
        k = per_task[t % len(per_task)]
        cuts = np.sort(rng.choice(np.arange(1, len(y)), k - 1, replace=False))
        for a, b in zip(np.split(x, cuts), np.split(y, cuts), strict=True):
            nx.append(a)
            ny.append(b)
            owner.append(t)
    return MTLData.from_tasks(nx, ny).shared(owner)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["hinge", "squared_hinge"])
def test_shared_tasks_solve_the_pooled_problem(loss):
    """Remark 4: a task's data on several nodes, their dB added into the task's b_t, reaches the optimum of the
    problem with each task's data pooled (CVXPY), with one W row per task and a nonnegative duality gap."""
    xs, ys, pooled = tasks(11)
    shared = split_over_nodes(xs, ys)
    assert shared.nodes == 7 and shared.m == pooled.m == 4
    assert (shared.task_counts == pooled.counts).all()
    a = np.random.default_rng(1).normal(size=(4, 4))
    omega, lam = a @ a.T / 4 + 0.5 * np.eye(4), 0.05
    W_ref, p_ref = cvx_solution(xs, ys, omega, lam, loss)
    res = solve(shared, MochaConfig(lam=lam, loss=loss, inner=2000, local_frac=1.0, record_every=100, tol=1e-7),
                FixedOmega(omega))
    assert res.W.shape == (4, 5) and res.beta.shape == (7, shared.X.shape[1])
    assert all(r["gap"] >= -1e-9 for r in res.trace)
    assert abs(res.trace[-1]["primal"] - p_ref) < 1e-5 * max(1.0, abs(p_ref))
    assert np.linalg.norm(res.W - W_ref) / np.linalg.norm(W_ref) < 1e-2


def test_shared_tasks_one_node_each_is_the_plain_problem_and_full_batches_agree():
    xs, ys, pooled = tasks(12)
    same = pooled.shared(np.arange(pooled.m))
    cfg = MochaConfig(lam=0.05, outer=2, inner=30, record_every=10)
    a, b = solve(pooled, cfg, TaskCovariance()), solve(same, cfg, TaskCovariance())
    assert np.array_equal(a.W, b.W) and np.array_equal(a.omega, b.omega)
    shared = split_over_nodes(xs, ys, seed=2)
    for method in ("mbsdca", "mbsgd"):  # every example in every round's batch: the same steps as pooled
        cfg = MochaConfig(lam=0.05, method=method, inner=40, local_frac=2.0, record_every=40)
        p, s = solve(pooled, cfg, identity(4)), solve(shared, cfg, identity(4))
        assert np.allclose(p.W, s.W, atol=1e-12), method
    full = solve(shared, MochaConfig(lam=0.05, outer=3, inner=50, record_every=50), TaskCovariance())
    assert full.omega.shape == (4, 4) and full.trace[-1]["primal"] < full.trace[0]["primal"]


def test_shared_task_map_is_checked():
    _, _, data = tasks(13)
    with pytest.raises(DataError, match="map each of the 4 nodes"):
        data.shared([0, 1])
    with pytest.raises(DataError, match="0..k-1"):
        data.shared([0, 2, 2, 0])


# ------------------------------------------------------------------ skewed data (Tables 3-4)
def test_skewed_sizes_have_the_papers_table3_shapes():
    from fedmtl.experiments.mocha_skewed import TABLE3, skewed_sizes

    for name, (m, _, lo, hi, std) in TABLE3.items():
        n = skewed_sizes(m, lo, hi, std)
        assert len(n) == m and n.min() == lo and n.max() == hi, name
        assert abs(n.std() - std) < 0.1, name
        assert np.median(n) < n.mean()  # most tasks small: a skewed profile
    with pytest.raises(ValueError, match="no size profile"):
        skewed_sizes(10, 5, 10, 100.0)  # at most (10 - 5) / 2


def test_spread_puts_every_example_on_one_node_of_its_task():
    from fedmtl.experiments.mocha_skewed import spread

    xs, ys, _ = tasks(14, sizes=(1, 2, 30, 9))
    (nx, ny), owner = spread((xs, ys), np.random.default_rng(0))
    assert len(nx) == len(owner) and all(len(y) >= 1 for y in ny)
    for t in range(4):
        got = np.concatenate([nx[j] for j in np.flatnonzero(owner == t)])
        assert np.array_equal(got, xs[t])
    assert np.bincount(owner).max() <= 3


@pytest.mark.slow
def test_table4_columns_on_a_small_skewed_federation():
    from fedmtl.experiments.mocha import synthetic_tasks
    from fedmtl.experiments.mocha_skewed import METHODS, orderings, skewed_sizes, table4

    sizes = np.random.default_rng(0).permutation(skewed_sizes(6, 3, 80, 27.0))
    res = table4(synthetic_tasks(m=6, d=5, seed=2, sizes=sizes), splits=2, rounds_scale=0.05, cv_scale=0.05)
    for k in METHODS:
        assert 0.0 <= res[k] <= 100.0 and len(res["per_split"][k]) == 2, k
    assert set(res["lambdas"]) == {"global", "local", "mtl"}
    assert set(orderings(res)) == {"mtl_below_local", "mtl_below_global", "shared_tasks_equal_mtl"}
