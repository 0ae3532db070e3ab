"""The methods of issue 16: body/head methods (FedPer, FedRep, LG-FedAvg, FedBABU), SCAFFOLD, FedDyn, IFCA,
server optimizers, and the seed faults (Omni-Fedge's step and omega, Per-FedAvg's independent batches and its
exact-Hessian variant): reductions, closed forms and behaviour on data built to show each method's point."""

import dataclasses
import math

import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import (
    IFCA,
    FedALA,
    FedAvg,
    FedBABU,
    FedDyn,
    FedPer,
    FedRep,
    FedRoD,
    KNNPer,
    LGFedAvg,
    Moon,
    OmniFedge,
    PerFedAvg,
    PFedHN,
    Scaffold,
)
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.perfedavg import role_batch, role_batches
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.evaluation import summarize
from fedmtl.engine.server_opt import ServerOptConfig
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds
from .conftest import same_trees as _same
from .test_personalization import _batches


@pytest.fixture(scope="module")
def permuted():
    return permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=4, n_train=120, n_test=100, seed=1)


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", 10, 2, hidden=(16,))


# ------------------------------------------------------------------------------------------------ body / head
def test_every_built_in_model_declares_its_head_and_its_representation():
    for name, shape, classes in (("mlp", (20,), 10), ("cnn_femnist", (1, 28, 28), 10), ("lstm", (80,), 80)):
        m = build_model(name, shape, classes)
        p = m.init(0)
        x = torch.randint(0, 80, (3, *shape)) if name == "lstm" else torch.randn(3, *shape)
        body, head = m.split(p)
        assert set(head) == set(m.head) and body and set(body) | set(head) == set(p)
        # the representation is the head's input: the head applied to it gives the model's logits
        assert torch.allclose(m.head_module()(m.features(p, x)), m.apply(p, x), atol=1e-5)
        assert torch.allclose(m.apply_head(p, m.features(p, x)), m.apply(p, x), atol=1e-5)
        assert torch.allclose(m.apply_head(head, m.features(p, x)), m.apply(p, x), atol=1e-5)
    assert build_model("linear", 5, 2).head is None


@pytest.mark.parametrize("cls", [FedPer, FedRep, LGFedAvg, FedBABU, OmniFedge, KNNPer, Moon, FedRoD, FedALA])
def test_a_model_without_a_head_is_a_clear_error(cls, small_data):
    with pytest.raises(ModelError, match="no body/head split"):
        make_sim(cls(), small_data)


@pytest.mark.correctness(
    ("fedper",), "an empty head is FedAvg",
    guards="a body/head split that changes the model (known: a peer library's MLP split keeps a log_softmax "
           "between body and head, measured on the Personalization results page)",
)
def test_fedper_with_an_empty_head_is_fedavg(small_data, mlp):
    no_head = dataclasses.replace(mlp, head=())
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, model=mlp, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(FedPer(), small_data, model=no_head, sampling_rate=0.5), 3)
    _same(sa.server.params, sb.server.params, atol=1e-6)


@pytest.mark.correctness(
    ("fedrep", "fedbabu"), "no head epochs: the body trains under the initial heads, which is FedBABU's training",
    guards="a frozen head that moves",
)
def test_fedrep_without_head_epochs_trains_the_body_under_the_initial_heads(small_data, mlp):
    # head_epochs = 0: no head ever moves, so every client trains the body under the initial head -- FedBABU's
    # training exactly
    rep = make_sim(FedRep(head_epochs=0), small_data, model=mlp, sampling_rate=0.5)
    sr, _ = run_rounds(rep, 3)
    sb, _ = run_rounds(make_sim(FedBABU(), small_data, model=mlp, sampling_rate=0.5), 3)
    _same(sr.server.params, sb.server.params, atol=1e-6)
    heads = all_client_states(rep).head
    for k, v in heads.items():
        assert torch.equal(v, sr.server.fixed[k].expand_as(v))


@pytest.mark.correctness(
    ("fedrep",), "the head trains first (head_epochs), then the body under it",
    guards="head and body trained together (FedPer) under FedRep's name",
)
def test_fedrep_trains_the_head_first_then_the_body(small_data, mlp):
    sim = make_sim(FedRep(head_epochs=2), small_data, model=mlp)
    st, _ = run_rounds(sim, 2)
    heads = all_client_states(sim).head
    body0, _ = mlp.split(mlp.init(7))
    assert any(not torch.equal(st.server.params[k], body0[k]) for k in body0)  # the body moved
    w = heads["2.weight"]
    assert float((w - w[0]).abs().max()) > 1e-3  # and every client has its own head


@pytest.mark.slow
@pytest.mark.parametrize("alg", [FedPer(), FedRep(head_epochs=2), LGFedAvg(), FedBABU(personal_lr=0.1), FedRoD(),
                                 FedALA()],
                         ids=lambda a: a.name)
def test_body_head_methods_personalize_label_permuted_groups(alg, permuted):
    # two groups whose labels are permuted: one global model cannot serve both, a personal head (or body) can
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    opt = SGD(0.1, 0.9)
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=opt, rounds=40, batch_size=32)
    sf, _ = run_rounds(fed, 40)
    sim = make_sim(alg, permuted, model=mlp4, opt=opt, rounds=40, batch_size=32)
    st, _ = run_rounds(sim, 40)
    assert summarize(sim.evaluate(st))["seen_test_acc_mean"] > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.2


@pytest.mark.correctness(
    ("fedala",), "no adapted layers is FedAvg",
    guards="element-wise weights applied outside the adapted layers",
)
def test_fedala_without_adapted_layers_is_fedavg(small_data, mlp):
    # an empty head: no layer is mixed element-wise, every client starts from the global model -- FedAvg
    no_head = dataclasses.replace(mlp, head=())
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, model=mlp, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(FedALA(), small_data, model=no_head, sampling_rate=0.5), 3)
    _same(sa.server.params, sb.server.params, atol=1e-6)


@pytest.mark.correctness(
    ("fedala",), "the weights stay in [0, 1] and are learned from the second round",
    guards="unclipped weights",
)
def test_fedala_learns_weights_in_the_unit_box_from_the_second_round(small_data, mlp):
    sim = make_sim(FedALA(), small_data, model=mlp)
    st = sim.init_state()
    sim.round(st)
    w1 = all_client_states(sim).weights
    assert all(bool((v == 1).all()) for v in w1.values())  # first round: no local model to mix yet
    sim.round(st)
    st2 = all_client_states(sim)
    w2 = st2.weights
    assert all(bool(((v >= 0) & (v <= 1)).all()) for v in w2.values())
    assert any(bool((v < 1).any()) for v in w2.values())
    assert bool((st2.rounds == 2).all())


