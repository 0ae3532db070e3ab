"""FedPAC (Xu, Tong, Huang, ICLR 2023): the contract, the simplex QP solver against CVXPY and SciPy, the combination
weights on constructed cases (identical clients, a client unlike the others), the feature statistics h_i and V_i by
hand, the server's aggregation (excluded rows, absent clients, combined heads), the feature-aligned body step against
autograd of the written loss, the reduction to FedRep at lambda = 0 with every client keeping its own head, and the
personalization of label-permuted groups that FedAvg cannot serve."""

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms.base import ClientId, Context
from fedmtl.algorithms.fedavg import FedAvg
from fedmtl.algorithms.fedpac import (
    FedPAC,
    PACUpdate,
    combination_matrix,
    feature_statistics,
    simplex_qp,
)
from fedmtl.algorithms.fedrep import FedRep
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD

from .conftest import all_client_states, make_sim, run_rounds


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", 10, 2, hidden=(16,))


def test_refuses_a_model_without_a_head_and_privacy(small_model):
    with pytest.raises(ModelError, match="fedpac"):
        FedPAC().check_model(small_model)
    with pytest.raises(ValueError, match="privacy"):
        FedPAC().check_privacy()
    with pytest.raises(ValueError, match="lam"):
        FedPAC(lam=-1.0)


# ------------------------------------------------------------------------------------------------ the QP
def _random_psd(rng: np.random.Generator, k: int, definite: bool) -> np.ndarray:
    a = rng.normal(size=(k, int(rng.integers(1, 4))))
    return a @ a.T + (np.diag(rng.uniform(0.05, 1.0, k)) if definite else 0.0)


@pytest.mark.slow
@pytest.mark.correctness(
    ("fedpac",), "the combination-weight QP is solved exactly (against CVXPY and SciPy)",
    guards="an approximate or unconstrained solve of the weights (negative weights, weights not summing to one)",
)
def test_simplex_qp_matches_cvxpy_and_scipy():
    cp = pytest.importorskip("cvxpy")
    from scipy.optimize import minimize

    rng = np.random.default_rng(0)
    for trial in range(40):
        k = int(rng.integers(2, 8))
        definite = trial % 3 != 0  # every third matrix singular (rank < k): ties resolved, the optimum value agrees
        q = _random_psd(rng, k, definite)
        x = simplex_qp(torch.tensor(q), start=int(rng.integers(0, k))).numpy()
        assert abs(x.sum() - 1.0) < 1e-12 and (x >= 0).all()
        a = cp.Variable(k)
        prob = cp.Problem(cp.Minimize(cp.quad_form(a, cp.psd_wrap(q))), [cp.sum(a) == 1, a >= 0])
        prob.solve()
        ref = minimize(lambda z, q=q: z @ q @ z, np.full(k, 1.0 / k), jac=lambda z, q=q: 2 * q @ z, method="SLSQP",
                       bounds=[(0, None)] * k, constraints=[{"type": "eq", "fun": lambda z: z.sum() - 1.0}],
                       options={"ftol": 1e-15, "maxiter": 500})
        fx = float(x @ q @ x)
        assert fx <= prob.value + 1e-8 and fx <= ref.fun + 1e-10  # never worse than either solver
        if definite:  # a unique minimizer: the same weights
            assert np.abs(x - a.value).max() < 1e-4
            assert np.abs(x - ref.x).max() < 1e-5


