"""FedEM (Marfoq et al. 2021): E-step, pi update, prediction, unseen clients, recovery."""

import itertools

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import FedAvg, FedEM, Local
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.fedem import MixtureEval, MixtureWeights
from fedmtl.data.synthetic import fedem_synthetic
from fedmtl.engine.evaluation import summarize
from fedmtl.engine.sampling import sample_clients
from fedmtl.models import build_model
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds


def _ctx(model):
    return Context(model, SGD(lr=0.1), 1, 10.0, 1)


@pytest.mark.correctness(
    ("fedem",), "the E-step equals the exact posterior over components",
    guards="responsibilities computed from logits instead of likelihoods",
)
def test_e_step_is_the_exact_posterior():
    model = build_model("linear", 2, 2)
    comps = {"weight": torch.tensor([[[1.0, -1.0]], [[-2.0, 0.5]]]), "bias": torch.tensor([[0.3], [-0.1]])}
    x = torch.tensor([[0.5, 1.0], [-1.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([1, 0, 1])
    pi = torch.tensor([0.3, 0.7])
    alg = FedEM(num_components=2)
    nll = alg.component_nll(_ctx(model), comps, x, y)
    q, ll = alg.e_step(torch.log(pi), nll)
    # by hand: p_m(y|x) = sigmoid(z_m)^y (1 - sigmoid(z_m))^(1-y); q_m ∝ pi_m p_m
    xn, yn = x.double().numpy(), y.double().numpy()
    lik = []
    for m in range(2):
        z = xn @ comps["weight"][m, 0].double().numpy() + float(comps["bias"][m, 0])
        s = 1 / (1 + np.exp(-z))
        lik.append(np.where(yn == 1, s, 1 - s))
    joint = np.stack(lik) * pi.double().numpy()[:, None]
    assert np.allclose(q.numpy(), joint / joint.sum(0), atol=1e-6)
    assert np.allclose(ll.numpy(), np.log(joint.sum(0)), atol=1e-6)
    # and the client's pi update is the mean responsibility over its (unpadded) examples
    xp = torch.cat([x, torch.zeros(1, 2)]).unsqueeze(0)
    yp = torch.cat([y, torch.zeros(1, dtype=torch.long)]).unsqueeze(0)
    b = Batches(xp, yp, torch.tensor([[1.0, 1, 1, 0]]), torch.arange(4).unsqueeze(0), torch.tensor(3.0))
    _, state, _ = alg.client_update(_ctx(model), comps, MixtureWeights(pi), b, 0.0)
    assert np.allclose(state.pi.numpy(), (joint / joint.sum(0)).mean(1), atol=1e-6)


@pytest.mark.correctness(
    ("fedem",), "prediction mixes the components' probabilities, weighted by pi",
    guards="mixing logits (a different model from the paper's mixture)",
)
def test_prediction_mixes_probabilities_not_logits():
    model = build_model("linear", 1, 2)
    comps = {"weight": torch.tensor([[[10.0]], [[-1.0]]]), "bias": torch.zeros(2, 1)}
    es = MixtureEval(comps, torch.tensor([0.5, 0.5]))
    x = torch.tensor([[1.0]])
    logp = FedEM(num_components=2).predict_log_proba(_ctx(model), es, x)
    p1 = 0.5 * torch.sigmoid(torch.tensor(10.0)) + 0.5 * torch.sigmoid(torch.tensor(-1.0))
    assert torch.allclose(logp.exp()[0, 1], p1, atol=1e-6)
    assert not torch.allclose(logp.exp()[0, 1], torch.sigmoid(torch.tensor(4.5)), atol=1e-3)  # logit mixing


def test_unseen_client_em_increases_likelihood_monotonically():
    model = build_model("linear", 4, 2)
    g = torch.Generator().manual_seed(0)
    comps = {"weight": torch.randn(3, 1, 4, generator=g) * 2, "bias": torch.zeros(3, 1)}
    x = torch.rand(60, 4, generator=g) * 2 - 1
    y = (x @ comps["weight"][1, 0] > 0).long()
    b = Batches(x.view(1, 60, 4), y.view(1, 60), torch.ones(1, 60), torch.arange(60).view(1, 60), torch.tensor(60.0))
    ctx = _ctx(model)
    one_step = FedEM(num_components=3, unseen_max_iter=1, unseen_tol=0.0)
    nll = one_step.component_nll(ctx, comps, x, y)
    pi = torch.full((3,), 1 / 3)
    lls = []
    for _ in range(30):
        lls.append(float(torch.logsumexp(torch.log(pi).unsqueeze(-1) - nll, 0).sum()))
        pi = one_step.fit_pi(ctx, comps, pi, b)
    assert all(b2 >= b1 - 1e-9 for b1, b2 in zip(lls, lls[1:], strict=False))
    assert lls[-1] > lls[0] + 1.0
    assert int(pi.argmax()) == 1
    # the converged fit equals many single iterations
    full = FedEM(num_components=3, unseen_max_iter=500, unseen_tol=1e-10).fit_pi(ctx, comps, torch.full((3,), 1 / 3), b)
    assert torch.allclose(full, pi, atol=2e-2)


def _align(learned_w, learned_b, theta, dim):
    x = torch.rand(5000, dim, generator=torch.Generator().manual_seed(1)) * 2 - 1
    a = (x @ learned_w.T + learned_b > 0).float()
    t = (x @ theta.T > 0).float()
    agree = (a.T.unsqueeze(1) == t.T.unsqueeze(0)).float().mean(-1)  # (learned, true)
    m = agree.shape[0]
    best = max(itertools.permutations(range(m)), key=lambda p: sum(float(agree[i, p[i]]) for i in range(m)))
    return best, agree


@pytest.mark.slow
def test_fedem_recovers_mixture_weights_on_separated_components():
    d = fedem_synthetic(num_clients=40, dim=6, n_test=100, seed=11, min_samples=200, max_samples=600)
    sim = make_sim(FedEM(num_components=3), d, opt=SGD(lr=0.5, momentum=0.9), rounds=150, batch_size=64)
    st, _ = run_rounds(sim, 150)
    comps = st.server.components
    best, agree = _align(comps["weight"][:, 0], comps["bias"][:, 0], torch.tensor(d.meta["theta"]).float(), 6)
    assert all(float(agree[i, best[i]]) > 0.95 for i in range(3))  # each true component found
    pi = all_client_states(sim).pi[:, list(np.argsort(best))]
    emp = torch.stack([torch.bincount(torch.tensor(z), minlength=3).float() / len(z) for z in d.meta["latent"]])
    err = (pi - emp).abs().sum(1)  # L1 distance to each client's empirical component frequencies
    assert float(err.mean()) < 0.15 and float(err.max()) < 0.45


@pytest.mark.slow
def test_fedem_beats_fedavg_and_local_on_mixture_data():
    d = fedem_synthetic(num_clients=40, dim=10, n_test=200, seed=11, max_samples=600)
    acc = {}
    for alg in (FedEM(num_components=3), FedAvg(), Local()):
        sim = make_sim(alg, d, opt=SGD(lr=0.5, momentum=0.9), rounds=60, batch_size=64)
        st, _ = run_rounds(sim, 60)
        acc[alg.name] = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    assert acc["fedem"] > acc["fedavg"] + 0.08
    assert acc["fedem"] > acc["local"] + 0.025


@pytest.mark.correctness(
    ("fedem",), "the reference code's all-clients server average is available and differs as it should",
    guards="silently mixing the two server averages",
)
def test_all_clients_server_average_is_the_reference_variant(small_data):
    """With partial participation the reference average shrinks the step by n_participants / n."""
    res = {}
    for mode in ("participants", "all_clients"):
        sim = make_sim(FedEM(num_components=2, server_average=mode), small_data, sampling_rate=0.25)
        st = sim.init_state()
        c0 = T.clone(st.server.components)
        sim.round(st)
        res[mode] = T.sub(st.server.components, c0)
        clients = sample_clients(sim.cfg, small_data.num_clients, 0)
        share = float(small_data.seen.train.counts[clients].sum() / small_data.seen.train.counts.sum())
    for a, b in zip(T.leaves(res["participants"]), T.leaves(res["all_clients"]), strict=True):
        assert torch.allclose(a * share, b, atol=1e-6)
    with pytest.raises(ValueError, match="server_average"):
        FedEM(server_average="everyone")