@pytest.mark.correctness(
    ("pfedhn",), "the server step is the vector-Jacobian product of the clients' changes",
    guards="the hypernetwork stepped on the wrong sign of Delta",
)
def test_pfedhn_server_step_is_the_vector_jacobian_product(small_data):
    # one client per round: phi <- phi - hn_lr (d theta / d phi)^T Delta, checked against autograd on the whole map
    from fedmtl.algorithms.pfedhn import HyperServer

    sim = make_sim(PFedHN(hn_lr=0.5, embed_dim=3, hn_hidden=5, hn_depth=1), small_data, clients_per_round=1)
    st = sim.init_state()
    before = st.server
    plan = sim.plan(st)
    out = sim.clients.train(plan.payload, plan.ids, plan.orders, plan.lr, 0)
    sim.finish(st, plan, out)
    i = int(plan.ids[0])
    alg, ctx = sim.alg, sim.ctx
    flat = {**before.hnet, "v": before.embeddings[i]}
    delta = T.take(out.updates, 0)

    def inner(p):
        theta = alg.generate(ctx, {k: v for k, v in p.items() if k != "v"}, p["v"])
        return sum((theta[k] * delta[k]).sum() for k in theta)

    grads = torch.func.grad(inner)(flat)
    for k in before.hnet:
        assert torch.allclose(st.server.hnet[k], before.hnet[k] - 0.5 * grads[k], atol=1e-6)
    assert torch.allclose(st.server.embeddings[i], before.embeddings[i] - 0.5 * grads["v"], atol=1e-6)
    others = [j for j in range(before.embeddings.shape[0]) if j != i]
    assert torch.equal(st.server.embeddings[others], before.embeddings[others])
    assert isinstance(st.server, HyperServer)


def test_pfedhn_personalizes_label_permuted_groups(permuted):
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=40, batch_size=32)
    sf, _ = run_rounds(fed, 40)
    hn = make_sim(PFedHN(), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=40, batch_size=32)
    sh, _ = run_rounds(hn, 40)
    assert summarize(hn.evaluate(sh))["seen_test_acc_mean"] > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.1


@pytest.mark.correctness(
    ("fedrod",), "class-balanced clients: the generic model is FedAvg's",
    guards="a balanced softmax that is not a shift by log class frequencies",
)
def test_fedrod_generic_model_is_fedavg_on_class_balanced_clients(mlp):
    # balanced labels: log pi is the same for every class, the balanced softmax is plain cross-entropy, so the
    # shared model's local update is FedAvg's (the personal head trains beside it without touching it)
    ctx = Context(mlp, SGD(0.1, 0.9), 1, 1.0)
    p = mlp.init(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 10, generator=g)
    y = torch.tensor([0, 1] * 4).repeat(3, 1)
    b = Batches(x, y, torch.ones(3, 8), torch.arange(24).reshape(3, 8), torch.tensor(24.0))
    from fedmtl.algorithms.fedrod import PersonalHead

    head0 = T.zeros_like(mlp.split(p)[1])
    rod, st, _ = FedRoD().client_update(ctx, p, PersonalHead(head0), b, 0.1)
    avg, _, _ = FedAvg().client_update(ctx, p, (), b, 0.1)
    _same(rod, avg, atol=1e-6)
    assert float(st.head["2.weight"].abs().max()) > 0  # the personal head learned


def test_fedrod_balanced_softmax_shifts_logits_by_log_class_frequencies():
    from fedmtl.algorithms.fedrod import logit_adjustment

    m = build_model("mlp", 4, 3, hidden=(4,))
    shift = logit_adjustment(m, torch.tensor([0, 0, 0, 1, 2, 2]), torch.ones(6))
    assert torch.allclose(shift, torch.log(torch.tensor([0.5, 1 / 6, 1 / 3])))


# ------------------------------------------------------------------------------------------------ kNN-Per, MOON
@pytest.mark.correctness(
    ("knnper",), "interpolation 0 is the global model",
    guards="the kNN memory used when it should not be",
)
def test_knnper_with_interpolation_zero_is_the_global_model(small_data, mlp):
    a = make_sim(FedAvg(), small_data, model=mlp)
    sa, _ = run_rounds(a, 3)
    b = make_sim(KNNPer(interpolation=0.0), small_data, model=mlp)
    sb, _ = run_rounds(b, 3)
    _same(sa.server.params, sb.server.params, atol=0)
    ea, eb = a.evaluate(sa), b.evaluate(sb)
    for group in ea:
        for split in ea[group]:
            assert (ea[group][split]["acc"] == eb[group][split]["acc"]).all()
            assert abs(ea[group][split]["loss"] - eb[group][split]["loss"]).max() < 1e-5


@pytest.mark.correctness(
    ("knnper",), "the kNN prediction by hand",
    guards="neighbours weighted without the temperature",
)
def test_knnper_predicts_by_its_neighbours_by_hand():
    # two stored points; a query next to the first gets its label with weight exp(-d/T) normalized
    m = build_model("mlp", 2, 3, hidden=(2,))
    ctx = Context(m, SGD(0.1), 1, 1.0)
    p = m.init(0)
    alg = KNNPer(interpolation=1.0, k=2, temperature=0.5)
    from fedmtl.algorithms.knnper import Datastore

    keys = torch.tensor([[0.0, 0.0], [3.0, 4.0], [9.0, 9.0]])
    store = Datastore(p, keys, torch.tensor([1, 2, 0]), torch.tensor([1.0, 1.0, 0.0]))  # the third is padding
    x = torch.tensor([[0.0, 0.0]])
    feats = m.features(p, x)
    d = torch.cdist(feats, keys[:2])[0]
    w = torch.softmax(-d / 0.5, 0)
    lp = alg.predict_log_proba(ctx, store, x)[0].exp()
    assert torch.allclose(lp, torch.tensor([0.0, float(w[0]), float(w[1])]), atol=1e-6)


def test_knnper_memorizes_label_permuted_groups(permuted):
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=30, batch_size=32)
    sf, _ = run_rounds(fed, 30)
    knn = make_sim(KNNPer(interpolation=0.9, k=10), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=30, batch_size=32)
    sk, _ = run_rounds(knn, 30)
    assert summarize(knn.evaluate(sk))["seen_test_acc_mean"] > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.1


@pytest.mark.correctness(
    ("moon",), "mu = 0 is FedAvg",
    guards="a contrastive term that stays on",
)
def test_moon_with_mu_zero_is_fedavg(small_data, mlp):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, model=mlp, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(Moon(mu=0.0), small_data, model=mlp, sampling_rate=0.5), 3)
    _same(sa.server.params, sb.server.params, atol=1e-6)