def test_simplex_qp_by_hand():
    # diag(1, 4): alpha ~ 1/V = (4/5, 1/5); a vertex when the other coordinate only costs more
    x = simplex_qp(torch.tensor([[1.0, 0.0], [0.0, 4.0]]), start=1)
    assert torch.allclose(x, torch.tensor([0.8, 0.2], dtype=torch.float64), atol=1e-12)
    x = simplex_qp(torch.tensor([[1.0, 2.0], [2.0, 9.0]]), start=1)
    assert torch.equal(x, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert torch.equal(simplex_qp(torch.tensor([[3.0]])), torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.correctness(
    ("fedpac",), "combination weights: identical clients share uniformly (or by 1/V_j), an outlier keeps its own head",
    guards="a bias term or variance term with the wrong sign or scale, or weights from the wrong client's row",
)
def test_combination_weights_on_constructed_clients():
    alg = FedPAC()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 3, 5, generator=g).expand(4, 3, 5)
    # identical statistics: no bias to trade, the variance sum_j alpha_j^2 V is smallest at the uniform weights
    a = alg.combination_weights(h, torch.full((4,), 0.3))
    assert torch.allclose(a, torch.full((4, 4), 0.25, dtype=torch.float64), atol=1e-10)
    # the same means but different variances: alpha_j = (1 / V_j) / sum_l (1 / V_l) for every client
    v = torch.tensor([0.1, 0.2, 0.4, 0.8])
    want = (1 / v.double()) / (1 / v.double()).sum()
    assert torch.allclose(alg.combination_weights(h, v), want.expand(4, 4), atol=1e-10)
    # client 3's features are far from the others' (a bias of 100 against variances of 0.01): it keeps mostly its
    # own head, and the others give it (almost) no weight
    h2 = h.clone()
    h2[3] = h2[3] + 10.0
    a = alg.combination_weights(h2, torch.full((4,), 0.01))
    assert float(a[3, 3]) > 0.999
    assert float(a[:3, 3].max()) < 1e-3
    assert torch.allclose(a[:3, :3], torch.full((3, 3), 1 / 3, dtype=torch.float64), atol=1e-3)
    assert torch.allclose(a.sum(1), torch.ones(4, dtype=torch.float64), atol=1e-12)
    # the matrix is diag(V) + G_i with (G_i)_jl = <h_i - h_j, h_i - h_l>: its quadratic form at alpha is the objective
    q = combination_matrix(h2, torch.full((4,), 0.01))[1]
    al = a[1]
    comb = (al.reshape(4, 1, 1) * h2.double()).sum(0)
    assert torch.allclose(al @ q @ al, (al**2 * 0.01).sum() + ((h2[1].double() - comb) ** 2).sum(), atol=1e-10)


# ------------------------------------------------------------------------------------------------ statistics
def test_feature_statistics_by_hand(mlp):
    """h_i = [p(k) mu_k]_k and V_i = (sum_k p(k) tr E_k[z z^T] - sum_k p(k)^2 ||mu_k||^2) / n, written class by class
    (the authors' form), padding left out."""
    p = mlp.init(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 10, generator=g)
    y = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0, 1])
    mask = torch.tensor([1.0] * 8 + [0.0] * 2)
    h, v = feature_statistics(mlp, p, x, y, mask)
    z = mlp.features(p, x[:8])
    yy = y[:8]
    n = 8
    want_h, want_v = torch.zeros(2, z.shape[1]), 0.0
    for k in range(2):
        zk = z[yy == k]
        pk = len(zk) / n
        mu = zk.mean(0)
        want_h[k] = pk * mu
        want_v += pk * float(torch.trace(zk.T @ zk / len(zk))) - pk**2 * float((mu * mu).sum())
    assert torch.allclose(h, want_h, atol=1e-6)
    assert abs(float(v) - want_v / n) < 1e-6


# ------------------------------------------------------------------------------------------------ server
def _updates(alg, ctx, server, k, seed):
    g = torch.Generator().manual_seed(seed)
    head = T.tmap(lambda t: torch.randn(k, *t.shape[1:], generator=g), server.heads)
    body = T.tmap(lambda t: torch.randn(k, *t.shape, generator=g), server.body)
    c, d = server.protos.shape
    return PACUpdate(body, head, torch.randn(k, c, d, generator=g), torch.randint(0, 5, (k, c), generator=g).float(),
                     torch.randn(k, c, d, generator=g), torch.rand(k, generator=g) + 0.1)


