"""FedCP (Zhang et al., KDD 2023): the contract, the MMD term E_i^d and the policy forward pass by hand, the upload
head of Eq. (6) with the global head frozen, the reduction to FedPer when the policy sends every feature to the
personalized head (lambda = 0), and personalization of label-permuted groups that FedAvg cannot serve."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmtl import tree as T
from fedmtl.algorithms.fedavg import FedAvg
from fedmtl.algorithms.fedbabu import FedBABU
from fedmtl.algorithms.fedcp import CPModel, FedCP, PersonalHead, client_vector, mmd2, policy
from fedmtl.algorithms.fedper import FedPer
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.models.base import Model, ModelError
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds


def test_refuses_a_model_without_a_head(small_model):
    with pytest.raises(ModelError, match="fedcp"):
        FedCP().check_model(small_model)
    with pytest.raises(ValueError, match="lam"):
        FedCP(lam=-1.0)


def _k(d: float) -> float:
    """The kernel at squared distance d: sum over the bandwidths 10, 15, 20, 50 of exp(-d / (2 sigma))."""
    return sum(math.exp(-d / (2 * s)) for s in (10.0, 15.0, 20.0, 50.0))


@pytest.mark.correctness(
    ("fedcp",), "the MMD term E_i^d by hand: 0 for identical features, the closed form on a 1-d pair of sets, "
    "padding left out",
    guards="a kernel of the wrong bandwidth or scale, a mean over padding slots, a missing cross term",
)
def test_mmd_by_hand():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=g)
    assert float(mmd2(a, a.clone(), torch.ones(5)).abs()) < 1e-6
    # one row each at squared distance 25: k(0) + k(0) - 2 k(25), k(0) = 4 (four kernels)
    one = mmd2(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0]]), torch.ones(1))
    assert abs(float(one) - (8.0 - 2.0 * _k(25.0))) < 1e-5
    # a = {0, 1}, b = {2, 2} (1-d), a third padded row of garbage in each:
    # mean k(a, a') = (2 k(0) + 2 k(1)) / 4, mean k(b, b') = k(0), mean k(a, b) = (2 k(4) + 2 k(1)) / 4
    x = torch.tensor([[0.0], [1.0], [1e3]])
    y = torch.tensor([[2.0], [2.0], [-1e3]])
    want = (2 * _k(0) + 2 * _k(1)) / 4 + _k(0) - 2 * (2 * _k(4) + 2 * _k(1)) / 4
    got = mmd2(x, y, torch.tensor([1.0, 1.0, 0.0]))
    assert abs(float(got) - want) < 1e-5
    assert want > 0.1  # the case is not degenerate


@pytest.mark.correctness(
    ("fedcp",), "the prediction by hand: v_i the row sum of W_i^hd, C = v_i / ||v_i|| (.) h, Linear-LayerNorm-ReLU, "
    "the pairwise softmax, r (.) h to the global head and s (.) h to the personalized head, outputs summed",
    guards="r and s swapped between the heads, v_i not normalized, the softmax taken over the K coordinates "
    "instead of each coordinate's pair",
)
def test_prediction_by_hand():
    mlp = build_model("mlp", 4, 3, hidden=(5,))
    alg = FedCP()
    eng = make_sim(alg, permuted_groups(num_clients=4, dim=4, num_classes=3, n_train=20, n_test=10, seed=2),
                   model=mlp, rounds=1)
    server: CPModel = eng.init_state().server
    g = torch.Generator().manual_seed(3)
    cpn = {k: torch.randn(v.shape, generator=g) for k, v in server.cpn.items()}  # away from LayerNorm's 1 and 0
    head = {k: torch.randn(v.shape, generator=g) for k, v in mlp.split(server.params)[1].items()}
    x = torch.randn(6, 4, generator=g)
    lp = alg.predict_log_proba(eng.ctx, alg.personalize(eng.ctx, server._replace(cpn=cpn), PersonalHead(head),
                                                        None, 0.1, True), x)
    p = server.params
    h = torch.relu(x @ p["0.weight"].T + p["0.bias"])  # the representation (the hidden layer)
    v = head["2.weight"].sum(0)  # the sum of W_i^hd's rows
    c = h * v / v.norm()
    z = c @ cpn["linear.weight"].T + cpn["linear.bias"]  # (6, 2K)
    z = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + 1e-5)
    a = torch.relu(z * cpn["norm.weight"] + cpn["norm.bias"])
    r = torch.sigmoid(a[:, :5] - a[:, 5:])  # exp(a_1) / (exp(a_1) + exp(a_2))
    out = (r * h) @ p["2.weight"].T + p["2.bias"] + ((1 - r) * h) @ head["2.weight"].T + head["2.bias"]
    assert torch.allclose(lp, F.log_softmax(out, -1), atol=1e-5)
    rr, ss = policy(cpn, h, v)
    assert torch.allclose(rr + ss, torch.ones_like(rr)) and bool(((rr > 0) & (rr < 1)).all())


@pytest.mark.correctness(
    ("fedcp",), "the update: the trained extractor and CPN, and the upload head (W^hd + W_i^hd) / 2 of Eq. (6) with "
    "W^hd the received head (frozen); the client keeps W_i^hd",
    guards="the global head trained locally, the personalized head uploaded alone or the global one kept",
)
def test_update_uploads_the_mean_of_the_frozen_global_head_and_the_personal_head(small_data):
    mlp = build_model("mlp", 10, 2, hidden=(16,))
    alg = FedCP()
    eng = make_sim(alg, small_data, model=mlp)
    payload: CPModel = eng.init_state().server
    body, ghead = mlp.split(payload.params)
    g = torch.Generator().manual_seed(4)
    state = PersonalHead({k: torch.randn(v.shape, generator=g) for k, v in ghead.items()})
    x = torch.randn(3, 8, 10, generator=g)
    y = torch.randint(0, 2, (3, 8), generator=g)
    mask = torch.ones(3, 8)
    batches = Batches(x, y, mask, torch.arange(24).reshape(3, 8), mask.sum())
    update, new, loss = alg.client_update(eng.ctx, payload, state, batches, 0.1)
    assert bool(torch.isfinite(loss))
    for k in ghead:  # Eq. (6), with W^hd as received
        assert torch.allclose(update.params[k], (ghead[k] + new.head[k]) / 2, atol=1e-7)
        assert not torch.allclose(new.head[k], state.head[k])  # W_i^hd trained
    assert all(not torch.equal(update.params[k], body[k]) for k in body)  # W_i^fe trained
    assert any(not torch.equal(update.cpn[k], payload.cpn[k]) for k in payload.cpn)  # Theta_i trained
    assert list(update.params) == list(payload.params) and list(update.cpn) == list(payload.cpn)


def _fixed_policy(server: CPModel, to_personal: bool) -> CPModel:
    """The server state with a CPN that routes every feature to one head whatever its input: LayerNorm weight 0 and
    bias (0, 100) (``to_personal``: r = 1 / (1 + e^100) ~ 4e-44, s = 1) or (100, 0) (r = 1, s ~ 4e-44)."""
    k = server.cpn["norm.bias"].numel() // 2
    big, zero = torch.full((k,), 100.0), torch.zeros(k)
    bias = torch.cat([zero, big] if to_personal else [big, zero])
    return server._replace(cpn={**server.cpn, "norm.weight": torch.zeros(2 * k), "norm.bias": bias})


@dataclasses.dataclass(frozen=True)
class AllPersonal(FedCP):
    """FedCP whose CPN sends every feature to the personalized head (r = 0, s = 1)."""

    def init_server(self, ctx, params, seed):
        return _fixed_policy(super().init_server(ctx, params, seed), to_personal=True)


@dataclasses.dataclass(frozen=True)
class AllGlobal(FedCP):
    """FedCP whose CPN sends every feature to the global head (r = 1, s = 0)."""

    def init_server(self, ctx, params, seed):
        return _fixed_policy(super().init_server(ctx, params, seed), to_personal=False)


def _bias_free_head() -> Model:
    model = Model.from_module(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1, bias=False)), 2)
    assert model.head == ("2.weight",)
    return model


@pytest.mark.correctness(
    ("fedcp",), "a policy sending every feature to the personalized head (s = 1), lambda = 0, a bias-free head: "
    "FedPer (same bodies, personal heads and seen clients' evaluation)",
    guards="the extractor not trained through the personalized head, the personalized head overwritten by the "
    "server, an MMD term that stays on at lambda = 0",
)
def test_all_personal_policy_without_mmd_is_fedper(small_data):
    # r = 0: the global head gets no input (bias-free: no output) and the CPN no gradient, so a client trains its
    # extractor and personalized head on the plain loss from the received extractor and its own head -- FedPer;
    # the server's mean of the extractors is FedPer's body
    model = _bias_free_head()
    a = make_sim(AllPersonal(lam=0.0), small_data, model=model, sampling_rate=0.5)
    sa, _ = run_rounds(a, 3)
    b = make_sim(FedPer(), small_data, model=model, sampling_rate=0.5)
    sb, _ = run_rounds(b, 3)
    for k, v in sb.server.params.items():  # FedPer's server state: the body
        assert torch.allclose(sa.server.params[k], v, atol=1e-5), k
    ha, hb = all_client_states(a).head, all_client_states(b).head
    assert torch.allclose(ha["2.weight"], hb["2.weight"], atol=1e-5)
    assert not torch.allclose(hb["2.weight"], hb["2.weight"][0])  # the heads did train, and differ
    ea, eb = summarize(a.evaluate(sa)), summarize(b.evaluate(sb))
    for key in ("seen_test_acc_mean", "seen_test_loss", "seen_train_loss"):
        assert abs(ea[key] - eb[key]) < 1e-5, (key, ea[key], eb[key])


@pytest.mark.correctness(
    ("fedcp",), "a policy sending every feature to the frozen global head (r = 1), lambda = 0, a bias-free head: "
    "FedBABU's training (the body trained under the initial head, which stays the server's global head)",
    guards="the global head trained locally or replaced by the personalized heads' mean before Eq. (6)",
)
def test_all_global_policy_without_mmd_trains_as_fedbabu(small_data):
    # s = 0: the personalized head gets no input, so it never moves and Eq. (6) uploads (W^hd + W^hd) / 2 = W^hd:
    # the global head stays the initial one, frozen in local training -- FedBABU's fixed head; the bodies agree
    model = _bias_free_head()
    opt = SGD(0.1, 0.9)  # no weight decay: it would shrink the (unused) personalized heads
    a = make_sim(AllGlobal(lam=0.0), small_data, model=model, opt=opt, sampling_rate=0.5)
    sa, _ = run_rounds(a, 3)
    b = make_sim(FedBABU(), small_data, model=model, opt=opt, sampling_rate=0.5)
    sb, _ = run_rounds(b, 3)
    for k, v in sb.server.params.items():  # FedBABU's averaged body
        assert torch.allclose(sa.server.params[k], v, atol=1e-5), k
        assert not torch.allclose(v, model.init(7)[k])  # it trained
    head0 = sb.server.fixed["2.weight"]  # W^hd stays the initial head (to the rounding of the server's mean)
    assert torch.allclose(sa.server.params["2.weight"], head0, atol=1e-6)
    assert torch.allclose(all_client_states(a).head["2.weight"], head0.expand(16, 1, 16), atol=1e-6)


def test_unseen_client_trains_its_head_from_the_global_head_the_rest_received(small_data):
    mlp = build_model("mlp", 10, 2, hidden=(16,))
    alg = FedCP()
    eng = make_sim(alg, small_data, model=mlp)
    server: CPModel = eng.init_state().server
    state = alg.init_client(eng.ctx, server)
    _, ghead = mlp.split(server.params)
    assert all(torch.equal(state.head[k], ghead[k]) for k in ghead)  # an unseen client starts at W^hd
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 10, generator=g)
    y = torch.randint(0, 2, (2, 8), generator=g)
    batches = Batches(x, y, torch.ones(2, 8), torch.arange(16).reshape(2, 8), torch.tensor(16.0))
    ev = alg.personalize(eng.ctx, server, state, batches, 0.1, False)
    assert ev.params is server.params and ev.cpn is server.cpn  # W^fe, Theta and W^hd as received
    assert all(not torch.equal(ev.head[k], ghead[k]) for k in ghead)  # its own head trained
    assert alg.personalize(eng.ctx, server, state, None, 0.1, True).head is state.head  # a seen client: as kept


def test_v_is_the_row_sum_of_the_personal_head():
    w = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    assert torch.equal(client_vector({"2.weight": w, "2.bias": torch.zeros(3)}), torch.tensor([4.5, 1.5]))


@pytest.mark.slow
def test_personalizes_label_permuted_groups_better_than_fedavg():
    # two groups whose labels are permuted: one global model cannot serve both; the personalized head (fed the
    # features the policy routes to it) can
    permuted = permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=4, n_train=120, n_test=100, seed=1)
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    opt = SGD(0.1, 0.9)
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=opt, rounds=40, batch_size=32)
    sf, _ = run_rounds(fed, 40)
    sim = make_sim(FedCP(), permuted, model=mlp4, opt=opt, rounds=40, batch_size=32)
    st, _ = run_rounds(sim, 40)
    acc, base = summarize(sim.evaluate(st))["seen_test_acc_mean"], summarize(fed.evaluate(sf))["seen_test_acc_mean"]
    assert acc > base + 0.2, (acc, base)
    assert T.leaves(st.server)  # the server state is a CPModel of tensors