@pytest.mark.correctness(
    ("moon",), "the contrastive loss is log 2 while the three models coincide",
    guards="positive and negative pairs swapped",
)
def test_moon_contrastive_loss_is_log_two_before_the_models_differ(mlp):
    # first step of a first round: the local, global and previous models coincide, so sim(z, z_glob) =
    # sim(z, z_prev) and l_con = log 2 exactly; the step's loss is CE + mu log 2
    ctx = Context(mlp, SGD(0.1), 1, 1.0)
    p = mlp.init(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 16, 10, generator=g), (torch.rand(1, 16, generator=g) > 0.5).long()
    b = Batches(x, y, torch.ones(1, 16), torch.zeros(1, 16, dtype=torch.long), torch.tensor(16.0))
    from fedmtl.algorithms.moon import PreviousModel

    _, _, loss = Moon(mu=2.0).client_update(ctx, p, PreviousModel(p), b, 0.1)
    ce = mlp.loss(p, x[0], y[0], torch.ones(16))
    assert abs(float(loss) - float(ce + 2.0 * torch.log(torch.tensor(2.0)))) < 1e-5


# ------------------------------------------------------------------------------------------------ SCAFFOLD, FedDyn
@pytest.mark.correctness(
    ("scaffold",), "zero control variates: FedAvg for one round",
    guards="a correction applied before the variates exist",
)
def test_scaffold_with_zero_control_variates_is_fedavg_for_one_round(small_data):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, opt=SGD(0.1)), 1)
    sb, _ = run_rounds(make_sim(Scaffold(weighted=True), small_data, opt=SGD(0.1)), 1)
    _same(sa.server.params, sb.server.params, atol=1e-6)


def test_scaffold_server_variate_is_the_mean_of_the_clients(small_data):
    # full participation: c = (1/N) sum_i c_i after every round (the paper's invariant), and option II makes
    # c_i the client's average corrected gradient
    sim = make_sim(Scaffold(), small_data, opt=SGD(0.1))
    st = sim.init_state()
    for _ in range(3):
        sim.round(st)
        ci = all_client_states(sim).c
        _same(st.server.c, T.tmap(lambda v: v.mean(0), ci), atol=1e-6)
    assert float(T.leaves(st.server.c)[0].abs().max()) > 1e-4


@pytest.mark.correctness(
    ("scaffold",), "option II's control variate is the mean local gradient",
    guards="option II's variate without the 1 / (K lr) scale",
)
def test_scaffold_control_variate_is_the_mean_local_gradient_in_one_step(small_data, small_model):
    # one local step: (x - y) / (K lr) is exactly the corrected gradient, so c_i+ = grad f_i(x) at round 1
    ctx = Context(small_model, SGD(0.1), 16, 1.0)
    x = small_model.init(0)
    g = torch.Generator().manual_seed(0)
    xb, yb = torch.randn(1, 8, 10, generator=g), (torch.rand(1, 8, generator=g) > 0.5).long()
    b = Batches(xb, yb, torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.long), torch.tensor(8.0))
    zeros = T.zeros_like(x)
    alg = Scaffold()
    from fedmtl.algorithms.scaffold import ControlVariate, ScaffoldPayload

    _, st, _ = alg.client_update(ctx, ScaffoldPayload(x, zeros), ControlVariate(zeros), b, 0.1)
    ref, _ = small_model.value_and_grad(x, xb[0], yb[0], torch.ones(8))
    _same(st.c, ref, atol=1e-5)


@pytest.mark.correctness(
    ("feddyn",), "alpha = 0 is FedAvg",
    guards="the linear term left on",
)
def test_feddyn_with_alpha_zero_is_fedavg(small_data):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(FedDyn(alpha=0.0, weighted=True), small_data, sampling_rate=0.5), 3)
    _same(sa.server.params, sb.server.params, atol=1e-6)


@pytest.mark.correctness(
    ("feddyn",), "the server's h tracks the clients' gradient states",
    guards="h updated with the participants' mean instead of the population's",
)
def test_feddyn_server_state_tracks_the_clients_gradient_states(small_data):
    # full participation: h = (1/m) sum_k h_k after every round (both start at 0 and take the same steps)
    sim = make_sim(FedDyn(alpha=0.1), small_data, opt=SGD(0.1))
    st = sim.init_state()
    for _ in range(3):
        sim.round(st)
    _same(st.server.h, T.tmap(lambda v: v.mean(0), all_client_states(sim).h), atol=1e-6)


# ------------------------------------------------------------------------------------------------ IFCA
@pytest.mark.correctness(
    ("ifca",), "k = 1 is FedAvg",
    guards="cluster choices by accuracy instead of loss",
)
def test_ifca_with_one_cluster_is_fedavg(small_data):
    """k = 1 with sample-count weights is FedAvg; by client (the paper's model averaging, the default) it is the
    uniform mean of the clients' models, which differs where the clients' sizes do."""
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(IFCA(num_clusters=1, weighted=True), small_data, sampling_rate=0.5), 3)
    _same(sa.server.params, T.take(sb.server.models, 0), atol=1e-6)
    sim = make_sim(IFCA(num_clusters=1), small_data, sampling_rate=0.5)
    st = sim.init_state()
    plan = sim.plan(st)
    out = sim.clients.train(plan.payload, plan.ids, plan.orders, plan.lr, plan.round)
    sim.finish(st, plan, out)
    _same(T.take(st.server.models, 0), T.tmap(lambda u: u.mean(0), out.updates.params), atol=1e-6)
    assert len(set(plan.counts.tolist())) > 1  # the sizes differ: the two means are not the same


@pytest.mark.correctness(
    ("ifca",), "the clusters recover the groups",
    guards="ties between identical initial models",
)
def test_ifca_finds_the_groups(permuted):
    # (with a linear model both initial models fit every client about equally and all clients pick model 0 in the
    # first round: IFCA needs initializations that differ, the paper's random restarts)
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    sim = make_sim(IFCA(num_clusters=2), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=30, batch_size=32)
    st, _ = run_rounds(sim, 30)
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=SGD(0.1, 0.9), rounds=30, batch_size=32)
    sf, _ = run_rounds(fed, 30)
    assert summarize(sim.evaluate(st))["seen_test_acc_mean"] > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.2


# ------------------------------------------------------------------------------------------------ server optimizers
def test_server_sgd_with_rate_one_is_fedavg(small_data):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5), 3)
    eng = make_sim(FedAvg(), small_data, sampling_rate=0.5, server_opt=ServerOptConfig("sgd", 1.0))
    sb, _ = run_rounds(eng, 3)
    _same(sa.server.params, sb.server.params, atol=1e-6)