def test_aggregate_combines_heads_and_ignores_excluded_rows(mlp):
    alg = FedPAC()
    ctx = Context(mlp, SGD(0.1), 6, 100.0)
    server = alg.init_server(ctx, mlp.init(0), 0)
    up = _updates(alg, ctx, server, 3, seed=1)
    clients = torch.tensor([4, 1, 2])
    # row 1 is excluded (weight 0) and holds NaN everywhere: the same server as without it
    poisoned = T.tmap(lambda t: t.clone(), up)
    for t in T.leaves(poisoned):
        t[1] = float("nan")
    w = torch.tensor([30.0, 0.0, 10.0])
    a = alg.aggregate(ctx, server, poisoned, w, clients)
    keep = torch.tensor([0, 2])
    b = alg.aggregate(ctx, server, T.take(up, keep), w[keep], clients[keep])
    for x, y in zip(T.leaves(a), T.leaves(b), strict=True):
        assert torch.equal(x, y)
    # the absent clients' rows and the excluded client's row are unchanged
    for name, t in a.heads.items():
        for i in (0, 1, 3, 5):
            assert torch.equal(t[i], server.heads[name][i])
    # the combined heads by hand: phi^_i = sum_j alpha_ij phi_j over the valid rows, alpha from their QPs
    alpha = alg.combination_weights(up.h[keep], up.v[keep])
    for name, t in a.heads.items():
        rows = up.head[name][keep].double()
        for r, cid in enumerate((4, 2)):
            assert torch.allclose(t[cid].double(), torch.tensordot(alpha[r], rows, dims=1), atol=1e-6)
    # the body: the counts-weighted mean; the centroids: counts-weighted per class
    for name, t in a.body.items():
        assert torch.allclose(t, 0.75 * up.body[name][0] + 0.25 * up.body[name][2], atol=1e-6)
    n = up.counts[keep]
    total = n.sum(0)
    has = total > 0
    mean = (n.unsqueeze(-1) * up.protos[keep]).sum(0) / total.clamp_min(1).unsqueeze(-1)
    assert torch.allclose(a.protos[has], mean[has], atol=1e-6)
    assert torch.equal(a.counts, torch.where(has, total, server.counts))
    # nobody valid: the server is kept as it is
    assert alg.aggregate(ctx, server, poisoned, torch.zeros(3), clients) is server


# ------------------------------------------------------------------------------------------------ client
def test_body_step_is_the_gradient_of_the_aligned_loss(mlp):
    """The body's step differentiates CE + lambda ||f(x) - c_y||^2 / d (``distance = "mean"``; "sum": without the
    1/d) over the real examples, the term only for classes with a global centroid; the head gets no gradient."""
    ctx = Context(mlp, SGD(0.1), 1, 1.0)
    p = mlp.init(0)
    body, head = mlp.split(p)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 10, generator=g), torch.tensor([0, 1, 1, 0, 1, 0])
    mask = torch.tensor([1.0, 1, 1, 1, 1, 0])
    protos, counts = torch.randn(2, 16, generator=g), torch.tensor([5.0, 0.0])  # class 1: no centroid yet
    for distance, scale in (("mean", 1 / 16), ("sum", 1.0)):
        alg = FedPAC(lam=2.0, distance=distance)
        grads, loss = alg.body_step(ctx, head, protos, counts)(body, x, y, mask, None)

        def written(b, scale=scale):
            z = mlp.features({**b, **head}, x)
            ce = mlp.nll(mlp.apply_head(head, z), y)
            reg = ((z - protos[y]) ** 2).sum(-1) * (y == 0).float() * scale
            return ((ce + 2.0 * reg) * mask).sum() / 5, (ce * mask).sum() / 5

        leaves = {k: v.clone().requires_grad_() for k, v in body.items()}
        total, ce = written(leaves)
        want = torch.autograd.grad(total, list(leaves.values()))
        assert set(grads) == set(body)
        for (k, _), gw in zip(leaves.items(), want, strict=True):
            assert torch.allclose(grads[k], gw, atol=1e-6)
        assert torch.allclose(loss, ce.detach(), atol=1e-6)  # the logged loss is the cross-entropy


class _OwnHeads(FedPAC):
    """Every client's combination weights fixed to its own head (alpha_i = e_i)."""

    def combination_weights(self, h, v):
        return torch.eye(h.shape[0], dtype=torch.float64)


