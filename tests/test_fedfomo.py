"""FedFomo (Zhang et al., ICLR 2021): the contract, the first-order weights and update (Section 3) by hand, the
reduction to local training when no downloaded model differs, the server's affinity update and epsilon-greedy
selection (Section 3), unseen clients' weighting, and FedFomo's clients finding their own group where FedAvg's one
model cannot fit two opposite labelling rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedmtl import tree as T
from fedmtl.algorithms.base import ClientId, Context
from fedmtl.algorithms.fedavg import FedAvg
from fedmtl.algorithms.fedfomo import FedFomo, FomoPayload, FomoServer, FomoUpdate, validation_examples
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.evaluation import SEEN_TEST_ACC_MEAN, summarize
from fedmtl.engine.systems import SystemsConfig
from fedmtl.models import build_model
from fedmtl.optim import SGD, Batches, local_sgd

from .conftest import make_sim, run_rounds


def test_refuses_privacy():
    with pytest.raises(ValueError, match="privacy"):
        FedFomo().check_privacy()


def _batches(x: torch.Tensor, y: torch.Tensor) -> Batches:
    """One step holding all the examples (their indices 0..n-1)."""
    n = len(y)
    at = torch.arange(n).unsqueeze(0)
    return Batches(x.unsqueeze(0), y.unsqueeze(0), torch.ones(1, n), at, torch.tensor(float(n)), idx=at)


def _ce(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy of a linear model, written out."""
    return F.cross_entropy(x @ p["weight"].T + p["bias"], y)


@pytest.mark.correctness(
    ("fedfomo",), "first-order weights (L(theta_i) - L(theta_n)) / ||theta_n - theta_i|| on the held-out split, the "
    "worse model clipped to 0, the rest normalized, and theta_i + sum w_n (theta_n - theta_i), by hand",
    guards="losses on the training examples, an unnormalized or unclipped weight, the wrong sign or norm",
)
def test_first_order_weights_and_update_by_hand():
    torch.manual_seed(0)
    d, c, n = 4, 3, 40
    model = build_model("linear", d, c)
    w_true = torch.randn(c, d) * 2
    x = torch.randn(n, d)
    y = (x @ w_true.T).argmax(1)
    prev = {"weight": torch.zeros(c, d), "bias": torch.zeros(c)}  # theta_i^{t-1}: loss ln 3
    good = {"weight": w_true * 0.5, "bias": torch.zeros(c)}  # better than prev
    far = {"weight": w_true * 1.5, "bias": torch.full((c,), 0.3)}  # better still, farther away
    bad = {"weight": -w_true, "bias": torch.zeros(c)}  # worse than prev
    table = T.stack([prev, good, far, bad])
    alg = FedFomo(num_models=3, val_fraction=0.25)
    payload = FomoPayload(table, torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]))
    ctx = Context(model, SGD(0.1), 4, float(n))
    b = _batches(x, y)
    val = torch.tensor([(j * (math.sqrt(5) - 1) / 2) % 1.0 < 0.25 for j in range(n)])
    assert torch.equal(validation_examples(torch.arange(n), 0.25), val)
    assert 6 <= int(val.sum()) <= 14  # about a quarter of the examples held out
    # by hand: losses on the held-out examples, L2 distances, clipped and normalized weights
    xv, yv = x[val], y[val]
    l0 = _ce(prev, xv, yv)
    raw = []
    for p in (good, far, bad):
        dist = torch.sqrt(torch.stack([((p[k] - prev[k]) ** 2).sum() for k in p]).sum())
        raw.append(float((l0 - _ce(p, xv, yv)) / dist))
    assert raw[0] > 0 and raw[1] > 0 and raw[2] < 0
    w = torch.tensor([raw[0], raw[1], 0.0]) / (raw[0] + raw[1])
    want = {k: prev[k] + w[0] * (good[k] - prev[k]) + w[1] * (far[k] - prev[k]) for k in prev}
    upd, state, _ = alg.client_update(ctx, payload, ClientId(torch.tensor(0)), b, 0.0)  # lr 0: the mix alone
    assert torch.equal(upd.selected, torch.tensor([1, 2, 3]))
    torch.testing.assert_close(upd.weights, w, atol=1e-6, rtol=1e-5)
    assert float(upd.weights[2]) == 0.0  # the worse model
    for k in want:
        torch.testing.assert_close(upd.params[k], want[k], atol=1e-6, rtol=1e-5)
    # with lr > 0: then local SGD from the mix on the training examples only (the held-out ones never trained on)
    upd, _, _ = alg.client_update(ctx, payload, ClientId(torch.tensor(0)), b, 0.5)
    train = _batches(x[~val], y[~val])
    ref, _ = local_sgd(model.value_and_grad, want, train, 0.5, SGD(0.1))
    for k in ref:
        torch.testing.assert_close(upd.params[k], ref[k], atol=1e-5, rtol=1e-5)