def test_server_adam_takes_the_papers_step(small_data):
    base = make_sim(FedAvg(), small_data)
    st0 = base.init_state()
    x0 = T.clone(st0.server.params)
    base.round(st0)
    delta = T.sub(st0.server.params, x0)  # what FedAvg's aggregation gives, minus x0
    cfg = ServerOptConfig("adam", lr=0.05, beta1=0.9, beta2=0.99, tau=1e-3)
    eng = make_sim(FedAvg(), small_data, server_opt=cfg)
    st = eng.init_state()
    eng.round(st)
    m = T.scale(delta, 0.1)
    v = T.tmap(lambda d: 0.99 * 1e-6 + 0.01 * d * d, delta)
    _same(st.server.params, T.tmap(lambda x, mm, vv: x + 0.05 * mm / (vv.sqrt() + 1e-3), x0, m, v), atol=1e-6)


@pytest.mark.parametrize("name", ["avgm", "adam", "yogi", "adagrad"])
def test_server_optimizers_resume_exactly(name, small_data):
    from fedmtl.testing import _checkpoint_round_trip, simulator

    def sim(**run):
        return simulator(FedAvg(), small_data, server_opt=ServerOptConfig(name, lr=0.1 if name != "avgm" else 1.0),
                         **run)

    _checkpoint_round_trip(sim)


def test_server_optimizer_refuses_a_method_without_a_global_model(small_data):
    from fedmtl.algorithms import FedEM

    with pytest.raises(ValueError, match="no single global model"):
        make_sim(FedEM(), small_data, server_opt=ServerOptConfig("adam")).init_state()


def test_server_opt_table_is_validated(tmp_path):
    from fedmtl.config import ConfigError, load

    p = tmp_path / "c.toml"
    p.write_text('[data]\nname = "fedem_synthetic"\n[model]\nname = "linear"\n[algorithm]\nname = "fedavg"\n'
                 '[server_opt]\nname = "adamw"\n')
    with pytest.raises(ConfigError, match=r"c.toml: \[server_opt\]\.name"):
        load(p)


# ------------------------------------------------------------------------------------------------ Omni-Fedge
@pytest.mark.correctness(
    ("omnifedge",), "the shared step is the mean of the nodes' steps",
    guards="the Bayesian weights applied twice",
)
def test_omnifedge_shared_step_is_the_mean_of_the_nodes_steps(permuted):
    # the poster's Algorithm 1: (1/N) sum_j sum_i omega_ij grad L_ij -- N = 12 nodes all report each round
    mlp4 = build_model("mlp", 10, 4, hidden=(8,))
    sim = make_sim(OmniFedge(), permuted, model=mlp4, opt=SGD(0.1))
    st = sim.init_state()
    before = T.clone(st.server.shared)
    plan = sim.plan(st)
    out = sim.clients.train(plan.payload, plan.ids, plan.orders, plan.lr, 0)
    sim.finish(st, plan, out)
    step = T.sub(before, st.server.shared)
    _same(step, T.tmap(lambda g: g.sum(0) / 12, out.updates.shared), atol=1e-6)


def test_omnifedge_paper_omega_is_lambda_over_loss_and_simplex_is_an_option():
    alg = OmniFedge(lam=0.5)
    L = torch.tensor([[0.2, 1.0, -1.0], [4.0, 1e-5, 0.5]])
    old = torch.full((2, 3), 7.0)
    w = alg.solve(L, old)
    assert torch.allclose(w, torch.tensor([[2.5, 0.5, 7.0], [0.125, 0.5 / 1e-3, 1.0]]))  # -1: unknown, kept
    s = OmniFedge(omega="simplex").solve(torch.tensor([[0.7, 0.7]]), old[:1, :2])
    assert torch.allclose(s, torch.tensor([[0.5, 0.5]]))


@pytest.mark.slow
def test_omnifedge_learns_personal_heads(permuted):
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    # Omni-Fedge takes one gradient step per round, FedAvg a local epoch (4 steps here): 2x the rounds still
    # gives Omni-Fedge fewer gradient steps
    sim = make_sim(OmniFedge(lam=1.0), permuted, model=mlp4, opt=SGD(0.3), rounds=300, batch_size=32)
    st, _ = run_rounds(sim, 300)
    acc = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=SGD(0.3), rounds=150, batch_size=32)
    sf, _ = run_rounds(fed, 150)
    assert acc > summarize(fed.evaluate(sf))["seen_test_acc_mean"] + 0.1
    om = st.server.omega
    g = torch.as_tensor(permuted.meta["group"])
    same = (g.unsqueeze(0) == g.unsqueeze(1)).float()
    # every network puts more than half of its weight on the nodes of its own group (half the nodes)
    assert bool(((om * same).sum(1) / om.sum(1) > 0.5).all())


# ------------------------------------------------------------------------------------------------ Per-FedAvg
@pytest.mark.correctness(
    ("perfedavg",), "D, D' and D'' are independent batches",
    guards="one batch reused for all three (a biased meta-gradient)",
)
def test_perfedavg_batches_are_independent_draws():
    alg = PerFedAvg()
    counts = torch.tensor([20, 300])
    orders = alg.draw_orders(counts, 1, 32, torch.Generator().manual_seed(0))
    assert orders.local.shape[0] == 3
    small = orders.local[:, :20]
    assert sorted(small[0].tolist()) == list(range(20))  # D: the whole set of the single-batch client
    for role in (1, 2):  # D', D'': drawn with replacement, so not the same set
        assert len(set(small[role].tolist())) < 20 and int(small[role].max()) < 20
    assert not torch.equal(small[1], small[2])
    big = orders.local[:, 20:]
    for role in range(3):  # the larger client: three independent permutations
        assert sorted(big[role].tolist()) == list(range(300))
    assert not torch.equal(big[0, :32], big[1, :32]) and not torch.equal(big[1, :32], big[2, :32])


def test_perfedavg_meta_step_t_takes_batch_t_of_each_role():
    b = _batches(n_steps=6)
    for role in range(3):
        for t in range(4):
            x, _, _ = role_batch(b, role, t)
            assert torch.equal(x, b.x[2 * role + t % 2])
    # all steps at once, under vmap, for clients with different numbers of non-empty batches (one gather)
    half = b.mask * torch.tensor([1.0, 0.0] * 3).unsqueeze(-1)  # the second client: one batch per role
    two = Batches(*(torch.stack([u, v]) for u, v in zip(b[:5], b._replace(mask=half)[:5], strict=True)))
    xs, _, ms = torch.vmap(lambda *f: role_batches(Batches(*f), 5))(*two[:5])
    for role in range(3):
        for t in range(5):
            assert torch.equal(xs[0, role, t], b.x[2 * role + t % 2])
            assert torch.equal(xs[1, role, t], b.x[2 * role]) and bool(ms[1, role, t].all())
    # one batch per role: the same batch every step, without a gather
    one = _batches(n_steps=3)
    xs, _, _ = role_batches(one, 4)
    assert all(torch.equal(xs[r, t], one.x[r]) for r in range(3) for t in range(4))


