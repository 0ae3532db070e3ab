"""Per-FedAvg, pFedMe, Clustered FL, Omni-Fedge, Ditto, APFL: reference checks and reductions."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from torch.func import grad, jvp

from fedmtl import tree as T
from fedmtl.algorithms import APFL, ClusteredFL, Ditto, FedAvg, FedProx, Local, PerFedAvg, PFedMe
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.omnifedge import solve_omega
from fedmtl.algorithms.pfedme import Theta
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.optim import SGD, Batches, local_sgd

from .conftest import all_client_states, make_sim, run_rounds


def _batches(n_steps=6, b=8, d=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_steps, b, d, generator=g, dtype=dtype)
    y = (torch.rand(n_steps, b, generator=g) > 0.5).long()
    return Batches(x, y, torch.ones(n_steps, b, dtype=dtype), torch.zeros(n_steps, b, dtype=torch.long),
                   torch.tensor(float(n_steps * b)))


def test_finite_difference_hvp_matches_autograd():
    m = build_model("mlp", 5, 2, hidden=(7,))
    ctx = Context(m, SGD(0.1), 1, 1.0)
    w = {k: v.double() for k, v in m.init(0).items()}
    v = {k: torch.randn_like(p) for k, p in w.items()}
    b = _batches(dtype=torch.float64)
    batch = (b.x[0], b.y[0], b.mask[0])
    fd = PerFedAvg.hvp_fd(ctx, w, v, batch, 1e-4)

    def g(p):
        return grad(lambda q: m.loss(q, *batch))(p)

    _, exact = jvp(g, (w,), (v,))
    num = sum(float(((fd[k] - exact[k]) ** 2).sum()) for k in w) ** 0.5
    den = sum(float((exact[k] ** 2).sum()) for k in w) ** 0.5
    assert num / den < 1e-4


@pytest.mark.correctness(
    ("perfedavg",), "alpha = 0 is SGD on the outer batches",
    guards="the inner step applied when alpha is zero; batches reused between the inner and outer step",
)
def test_perfedavg_alpha_zero_is_sgd_on_the_outer_batches():
    m = build_model("linear", 5, 2)
    ctx = Context(m, SGD(0.1), 1, 1.0)
    w = m.init(0)
    b = _batches(n_steps=6)
    fo, _, _ = PerFedAvg(alpha=0.0, beta=0.3, local_steps=4).client_update(ctx, w, (), b, 0.0)
    hf, _, _ = PerFedAvg(alpha=0.0, beta=0.3, local_steps=4, variant="hf").client_update(ctx, w, (), b, 0.0)
    # step t uses D' = batch t (cycling) of the second role's permutation: with 2 batches per role, batches 2, 3, 2, 3
    order = [2, 3, 2, 3]
    ref, _ = local_sgd(m.value_and_grad, w, Batches(b.x[order], b.y[order], b.mask[order], b.pos[order], b.n),
                       0.3, SGD(0.3))
    for k in w:
        assert torch.allclose(fo[k], ref[k], atol=1e-6) and torch.allclose(hf[k], ref[k], atol=1e-6)
    hf2, _, _ = PerFedAvg(alpha=0.05, beta=0.3, local_steps=4, variant="hf").client_update(ctx, w, (), b, 0.0)
    fo2, _, _ = PerFedAvg(alpha=0.05, beta=0.3, local_steps=4).client_update(ctx, w, (), b, 0.0)
    assert not torch.allclose(hf2["weight"], fo2["weight"])  # the Hessian term matters when alpha > 0


@pytest.mark.correctness(
    ("pfedme",), "evaluation uses each client's personalized theta",
    guards="reporting the global model's accuracy as pFedMe's",
)
def test_pfedme_is_evaluated_with_theta(small_data):
    sim = make_sim(PFedMe(personal_lr=0.05), small_data)
    st, _ = run_rounds(sim, 2)
    payload = sim.alg.payload(st.server)
    thetas = all_client_states(sim)
    es = sim.alg.personalize(sim.ctx, payload, T.take(thetas, 0), None, 0.1, True)
    assert all(torch.equal(a, b) for a, b in zip(T.leaves(es), T.leaves(T.take(thetas, 0).theta), strict=True))
    before = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    sim.clients.store.write_all(Theta(T.tmap(lambda t: -t, thetas.theta)))  # flip every personalized model
    after = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    # negated binary logits flip every prediction: evaluation follows theta, not the unchanged global w
    assert abs(after - (1 - before)) < 1e-6 and abs(after - before) > 0.05


@pytest.mark.slow
@pytest.mark.correctness(
    ("pfedme",), "a large lambda approaches FedAvg",
    guards="the Moreau-envelope step scaled wrongly",
)
def test_pfedme_large_lambda_approaches_fedavg(small_data):
    opt = SGD(lr=0.05)
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, opt=opt), 3)
    pfedme = PFedMe(lam=200.0, personal_lr=0.0025, inner_steps=60, weighted=True)
    sb, _ = run_rounds(make_sim(pfedme, small_data, opt=opt), 3)
    diff = float(T.sq_dist(sa.server.params, sb.server.params)) ** 0.5
    moved = float(T.sq_dist(sa.server.params, make_sim(FedAvg(), small_data).init_state().server.params)) ** 0.5
    assert diff < 0.05 * moved


@pytest.mark.correctness(
    ("pfedme",), "the variant FedEM's Table 1 calls pFedMe is available, and differs",
    guards="comparing against a method that is not pFedMe under its name (known: FedEM's Table 1 reports its "
           "reference code's aggregator as pFedMe)",
)
def test_pfedme_fedem_reference_variant(small_data):
    """The FedEM code's "pFedMe": its first round is FedProx with mu = lam (every client starts from the global
    model); with lam = 0 the clients' models are Local's, whatever the server averages; seen clients predict with
    their own model, unseen ones with the average."""
    opt = SGD(0.1, momentum=0.5)
    ref = make_sim(PFedMe(variant="fedem_reference", lam=0.5), small_data, opt=opt)
    sr, _ = run_rounds(ref, 1)
    sp, _ = run_rounds(make_sim(FedProx(mu=0.5), small_data, opt=opt), 1)
    for a, b in zip(T.leaves(sr.server.params), T.leaves(sp.server.params), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    zero = make_sim(PFedMe(variant="fedem_reference", lam=0.0), small_data, opt=opt)
    local = make_sim(Local(), small_data, opt=opt)
    sz, _ = run_rounds(zero, 3)
    run_rounds(local, 3)
    for a, b in zip(T.leaves(all_client_states(zero).theta), T.leaves(all_client_states(local).params), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    payload = zero.alg.payload(sz.server)
    theta0 = T.take(all_client_states(zero), 0)
    seen = zero.alg.personalize(zero.ctx, payload, theta0, None, 0.1, True)
    unseen = zero.alg.personalize(zero.ctx, payload, theta0, None, 0.1, False)
    assert all(torch.equal(a, b) for a, b in zip(T.leaves(seen), T.leaves(theta0.theta), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(T.leaves(unseen), T.leaves(payload), strict=True))


@pytest.mark.correctness(
    ("ditto",), "lambda = 0: the personal models are Local's",
    guards="the personal model pulled towards the global one when lambda is zero",
)
def test_ditto_lambda_zero_is_local(small_data):
    ea, eb = make_sim(Local(), small_data), make_sim(Ditto(lam=0.0), small_data)
    run_rounds(ea, 3)
    run_rounds(eb, 3)
    for x, y in zip(T.leaves(all_client_states(ea).params), T.leaves(all_client_states(eb).v), strict=True):
        assert torch.allclose(x, y, atol=1e-6)


@pytest.mark.correctness(
    ("apfl",), "alpha = 0 (fixed) is FedAvg",
    guards="the mixture weight applied to the wrong model",
)
def test_apfl_with_alpha_zero_fixed_is_fedavg(small_data):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, opt=SGD(0.1)), 2)
    sb, _ = run_rounds(make_sim(APFL(alpha=0.0, adapt_alpha=False), small_data, opt=SGD(0.1)), 2)
    for x, y in zip(T.leaves(sa.server), T.leaves(sb.server), strict=True):
        assert torch.allclose(x, y, atol=1e-6)


@pytest.fixture(scope="module")
def permuted():
    return permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=4, n_train=120, n_test=100, seed=1)


@pytest.mark.correctness(
    ("clustered",), "label-permuted groups are separated",
    guards="a bipartition that ignores the cosine similarities",
)
@pytest.mark.slow
def test_clustered_fl_separates_permuted_groups(permuted):
    alg = ClusteredFL(eps1=0.1, eps2=0.3, warmup_rounds=5)
    sim = make_sim(alg, permuted, opt=SGD(0.1, 0.9), rounds=40, batch_size=32)
    st, _ = run_rounds(sim, 40)
    assign = st.server.assign.numpy()
    groups = permuted.meta["group"]
    assert len(np.unique(assign)) >= 2
    # no cluster mixes the two groups
    for c in np.unique(assign):
        assert len(np.unique(groups[assign == c])) == 1
    acc = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    fed = make_sim(FedAvg(), permuted, opt=SGD(0.1, 0.9), rounds=40, batch_size=32)
    sf, _ = run_rounds(fed, 40)
    assert acc > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.15


@pytest.mark.correctness(
    ("clustered",), "a homogeneous population is never split",
    guards="split criteria (eps1, eps2) compared on the wrong norms",
)
@pytest.mark.slow
def test_clustered_fl_does_not_split_a_homogeneous_population():
    same = permuted_groups(num_clients=10, num_groups=1, dim=10, num_classes=4, n_train=120, n_test=50, seed=2)
    sim = make_sim(ClusteredFL(eps1=0.1, eps2=0.3, warmup_rounds=5), same, opt=SGD(0.1, 0.9), rounds=40,
                   batch_size=32)
    st, _ = run_rounds(sim, 40)
    assert int(st.server.assign.max()) == 0


def test_omega_solves_its_convex_problem():
    rng = np.random.default_rng(0)
    for lam in (0.1, 1.0, 5.0):
        L = rng.uniform(0.05, 3.0, size=6)
        w = solve_omega(torch.tensor(L), lam).numpy()

        def obj(v, L=L, lam=lam):
            return float(v @ L - lam * np.log(np.clip(v, 1e-12, None)).sum())

        res = minimize(obj, np.full(6, 1 / 6), method="SLSQP", bounds=[(1e-9, 1)] * 6,
                       constraints=[{"type": "eq", "fun": lambda v: v.sum() - 1}], options={"ftol": 1e-12})
        assert abs(w.sum() - 1) < 1e-9 and obj(w) <= res.fun + 1e-7
        assert np.allclose(w, res.x, atol=1e-3)
    assert torch.allclose(solve_omega(torch.full((3, 5), 0.7), 1.0), torch.full((3, 5), 0.2))
    # a node whose data the network fits badly gets less weight
    w = solve_omega(torch.tensor([0.1, 0.1, 2.0]), 0.5)
    assert w[2] < w[0]