@pytest.mark.correctness(
    ("fedfomo",), "a downloaded model identical to the client's own gets weight 0: the update is plain local SGD of "
    "the client's model on its training split",
    guards="a 0/0 weight (NaN) for a model at distance 0, a mix that moves the model, the held-out split trained on",
)
def test_identical_candidate_is_plain_local_training():
    torch.manual_seed(1)
    model = build_model("linear", 5, 2)
    p = model.init(3)
    x, y = torch.randn(30, 5), torch.randint(0, 2, (30,))
    b = _batches(x, y)
    ctx = Context(model, SGD(0.1, momentum=0.9), 2, 30.0)
    alg = FedFomo(num_models=1)
    payload = FomoPayload(T.stack([p, T.clone(p)]), torch.tensor([[1], [0]]))
    upd, _, loss = alg.client_update(ctx, payload, ClientId(torch.tensor(0)), b, 0.3)
    val = validation_examples(torch.arange(30), alg.val_fraction)
    ref, ref_loss = local_sgd(model.value_and_grad, p, _batches(x[~val], y[~val]), 0.3, ctx.opt)
    assert float(upd.weights[0]) == 0.0
    for k in ref:
        torch.testing.assert_close(upd.params[k], ref[k], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss, ref_loss)
    # one client alone (M > N - 1): its only candidate is itself, the same local training
    alone = FomoPayload(T.stack([p]), alg.select(torch.zeros(1, 1, dtype=torch.float64), 0, 0))
    assert alone.selected.tolist() == [[0]]
    upd1, _, _ = alg.client_update(ctx, alone, ClientId(torch.tensor(0)), b, 0.3)
    for k in ref:
        torch.testing.assert_close(upd1.params[k], ref[k], atol=1e-6, rtol=1e-6)


def _server(alg: FedFomo, n: int, seed: int) -> FomoServer:
    model = build_model("linear", 3, 2)
    ctx = Context(model, SGD(0.1), n, 100.0)
    return alg.init_server(ctx, model.init(0), seed)


@pytest.mark.correctness(
    ("fedfomo",), "the server writes the valid clients' models into their rows, adds their weights into the affinity "
    "matrix (P_in += w_n), leaves excluded updates out, and draws the next ids from (seed, round)",
    guards="a NaN update reaching the table or P, weights added to the wrong row or column, unseeded draws",
)
def test_affinity_update_and_next_selection():
    alg = FedFomo(num_models=2)
    srv = _server(alg, 5, seed=11)
    ctx = Context(build_model("linear", 3, 2), SGD(0.1), 5, 100.0)
    assert srv.selected.shape == (5, 2) and int(srv.round) == 0
    params = T.stack([{"weight": torch.full((1, 3), float(i)), "bias": torch.full((1,), float(i))} for i in (7, 8, 9)])
    params["weight"][1] = float("nan")  # client 0's update is NaN: excluded, weight 0
    upd = FomoUpdate(params, torch.tensor([[0, 1], [2, 3], [4, 0]]),
                     torch.tensor([[0.25, 0.75], [float("nan"), 1.0], [1.0, 0.0]]))
    out = alg.aggregate(ctx, srv, upd, torch.tensor([10.0, 0.0, 5.0], dtype=torch.float64), torch.tensor([2, 0, 3]))
    want = torch.zeros(5, 5, dtype=torch.float64)
    want[2, 0], want[2, 1], want[3, 4] = 0.25, 0.75, 1.0
    assert torch.equal(out.affinity, want)
    assert torch.equal(out.models["weight"][2], torch.full((1, 3), 7.0))
    assert torch.equal(out.models["weight"][3], torch.full((1, 3), 9.0))
    for i in (0, 1, 4):  # rows of the excluded client and of the absent ones: unchanged
        assert torch.equal(out.models["weight"][i], srv.models["weight"][i])
    assert int(out.round) == 1 and int(out.seed) == 11
    assert torch.equal(out.selected, alg.select(want, 11, 1))
    again = alg.aggregate(ctx, srv, upd, torch.tensor([10.0, 0.0, 5.0], dtype=torch.float64), torch.tensor([2, 0, 3]))
    assert torch.equal(again.selected, out.selected)  # deterministic given the seed
    twice = alg.aggregate(ctx, out, upd, torch.tensor([10.0, 0.0, 5.0], dtype=torch.float64), torch.tensor([2, 0, 3]))
    assert torch.equal(twice.affinity, 2 * want) and int(twice.round) == 2  # P accumulates over rounds
    assert torch.equal(twice.selected, alg.select(2 * want, 11, 2))
    # nobody valid: nothing changes
    same = alg.aggregate(ctx, srv, upd, torch.zeros(3, dtype=torch.float64), torch.tensor([2, 0, 3]))
    assert same is srv