@pytest.mark.correctness(
    ("perfedavg",), "the Hessian-free step approaches the exact Hessian-vector step",
    guards="a finite-difference Hessian product with the wrong sign or scale",
)
def test_perfedavg_hf_step_approximates_the_exact_hessian_step():
    m = build_model("mlp", 5, 2, hidden=(7,))
    ctx = Context(m, SGD(0.1), 1, 1.0)
    w = {k: v.double() for k, v in m.init(0).items()}
    b = _batches(n_steps=6, dtype=torch.float64)
    kw = {"alpha": 0.3, "beta": 0.2, "local_steps": 4}
    hf, _, _ = PerFedAvg(variant="hf", delta=1e-5, **kw).client_update(ctx, w, (), b, 0.0)
    ex, _, _ = PerFedAvg(variant="exact", **kw).client_update(ctx, w, (), b, 0.0)
    fo, _, _ = PerFedAvg(variant="fo", **kw).client_update(ctx, w, (), b, 0.0)
    err = sum(float(((hf[k] - ex[k]) ** 2).sum()) for k in w) ** 0.5
    gap = sum(float(((fo[k] - ex[k]) ** 2).sum()) for k in w) ** 0.5
    assert gap > 1e-4 and err < 1e-6 * max(gap, 1.0) * 100  # HF matches exact far better than FO does


def test_perfedavg_exact_step_by_hand():
    # one meta-step of the exact variant against the formula with the Hessian built column by column
    m = build_model("linear", 3, 2)
    ctx = Context(m, SGD(0.1), 1, 1.0)
    w = {k: v.double() for k, v in m.init(1).items()}
    b = _batches(n_steps=3, d=3, dtype=torch.float64)
    alg = PerFedAvg(variant="exact", alpha=0.2, beta=0.5, local_steps=1)
    new, _, _ = alg.client_update(ctx, w, (), b, 0.0)
    d1, d2, d3 = [(b.x[i], b.y[i], b.mask[i]) for i in range(3)]
    flat = torch.cat([w["weight"].flatten(), w["bias"]])

    def unflat(v):
        return {"weight": v[:3].reshape(1, 3), "bias": v[3:]}

    def loss(v, d):
        return m.loss(unflat(v), *d)

    g1 = torch.autograd.functional.jacobian(lambda v: loss(v, d1), flat)
    g2 = torch.autograd.functional.jacobian(lambda v: loss(v, d2), flat - 0.2 * g1)
    H = torch.autograd.functional.hessian(lambda v: loss(v, d3), flat)
    ref = flat - 0.5 * (g2 - 0.2 * H @ g2)
    assert torch.allclose(torch.cat([new["weight"].flatten(), new["bias"]]), ref, atol=1e-10)


def test_perfedavg_stragglers_make_fewer_meta_steps():
    alg = PerFedAvg(local_steps=7, alpha=0.1, beta=0.3)
    assert torch.equal(alg.step_budget(torch.tensor([5, 500]), 32, 1), torch.tensor([7, 7]))
    m = build_model("linear", 5, 2)
    ctx = Context(m, SGD(0.1), 1, 1.0)
    w = m.init(0)
    b = _batches(n_steps=6)
    full, _, _ = PerFedAvg(local_steps=3, alpha=0.1, beta=0.3).client_update(ctx, w, (), b, 0.0)
    cut, _, _ = alg.client_update(ctx, w, (), b._replace(limit=torch.tensor(3)), 0.0)
    _same(full, cut, atol=0)  # a limit of 3 meta-steps is exactly local_steps = 3


def test_momentum_weight_sum_is_the_heavy_ball_displacement():
    """K heavy-ball steps on a constant gradient g move by lr g times ``momentum_weight_sum``: SCAFFOLD's option II
    divided by it recovers g exactly, whatever the momentum."""
    from fedmtl.algorithms.scaffold import momentum_weight_sum

    for beta in (0.0, 0.5, 0.9):
        for k in (1, 3, 17):
            buf, moved = 0.0, 0.0
            for _ in range(k):
                buf = beta * buf + 1.0
                moved += buf
            assert abs(float(momentum_weight_sum(torch.tensor(float(k)), beta)) - moved) < 1e-4 * moved


def test_scaffold_with_momentum_keeps_its_control_variates_bounded(small_data):
    """With heavy-ball momentum the paper's option II overestimates the average gradient by up to 1 / (1 - beta)
    and SCAFFOLD diverged silently (FedEM synthetic, momentum 0.9: loss 2.9e34, 51.8% against 68.7% now); with the
    momentum-weighted step count the control variates stay at the scale of a gradient and the loss falls."""
    sim = make_sim(Scaffold(), small_data, opt=SGD(0.1, momentum=0.9))
    st, rows = run_rounds(sim, 15)
    losses = [r["train_loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses) and not any(r["excluded"] for r in rows)
    assert losses[-1] < losses[0]
    assert float(max(x.abs().max() for x in T.leaves(st.server.c))) < 10.0


def test_feddyn_warns_about_momentum_and_its_config_runs_plain_sgd(small_data, caplog):
    """The FedDyn paper runs plain local SGD: the bundled config does, and momentum is named in a warning."""
    import logging

    from fedmtl.config import load

    assert load("synthetic/feddyn").optim.momentum == 0.0
    with caplog.at_level(logging.WARNING, logger="fedmtl"):
        make_sim(FedDyn(), small_data, opt=SGD(0.1))
    assert "momentum" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="fedmtl"):
        make_sim(FedDyn(), small_data, opt=SGD(0.1, momentum=0.9))
    assert "feddyn with optim.momentum = 0.9" in caplog.text


@pytest.mark.correctness(
    ("fedavg+",), "fine-tuning before evaluation runs at the initial rate; the reference code's decayed rate is an "
    "option",
    guards="fine-tuning at a decayed rate that makes FedAvg+ equal FedAvg (known: the FedEM reference code "
           "fine-tunes at the schedule's decayed rate)",
)
def test_personalization_steps_at_the_initial_rate_after_a_decayed_schedule(small_data):
    """At the end of a decayed schedule the round's rate is 1e-3 of the initial one; personalization (FedAvg+'s
    fine-tuning, unseen clients' adaptation) steps at optim.lr, so FedAvg+ still moves away from FedAvg; its
    ``personal_lr`` overrides the rate (the FedEM reference code's decayed rate reproduces FedAvg's evaluation)."""
    from fedmtl.algorithms import FedAvgFT

    opt = SGD(0.1, 0.9, lr_milestone_rounds=(1, 2), lr_gamma=0.1)
    sims = {name: make_sim(alg, small_data, opt=opt) for name, alg in
            {"fedavg": FedAvg(), "fedavg+": FedAvgFT(), "reference": FedAvgFT(personal_lr=1e-5)}.items()}
    res = {}
    for name, sim in sims.items():
        st, _ = run_rounds(sim, 3)
        assert sim.eval_plan(st, "seen")[4] == 0.1  # not the round's 1e-3
        res[name] = summarize(sim.evaluate(st))["seen_test_loss"]
    assert abs(res["reference"] - res["fedavg"]) < 1e-3 < abs(res["fedavg+"] - res["fedavg"])


@pytest.mark.slow
@pytest.mark.correctness(
    ("omnifedge",), "the exact head step equals scikit-learn's logistic regression",
    guards="a head sub-problem that is not solved",
)
def test_omnifedge_exact_head_step_is_scikit_learns_logistic_regression(permuted):
    """``head_step = "exact"`` solves a node's head sub-problem (its loss with the shared layers fixed, plus
    head_l2 / 2 ||W||^2): on a linear softmax head that is multinomial logistic regression on the representation,
    which scikit-learn solves independently (C = 1 / (n head_l2); softmax biases are defined up to a common shift)."""
    from sklearn.linear_model import LogisticRegression

    model = build_model("mlp", 10, 4, hidden=(8,))
    params = model.init(0)
    shared, head = model.split(params, "omnifedge")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 10, generator=g), torch.randint(0, 4, (40,), generator=g)
    alg = OmniFedge(head_step="exact", head_l2=0.1, head_iters=4000, head_tol=1e-9)
    solved = alg.solve_head(lambda h: model.loss({**shared, **h}, x, y, torch.ones(40)), head, 0.5)
    z = model.features(params, x).detach().double().numpy()
    clf = LogisticRegression(C=1 / (40 * 0.1), tol=1e-12, max_iter=100_000).fit(z, y.numpy())
    (wname,) = [k for k, v in solved.items() if v.dim() == 2]
    (bname,) = [k for k, v in solved.items() if v.dim() == 1]
    assert torch.allclose(solved[wname].double(), torch.from_numpy(clf.coef_), atol=2e-4)
    b = solved[bname].double()
    ref = torch.from_numpy(clf.intercept_)
    assert torch.allclose(b - b.mean(), ref - ref.mean(), atol=2e-4)
    # the algorithm runs with it (vmapped over the nodes)
    sim = make_sim(OmniFedge(head_step="exact", head_iters=50), permuted, model=model, opt=SGD(0.1))
    st, rows = run_rounds(sim, 3)
    assert all(math.isfinite(r["train_loss"]) for r in rows)