@pytest.mark.correctness(
    ("fedpac",), "lambda = 0 with each client keeping its own head is FedRep (one head epoch first)",
    guards="the head and body phases in the wrong order or on the wrong steps, or the server averaging the heads",
)
def test_lambda_zero_with_own_heads_is_fedrep(small_data, mlp):
    """lambda = 0 and alpha_i = e_i: the head trains one epoch on the received body, then the body under it, the
    bodies are averaged and each head stays its client's -- FedRep with head_epochs = 1 (head_lr = optim.lr = 0.1, so
    both phases step at the round's rate).  Same bodies, heads and evaluation to rounding (the logged losses differ:
    FedPAC's averages both phases' steps, FedRep's the body's)."""
    rep = make_sim(FedRep(head_epochs=1), small_data, model=mlp, sampling_rate=0.5)
    sr, _ = run_rounds(rep, 2)
    pac = make_sim(_OwnHeads(lam=0.0, head_lr=0.1), small_data, model=mlp, sampling_rate=0.5)
    sp, _ = run_rounds(pac, 2)
    for k in sr.server.params:
        assert torch.allclose(sr.server.params[k], sp.server.body[k], atol=1e-6)
    heads = all_client_states(rep).head
    for k in heads:
        assert torch.allclose(heads[k], sp.server.heads[k], atol=1e-6)
    er, ep = summarize(rep.evaluate(sr, ("seen",))), summarize(pac.evaluate(sp, ("seen",)))
    for key in er:
        assert abs(er[key] - ep[key]) < 1e-5 or (np.isnan(er[key]) and np.isnan(ep[key])), key
    # and the real FedPAC's server does combine: some client's head is not its own any more
    full = make_sim(FedPAC(lam=0.0, head_lr=0.1), small_data, model=mlp, sampling_rate=0.5)
    sf, _ = run_rounds(full, 2)
    assert any(not torch.allclose(sf.server.heads[k], sp.server.heads[k], atol=1e-4) for k in heads)


def test_a_client_starts_its_round_from_its_combined_head(mlp):
    """The head phase starts from the client's row of the table: with no head epochs and lambda = 0 the body step
    runs under exactly that head, and the update's head is that row."""
    ctx = Context(mlp, SGD(0.1), 3, 30.0)
    alg = FedPAC(lam=0.0, head_epochs=0)
    server = alg.init_server(ctx, mlp.init(0), 0)
    g = torch.Generator().manual_seed(5)
    heads = T.tmap(lambda t: torch.randn(t.shape, generator=g), server.heads)
    server = server._replace(heads=heads)
    from fedmtl.optim import Batches

    x = torch.randn(2, 4, 10, generator=g)
    b = Batches(x, torch.randint(0, 2, (2, 4), generator=g), torch.ones(2, 4), torch.arange(8).reshape(2, 4),
                torch.tensor(8.0))
    upd, _, _ = alg.client_update(ctx, server, ClientId(torch.tensor(2)), b, 0.1)
    for k, v in upd.head.items():
        assert torch.equal(v, heads[k][2])
    ev = alg.personalize(ctx, server, ClientId(torch.tensor(1)), None, 0.1, True)
    for k in heads:
        assert torch.equal(ev[k], heads[k][1])


# ------------------------------------------------------------------------------------------------ behaviour
@pytest.mark.slow
def test_personalizes_label_permuted_groups():
    # two groups whose labels are permuted: one global model cannot serve both; FedPAC's heads combine within a group
    permuted = permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=4, n_train=120, n_test=100, seed=1)
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    opt = SGD(0.1, 0.9)
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=opt, rounds=20, batch_size=32)
    sf, _ = run_rounds(fed, 20)
    sim = make_sim(FedPAC(), permuted, model=mlp4, opt=opt, rounds=20, batch_size=32)
    st, _ = run_rounds(sim, 20)
    acc = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    assert acc > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.2
    # the QP's weights on the final body keep the groups apart: each client puts (almost) all its weight on its own
    # group, whose clients' feature statistics h_j match its own, and none on the permuted group
    body = st.server.body
    head = T.take(st.server.heads, 0)
    stats = [feature_statistics(mlp4, {**body, **head}, *permuted.seen.train.client(k),
                                torch.ones(len(permuted.seen.train.client(k)[1]))) for k in range(12)]
    alpha = FedPAC().combination_weights(torch.stack([h for h, _ in stats]), torch.stack([v for _, v in stats]))
    group = torch.as_tensor(permuted.meta["group"])
    same = group.unsqueeze(0) == group.unsqueeze(1)
    assert float((alpha * same).sum(1).min()) > 0.95