def test_epsilon_greedy_selection():
    n, m = 200, 3
    g = torch.Generator().manual_seed(0)
    p = torch.rand(n, n, generator=g, dtype=torch.float64)  # distinct affinities: one greedy answer per row
    greedy = torch.topk(p.masked_fill(torch.eye(n, dtype=torch.bool), -1.0), m, dim=1).indices
    alg = FedFomo(num_models=m)
    assert alg.epsilon_at(0) == 0.3 and alg.epsilon_at(2) == pytest.approx(0.2) and alg.epsilon_at(6) == 0.0
    late = alg.select(p, 5, 6)  # epsilon 0: the M of largest affinity, best first
    assert torch.equal(late, greedy)
    early = alg.select(p, 5, 0)  # epsilon 0.3: about 30% of the rows drawn at random
    assert torch.equal(early, alg.select(p, 5, 0))
    assert not torch.equal(early, alg.select(p, 6, 0))  # another seed, other draws
    assert not torch.equal(early, alg.select(p, 5, 1))  # another round, other draws
    random_rows = (early != greedy).any(1).double().mean()
    assert 0.2 < float(random_rows) < 0.4
    for sel in (early, late):
        assert not (sel == torch.arange(n).unsqueeze(1)).any()  # never the client itself
        assert all(len(set(r)) == m for r in sel.tolist())  # M distinct ids
    # all-zero affinity (the first rounds): ties broken at random, not the lowest ids
    zero = FedFomo(num_models=m, epsilon=0.0).select(torch.zeros(n, n, dtype=torch.float64), 0, 0)
    assert float((zero < m + 1).all(1).double().mean()) < 0.05


def test_unseen_client_weights_the_table_around_its_mean():
    """An unseen client: the models that fit its data better than the table's mean get the weight; here the two
    copies of its own rule share it equally and the result is exactly that rule."""
    torch.manual_seed(2)
    model = build_model("linear", 4, 2)
    wa = {"weight": torch.randn(1, 4) * 3, "bias": torch.zeros(1)}
    wb = T.scale(wa, -1.0)  # the opposite labelling rule
    table = T.stack([wa, wb, wa, wb])  # mean 0
    x = torch.randn(64, 4)
    y = (x @ wb["weight"].T).reshape(-1).gt(0).long()
    ctx = Context(model, SGD(0.1), 4, 64.0)
    payload = FomoPayload(table, torch.zeros(4, 1, dtype=torch.long))
    got = FedFomo(unseen_chunk=3).personalize(ctx, payload, ClientId(torch.tensor(0)), _batches(x, y), 0.1, False)
    for k in wb:
        torch.testing.assert_close(got[k], wb[k], atol=1e-6, rtol=1e-6)
    seen = FedFomo().personalize(ctx, payload, ClientId(torch.tensor(2)), None, 0.1, True)
    assert torch.equal(seen["weight"], wa["weight"])  # a seen client: its own row


def test_loop_equals_vmap_with_stragglers():
    """The held-out split masks steps out of the ragged (loop) and padded (vmap) batches alike, straggler limits
    and drops included."""
    data = permuted_groups(num_clients=8, num_groups=2, dim=6, num_classes=2, n_train=45, n_test=20, seed=1)
    systems = SystemsConfig(variability="high", drop_prob=0.2)
    outs = []
    for runner in ("loop", "vmap"):
        eng = make_sim(FedFomo(num_models=2), data, runner=runner, systems=systems, batch_size=8, local_epochs=2)
        outs.append(run_rounds(eng, 3)[0].server)
    for a, b in zip(T.leaves(outs[0]), T.leaves(outs[1]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.correctness(
    ("fedfomo",), "on two groups with opposite labelling rules, each client's affinity goes to its own group and its "
    "accuracy beats FedAvg's single model by 25 points",
    guards="weights that ignore the validation loss, affinity rows mixed up between clients",
)
def test_clients_find_their_group_where_fedavg_cannot():
    data = permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=2, n_train=100, n_test=100, seed=0)
    group = torch.as_tensor(data.meta["group"])
    acc = {}
    for alg in (FedFomo(), FedAvg()):
        eng = make_sim(alg, data, opt=SGD(0.1), rounds=10)
        st, _ = run_rounds(eng, 10)
        acc[alg.name] = summarize(eng.evaluate(st, ("seen",)))[SEEN_TEST_ACC_MEAN]
        if alg.name == "fedfomo":
            p = st.server.affinity
            same = (group.unsqueeze(0) == group.unsqueeze(1)).to(p.dtype)
            assert float((p * same).sum() / p.sum()) > 0.9  # the weight goes to the client's own group
            assert int(((p * same).sum(1) > 0).sum()) >= 9  # most clients found models of their group helpful
    assert acc["fedavg"] < 0.65
    assert acc["fedfomo"] > acc["fedavg"] + 0.25