# ------------------------------------------------------------------------------------------------ FedNova
@pytest.mark.correctness(
    ("fednova",), "equal local steps: FedAvg (the paper's remark)",
    guards="normalization by the number of steps with momentum ignored",
)
def test_fednova_with_equal_local_steps_is_fedavg(small_data):
    """Batch 1000 > every client's data: one step each, tau_i = 1 for all, and FedNova's step is FedAvg's."""
    from fedmtl.algorithms import FedNova

    for opt in (SGD(0.1), SGD(0.1, momentum=0.9)):
        sa, _ = run_rounds(make_sim(FedAvg(), small_data, opt=opt, batch_size=1000), 3)
        sb, _ = run_rounds(make_sim(FedNova(), small_data, opt=opt, batch_size=1000), 3)
        _same(sa.server.params, sb.server.params, atol=1e-6)
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, opt=SGD(0.1)), 2)  # batch 32: unequal steps, not FedAvg
    sb, _ = run_rounds(make_sim(FedNova(), small_data, opt=SGD(0.1)), 2)
    assert max(float((a - b).abs().max()) for a, b in zip(T.leaves(sa.server.params), T.leaves(sb.server.params),
                                                           strict=True)) > 1e-4


def test_fednova_client_sends_the_step_normalized_change(small_model):
    """d_i = (x - y_i) / ||a_i||_1 with ||a_i||_1 = tau_i (plain SGD) or the momentum sum (eq. 7, Appendix), for
    tau_i the steps the client actually ran."""
    from fedmtl.algorithms import FedNova
    from fedmtl.algorithms.scaffold import momentum_weight_sum
    from fedmtl.optim import local_sgd

    x = small_model.init(0)
    g = torch.Generator().manual_seed(3)
    xb, yb = torch.randn(3, 8, 10, generator=g), (torch.rand(3, 8, generator=g) > 0.5).long()
    mask = torch.ones(3, 8)
    mask[2] = 0.0  # an empty third step: not run
    b = Batches(xb, yb, mask, torch.zeros(3, 8, dtype=torch.long), torch.tensor(16.0))
    for beta in (0.0, 0.9):
        ctx = Context(small_model, SGD(0.1, momentum=beta), 16, 1.0)
        upd, _, _ = FedNova().client_update(ctx, x, (), b, 0.1)
        y, _ = local_sgd(small_model.value_and_grad, x, b, 0.1, ctx.opt)
        a = float(momentum_weight_sum(torch.tensor(2.0), beta))
        assert abs(float(upd.a) - a) < 1e-6
        _same(upd.d, T.tmap(lambda p, q, a=a: (p - q) / a, x, y), atol=1e-6)


@pytest.mark.correctness(
    ("fednova",), "on the quadratic example FedNova reaches the true optimum where FedAvg does not (closed forms)",
    guards="tau_eff computed from the planned rather than the executed steps",
)
def test_fednova_removes_the_objective_inconsistency_of_fedavg():
    """The paper's Section 3 example: client i minimizes (1/2)||w - c_i||^2 with tau_i local GD steps of rate eta,
    so y_i = c_i + (1 - eta)^tau_i (x - c_i).  FedAvg's fixed point weights c_i by p_i (1 - (1 - eta)^tau_i)
    (~ p_i tau_i: the clients that step more win), FedNova's by p_i (1 - (1 - eta)^tau_i) / tau_i (~ p_i: the
    global optimum sum_i p_i c_i, to O(eta tau)); both closed forms checked, and FedNova lands near the optimum."""
    from fedmtl.algorithms import FedNova
    from fedmtl.algorithms.base import GlobalModel
    from fedmtl.algorithms.fednova import NovaUpdate

    c = torch.tensor([[0.0, 0.0], [4.0, 2.0], [1.0, -3.0]], dtype=torch.float64)
    tau = torch.tensor([1.0, 5.0, 20.0], dtype=torch.float64)
    n = torch.tensor([30.0, 10.0, 60.0], dtype=torch.float64)
    eta = 0.002
    p = n / n.sum()
    ctx = Context(None, SGD(eta), 100, 1.0)  # type: ignore[arg-type]
    nova, avg = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    for _ in range(1500):
        y = c + (1 - eta) ** tau[:, None] * (nova - c)
        nova = FedNova().aggregate(ctx, GlobalModel({"w": nova}), NovaUpdate({"w": (nova - y) / tau[:, None]}, tau),
                                   n, torch.arange(3)).params["w"]
        avg = (p[:, None] * (c + (1 - eta) ** tau[:, None] * (avg - c))).sum(0)
    shrink = p * (1 - (1 - eta) ** tau)
    assert torch.allclose(avg, (shrink[:, None] * c).sum(0) / shrink.sum(), atol=1e-8)
    assert torch.allclose(nova, ((shrink / tau)[:, None] * c).sum(0) / (shrink / tau).sum(), atol=1e-8)
    opt = (p[:, None] * c).sum(0)
    assert float((nova - opt).norm()) < 0.05 * float((avg - opt).norm())  # FedAvg's lands elsewhere


# ------------------------------------------------------------------------------------------------ q-FFL
@pytest.mark.correctness(
    ("qffl",), "q = 0 is FedAvg",
    guards="h_k without the Lipschitz constant",
)
def test_qffl_with_q_zero_is_fedavg(small_data):
    from fedmtl.algorithms import QFFL

    for run in ({}, {"sampling_rate": 0.5}):
        sa, _ = run_rounds(make_sim(FedAvg(), small_data, **run), 3)
        sb, _ = run_rounds(make_sim(QFFL(q=0.0), small_data, **run), 3)
        _same(sa.server.params, sb.server.params, atol=1e-5)
    sc, _ = run_rounds(make_sim(QFFL(q=2.0), small_data), 3)
    assert max(float((a - b).abs().max()) for a, b in zip(T.leaves(sa.server.params), T.leaves(sc.server.params),
                                                           strict=True)) > 1e-3


def test_qffl_client_message_is_algorithm_2s(small_model):
    """Delta_k = F_k(w)^q L (w - w_k), h_k = q F_k^(q-1) ||L (w - w_k)||^2 + L F_k^q, F_k at the received w."""
    from fedmtl.algorithms import QFFL
    from fedmtl.optim import local_sgd

    x = small_model.init(0)
    g = torch.Generator().manual_seed(4)
    xb, yb = torch.randn(2, 8, 10, generator=g), (torch.rand(2, 8, generator=g) > 0.5).long()
    b = Batches(xb, yb, torch.ones(2, 8), torch.zeros(2, 8, dtype=torch.long), torch.tensor(16.0))
    ctx = Context(small_model, SGD(0.1), 16, 1.0)
    q, lr = 1.5, 0.1
    upd, _, _ = QFFL(q=q).client_update(ctx, x, (), b, lr)
    y, _ = local_sgd(small_model.value_and_grad, x, b, lr, ctx.opt)
    f = float(small_model.loss(x, xb.reshape(16, 10), yb.reshape(16), torch.ones(16)))
    dw = T.tmap(lambda p, r: (p - r) / lr, x, y)
    _same(upd.delta, T.tmap(lambda v: f**q * v, dw), atol=1e-5)
    sq = sum(float((v**2).sum()) for v in T.leaves(dw))
    assert abs(float(upd.h) - (q * f ** (q - 1) * sq + f**q / lr)) < 1e-4 * float(upd.h)


@pytest.mark.slow
@pytest.mark.correctness(
    ("qffl",), "the fixed point minimizes f_q (scipy)",
    guards="F_k^q taken at the local instead of the global model",
)
def test_qffedavg_fixed_point_minimizes_the_q_ffl_objective():
    """One local GD step on F_k(w) = ||w - c_k||^2 / 2 + 1/2 makes L (w - w_k) = grad F_k(w), so q-FedAvg's fixed point
    is where sum_k p_k F_k^q grad F_k = 0: the minimizer of f_q = sum_k p_k F_k^(q+1) / (q+1) (scipy's, independent).
    Larger q moves it towards the worst-off client."""
    import numpy as np
    from scipy.optimize import minimize

    from fedmtl.algorithms import QFFL
    from fedmtl.algorithms.base import GlobalModel
    from fedmtl.algorithms.qffl import QUpdate

    c = torch.tensor([[0.0, 0.0], [3.0, 1.0], [-1.0, 4.0]], dtype=torch.float64)
    n = torch.tensor([50.0, 30.0, 20.0], dtype=torch.float64)
    p, lr = n / n.sum(), 0.1
    ctx = Context(None, SGD(lr), 100, 1.0)  # type: ignore[arg-type]
    worst = []
    for q in (0.0, 1.0, 5.0):
        w = torch.zeros(2, dtype=torch.float64)
        for _ in range(3000):
            f = 0.5 * ((w - c) ** 2).sum(1) + 0.5
            dw = w - c  # L (w - w_k) with w_k = w - lr (w - c_k), L = 1 / lr
            h = q * f ** (q - 1) * (dw**2).sum(1) + f**q / lr
            w_new = QFFL(q=q).aggregate(ctx, GlobalModel({"w": w}), QUpdate({"w": f[:, None] ** q * dw}, h), n,
                                        torch.arange(3)).params["w"]
            # the step is a function of w alone: an exact (bitwise) fixed point stays put, so stopping there gives
            # the same w as the full 3000 iterations (reached after ~230-330 here)
            done = torch.equal(w_new, w)
            w = w_new
            if done:
                break

        def fq(v, q=q):
            f = 0.5 * ((v[None, :] - c.numpy()) ** 2).sum(1) + 0.5
            return float((p.numpy() * f ** (q + 1)).sum() / (q + 1))

        ref = minimize(fq, np.zeros(2), method="Nelder-Mead",
                       options={"xatol": 1e-10, "fatol": 1e-14, "maxiter": 20000})
        assert np.allclose(w.numpy(), ref.x, atol=1e-5), (q, w, ref.x)
        worst.append(float((0.5 * ((w - c) ** 2).sum(1)).max()))
    assert worst[0] > worst[1] > worst[2]  # fairer: the largest client loss falls as q grows


# ------------------------------------------------------------------------------------------------ FedLC
@pytest.mark.correctness(
    ("fedlc",), "tau = 0 is FedAvg",
    guards="margins from global instead of local class counts",
)
def test_fedlc_with_tau_zero_is_fedavg(small_data):
    from fedmtl.algorithms import FedLC

    sa, _ = run_rounds(make_sim(FedAvg(), small_data), 3)
    sb, _ = run_rounds(make_sim(FedLC(tau=0.0), small_data), 3)
    _same(sa.server.params, sb.server.params, atol=1e-5)
    sc, _ = run_rounds(make_sim(FedLC(tau=1.0), small_data), 3)  # the calibration changes the training
    assert max(float((a - b).abs().max()) for a, b in zip(T.leaves(sa.server.params), T.leaves(sc.server.params),
                                                           strict=True)) > 1e-4


@pytest.mark.correctness(
    ("fedlc",), "margins tau n_y^(-1/4) and the calibrated loss by hand; a missing class is not pushed down",
    guards="n^(+1/4) instead of n^(-1/4); padding counted as examples",
)
def test_fedlc_margins_and_calibrated_loss_by_hand():
    """Delta_y = tau n_y^{-1/4}; the loss is the softmax cross-entropy of f - Delta ("all") or its normalizer without
    the true class ("others"); a class the client lacks gets no push-down gradient, unlike plain cross-entropy."""
    from fedmtl.algorithms.fedlc import calibrated_nll, label_margins

    m = build_model("mlp", 4, 3, hidden=(4,))
    y = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    mask = torch.ones(24)
    mask[-2:] = 0.0  # padding does not count: 16 of class 0, 6 of class 1, none of class 2
    d = label_margins(m, y, mask, 2.0)
    assert torch.allclose(d[:2], 2.0 * torch.tensor([16.0, 6.0]) ** -0.25)
    assert float(d[2]) == pytest.approx(200.0)  # n = 1e-8
    f = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]], requires_grad=True)
    yy = torch.tensor([0, 1])
    z = f.detach() - d
    want_all = torch.logsumexp(z, -1) - z[[0, 1], [0, 1]]
    want_others = torch.stack([torch.logsumexp(z[0, [1, 2]], 0) - z[0, 0], torch.logsumexp(z[1, [0, 2]], 0) - z[1, 1]])
    assert torch.allclose(calibrated_nll(m, f.detach(), yy, d, False), want_all)
    assert torch.allclose(calibrated_nll(m, f.detach(), yy, d, True), want_others)
    calibrated_nll(m, f, yy, d, False).sum().backward()
    assert float(f.grad[:, 2].abs().max()) < 1e-30  # the missing class: not pushed down
    g = torch.autograd.grad(m.nll(f, yy).sum(), f)[0]
    assert float(g[:, 2].min()) > 1e-3  # plain cross-entropy pushes it down
    # binary models: one logit z read as (0, z)
    b = build_model("linear", 4, 2)
    zb = torch.tensor([0.7, -0.2])
    db = label_margins(b, torch.tensor([0, 1, 1]), torch.ones(3), 0.0)
    assert torch.allclose(calibrated_nll(b, zb, torch.tensor([1, 0]), db, False), b.nll(zb, torch.tensor([1, 0])))


# ------------------------------------------------------------------------------------------------ FedAMP
@pytest.mark.correctness(
    ("fedamp",), "attention weights and cloud models by hand (exp and cosine)",
    guards="self-weights that do not make the rows sum to one",
)
def test_fedamp_attention_and_cloud_models_by_hand():
    from fedmtl.algorithms import FedAMP

    w = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    alg = FedAMP(sigma=2.0, alpha=0.5)
    d = torch.cdist(w.double(), w.double()) ** 2
    xi = 0.5 * torch.exp(-d / 2.0) / 2.0  # alpha A'(||w_i - w_j||^2), A'(x) = exp(-x / sigma) / sigma
    xi.fill_diagonal_(0.0)
    xi += torch.diag(1.0 - xi.sum(1))
    assert torch.allclose(alg.attention_weights(w), xi)
    b = torch.tensor([1.0, 2.0, 4.0])
    u = alg.cloud_models({"w": w.reshape(3, 2, 1), "b": b})  # distances over every parameter: w and b
    full = torch.cat([w, b[:, None]], 1).double()
    xi = 0.5 * torch.exp(-torch.cdist(full, full) ** 2 / 2.0) / 2.0
    xi.fill_diagonal_(0.0)
    xi += torch.diag(1.0 - xi.sum(1))
    assert torch.allclose(u["w"].reshape(3, 2), (xi @ w.double()).float(), atol=1e-6)
    assert torch.allclose(u["b"], (xi @ b.double()).float(), atol=1e-6)
    # identical models: xi_ij = alpha / sigma, and xi_ii what is left (negative when that exceeds 1, as in eq. 5)
    same = FedAMP(sigma=2.0, alpha=1.0).attention_weights(torch.ones(4, 5))
    assert torch.allclose(same, (torch.ones(4, 4) - 2 * torch.eye(4)).double() / 2)
    # HeurFedAMP: xi_ii = self_weight, the rest a softmax of sigma * cos over the others
    heur = FedAMP(attention="cosine", sigma=5.0, self_weight=0.3).attention_weights(w + 1.0)
    unit = torch.nn.functional.normalize((w + 1.0).double(), dim=1)
    cos = unit @ unit.T
    for i in range(3):
        others = [j for j in range(3) if j != i]
        soft = torch.softmax(5.0 * cos[i, others], 0)
        assert abs(float(heur[i, i]) - 0.3) < 1e-12
        assert torch.allclose(heur[i, others], 0.7 * soft)


@pytest.mark.correctness(
    ("fedamp",), "no attention and lambda = 0 is Local",
    guards="defaults (sigma far below the models' distances) that silently make FedAMP local training",
)
def test_fedamp_without_attention_or_proximal_term_is_local_training(small_data):
    """sigma far below the clients' squared distances and lambda = 0: every cloud model is the client's own model, the
    local objective has no proximal term, and FedAMP's personal models are Local's."""
    from fedmtl.algorithms import FedAMP, Local

    a = make_sim(Local(), small_data, opt=SGD(0.1))
    sa, _ = run_rounds(a, 3)
    b = make_sim(FedAMP(lam=0.0, sigma=1e-9, alpha=1e-9), small_data, opt=SGD(0.1))
    sb, _ = run_rounds(b, 3)
    _same(all_client_states(a).params, all_client_states(b).params, atol=1e-6)
    c = make_sim(FedAMP(sigma=10.0), small_data, opt=SGD(0.1))  # with attention, the clients share
    sc, _ = run_rounds(c, 3)
    assert max(float((x - y).abs().max()) for x, y in zip(T.leaves(all_client_states(a).params),
                                                           T.leaves(all_client_states(c).params), strict=True)) > 1e-3


@pytest.mark.correctness(
    ("lgfedavg",), "only the head travels; the server's head is the weighted mean of the clients' heads; bodies stay "
    "per client",
    guards="bodies averaged (FedAvg under another name)",
)
def test_lgfedavg_shares_the_head_and_keeps_the_bodies(small_data, mlp):
    """Only the head travels: the server's head is the sample-weighted mean of the clients' trained heads, and each
    client keeps its own body."""
    e = make_sim(LGFedAvg(), small_data, model=mlp, opt=SGD(0.1))
    st = e.init_state()
    plan = e.plan(st)
    out = e.clients.train(plan.payload, plan.ids, plan.orders, plan.lr, plan.round)
    e.finish(st, plan, out)
    body, head = mlp.split(mlp.init(0))
    assert set(st.server.params) == set(head) and set(out.updates) == set(head)
    _same(st.server.params, T.weighted_mean(out.updates, plan.counts.to(torch.float64)), atol=1e-6)
    bodies = all_client_states(e).body
    assert set(bodies) == set(body)
    w = next(iter(bodies.values()))
    assert float((w[plan.ids[0]] - w[plan.ids[1]]).abs().max()) > 1e-4
