"""MR-MTL, FENDA-FL, FedDBE and FedCAC: each against its defining property (reductions to existing methods, closed
forms and hand computations on tiny federations)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import MRMTL, FedAvg, FedCAC, FedDBE, FendaFL, Local
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.fedcac import CACClient, CACUpdate, critical_mask
from fedmtl.algorithms.feddbe import PRBMState
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, local_sgd

from .conftest import all_client_states, make_sim, run_rounds
from .conftest import same_trees as _same
from .test_personalization import _batches


def _spread(models):
    """The largest distance of a personal model (stacked (N, ...)) to the mean of all of them."""
    flat = torch.cat([v.reshape(v.shape[0], -1) for v in models.values()], 1)
    return float((flat - flat.mean(0)).norm(dim=1).max())


# ------------------------------------------------------------------------------------------------------------ MR-MTL
@pytest.mark.correctness(
    ("mrmtl",), "lambda = 0 is Local training (personal models equal bit for bit); with full participation the "
    "server's model is the uniform mean of the personal models",
    guards="personal models reset to the broadcast mean each round (FedAvg-like), or a Ditto-style separate global "
    "model instead of the mean of the personal ones",
)
def test_mrmtl_without_penalty_is_local_and_its_server_keeps_the_mean(small_data):
    mr = make_sim(MRMTL(lam=0.0), small_data, rounds=3)
    run_rounds(mr, 3)
    loc = make_sim(Local(), small_data, rounds=3)
    run_rounds(loc, 3)
    _same(all_client_states(mr).w, all_client_states(loc).params, atol=0)
    mr = make_sim(MRMTL(lam=0.5), small_data, rounds=3)
    st, _ = run_rounds(mr, 3)
    seen = torch.arange(mr.fed.num_clients)
    personal = mr.clients.read(seen).w  # every seen client trained every round (full participation)
    _same(st.server.params, T.tmap(lambda v: v.mean(0), personal), atol=1e-6)


@pytest.mark.correctness(
    ("mrmtl",), "the personal models' spread around their mean shrinks as lambda grows (lambda = 30 under a quarter "
    "of Local's spread)", guards="the proximal pull applied with the wrong sign or towards the client's own start",
)
def test_mrmtl_large_penalty_pins_personal_models_to_their_mean(small_data):
    opt = SGD(lr=0.05)  # plain SGD: lr x lambda < 2 keeps the explicit proximal step stable
    spread = {}
    for lam in (0.0, 3.0, 30.0):
        sim = make_sim(MRMTL(lam=lam), small_data, opt=opt, rounds=5)
        run_rounds(sim, 5)
        spread[lam] = _spread(sim.clients.read(torch.arange(sim.fed.num_clients)).w)
    assert spread[0.0] > spread[3.0] > spread[30.0], spread
    assert spread[30.0] < 0.25 * spread[0.0], spread


# ---------------------------------------------------------------------------------------------------------- FENDA-FL
@pytest.mark.correctness(
    ("fenda_fl",), "one client's round equals a hand-written FENDA model (two ReLU extractors, a Linear head over "
    "their concatenation) trained by plain SGD with autograd; only the global extractor is sent, the local one and "
    "the head are kept, and an unseen client's global extractor stays the received one",
    guards="representations summed instead of concatenated, the local extractor or the head left untrained or "
    "sent to the server, the global extractor not trained locally",
)
def test_fenda_fl_round_equals_a_hand_written_two_extractor_model():
    model = build_model("mlp", 10, 3, hidden=(6,))
    alg = FendaFL()
    ctx = Context(model, SGD(0.1), 4, 100.0)
    server = alg.init_server(ctx, model.init(0), seed=0)
    state = alg.init_client(ctx, server)
    batches = _batches(n_steps=4, b=8, d=10, seed=3)
    batches = batches._replace(y=(batches.y + torch.arange(8) % 2).long())  # labels 0, 1 and 2
    sent, new, _ = alg.client_update(ctx, server.params, state, batches, 0.1)

    p = {"g1": server.params["0.weight"], "gb": server.params["0.bias"], "l1": state.local["0.weight"],
         "lb": state.local["0.bias"], "w": state.head["2.weight"], "b": state.head["2.bias"]}
    assert p["w"].shape == (3, 12)  # the head maps the 2 x 6 concatenated features
    p = {k: v.clone().requires_grad_() for k, v in p.items()}
    for s in range(4):
        zg = torch.relu(batches.x[s] @ p["g1"].T + p["gb"])
        zl = torch.relu(batches.x[s] @ p["l1"].T + p["lb"])
        logits = torch.cat([zg, zl], 1) @ p["w"].T + p["b"]
        loss = torch.nn.functional.cross_entropy(logits, batches.y[s])
        grads = torch.autograd.grad(loss, list(p.values()))
        p = {k: (v - 0.1 * g).detach().requires_grad_() for (k, v), g in zip(p.items(), grads, strict=True)}
    assert set(sent) == {"0.weight", "0.bias"}  # only theta_G goes to the server
    _same(sent, {"0.weight": p["g1"], "0.bias": p["gb"]}, atol=1e-5)
    _same(new.local, {"0.weight": p["l1"], "0.bias": p["lb"]}, atol=1e-5)
    _same(new.head, {"2.weight": p["w"], "2.bias": p["b"]}, atol=1e-5)
    ev = alg.personalize(ctx, server.params, state, batches, 0.1, seen=False)
    _same(ev.glob, server.params, atol=0)
    assert not torch.equal(ev.local["0.weight"], state.local["0.weight"])


# ------------------------------------------------------------------------------------------------------------ FedDBE
def _three_class(batches):
    return batches._replace(y=(batches.y + torch.arange(batches.y.shape[-1]) % 2).long())


@pytest.mark.correctness(
    ("feddbe",), "hand computations: the initialization round trains as FedAvg and sends the running mean of the "
    "representations (momentum mu) that the server averages by counts into the fixed consensus; then one step equals "
    "autograd on CE(g(f(x) + z_p), y) + kappa mean((mu mean f(x) - z_g)^2 / 2) over f, g and the PRBM z_p",
    guards="the PRBM added after the head or never trained, the consensus recomputed every round, the running mean "
    "not reset or its momentum reversed, the regularizer's scale (sum for mean) or sign wrong",
)
def test_feddbe_initialization_round_consensus_and_regularized_step_by_hand():
    model = build_model("mlp", 10, 3, hidden=(6,))
    alg = FedDBE(kappa=5.0, mu=0.5)
    ctx = Context(model, SGD(0.1), 2, 100.0)
    server = alg.init_server(ctx, model.init(0), seed=0)
    means, sent = [], []
    for seed in (1, 2):
        b = _three_class(_batches(n_steps=3, b=8, d=10, seed=seed))
        upd, st, _ = alg.client_update(ctx, server, alg.init_client(ctx, server), b, 0.1)
        ref, _ = FedAvg().client_update(ctx, server.params, (), b, 0.1)[:2]
        _same(upd.params, ref, atol=1e-6)  # the initialization round is FedAvg's training
        assert torch.equal(st.prbm, torch.zeros(6))
        running = torch.zeros(6)
        for s in range(3):  # z_bar^g_i <- (1 - mu) z_bar^g_i + mu mean f(x_s), under the model before step s
            w = local_sgd(model.value_and_grad, server.params, b, 0.1, ctx.opt, steps=slice(0, s))[0]
            running = 0.5 * running + 0.5 * model.features(w, b.x[s]).mean(0)
        assert torch.allclose(upd.mean, running, atol=1e-6)
        means.append(running)
        sent.append(upd)
    stacked = T.tmap(lambda *v: torch.stack(v), *sent)
    server = alg.aggregate(ctx, server, stacked, torch.tensor([1.0, 3.0]), torch.arange(2))
    assert float(server.ready) == 1.0
    assert torch.allclose(server.mean, 0.25 * means[0] + 0.75 * means[1], atol=1e-6)
    again = alg.aggregate(ctx, server, stacked._replace(mean=stacked.mean + 1.0), torch.ones(2), torch.arange(2))
    assert torch.equal(again.mean, server.mean)  # fixed after the initialization round

    b = _three_class(_batches(n_steps=1, b=8, d=10, seed=4))
    zp = torch.randn(6, generator=torch.Generator().manual_seed(5))
    upd, st, _ = alg.client_update(ctx, server, PRBMState(zp), b, 0.1)
    q = {"w0": server.params["0.weight"], "b0": server.params["0.bias"], "w2": server.params["2.weight"],
         "b2": server.params["2.bias"], "zp": zp}
    q = {k: v.clone().requires_grad_() for k, v in q.items()}
    z = torch.relu(b.x[0] @ q["w0"].T + q["b0"])
    ce = torch.nn.functional.cross_entropy((z + q["zp"]) @ q["w2"].T + q["b2"], b.y[0])
    reg = (0.5 * (0.5 * z.mean(0) - server.mean) ** 2).mean()  # the running mean reset to 0 at the round's start
    grads = dict(zip(q, torch.autograd.grad(ce + 5.0 * reg, list(q.values())), strict=True))
    step = {k: (q[k] - 0.1 * grads[k]).detach() for k in q}
    _same(upd.params, {"0.weight": step["w0"], "0.bias": step["b0"], "2.weight": step["w2"], "2.bias": step["b2"]},
          atol=1e-6)
    assert torch.allclose(st.prbm, step["zp"], atol=1e-6)


# ------------------------------------------------------------------------------------------------------------ FedCAC
@pytest.mark.correctness(
    ("fedcac",), "hand computations: the critical mask is the top-tau fraction of |update x value| per tensor (with "
    "the authors' fallback for a zero threshold); overlaps 1 - |u_i - u_j|_1 / (2|u_i|_1), a threshold rising from "
    "their mean to their maximum over beta rounds, customized models as uniform means over the collaborators (not "
    "symmetric), and the next start taking critical parameters from the customized model, the rest from the global",
    guards="sensitivity of the value or of the update alone, a threshold at zero marking untouched parameters "
    "critical, a symmetric or fixed collaboration threshold, critical and non-critical parts swapped",
)
def test_fedcac_critical_parameters_and_collaboration_by_hand():
    mask = critical_mask(torch.tensor([0.0, 0.0, 2.0, 0.5]), torch.tensor([1.0, -2.0, 3.0, 0.5]), 0.5)
    assert mask.tolist() == [0.0, 1.0, 1.0, 0.0]  # sensitivities 1, 4, 3, 0: the top 2
    mask = critical_mask(torch.tensor([1.0, 2.0, 3.0, 3.9]), torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.5)
    assert mask.tolist() == [0.0, 0.0, 0.0, 1.0]  # threshold 0: the smallest nonzero sensitivity instead
    assert critical_mask(torch.ones(3), 2 * torch.ones(3), 0.3).sum() == 0  # int(0.3 x 3) = 0 critical

    alg = FedCAC(tau=0.5, beta=2)
    model = build_model("linear", 4, 2)
    ctx = Context(model, SGD(0.1), 3, 30.0)
    server = alg.init_server(ctx, model.init(0), seed=0)
    g = torch.Generator().manual_seed(0)
    w = {k: torch.randn(3, *v.shape, generator=g) for k, v in server.params.items()}
    u = {"weight": torch.tensor([[[1.0, 1, 0, 0]], [[1, 1, 1, 0]], [[0, 0, 1, 1]]]), "bias": torch.zeros(3, 1)}
    # overlaps: o_12 = 3/4, o_21 = 5/6, o_13 = o_31 = 0, o_23 = 1/2, o_32 = 1/4; mean 7/18, max 5/6
    weights = torch.tensor([10.0, 10.0, 20.0])
    s1 = alg.aggregate(ctx, server, CACUpdate(w, u), weights, torch.arange(3))
    _same(s1.params, T.tmap(lambda v: (v * weights.view(3, *[1] * (v.dim() - 1))).sum(0) / 40, w))
    # t = 1: theta = 7/18 + (1/2)(5/6 - 7/18) = 11/18: clients 1 and 2 collaborate, 3 alone
    pair = T.tmap(lambda v: (v[0] + v[1]) / 2, w)
    _same(T.tmap(lambda v: v[0], s1.custom), pair)
    _same(T.tmap(lambda v: v[1], s1.custom), pair)
    _same(T.tmap(lambda v: v[2], s1.custom), T.tmap(lambda v: v[2], w))
    # t = 2 = beta: theta = the largest overlap, 5/6: client 2 still takes client 1's parameters, not the reverse
    s2 = alg.aggregate(ctx, s1, CACUpdate(w, u), weights, torch.arange(3))
    _same(T.tmap(lambda v: v[0], s2.custom), T.tmap(lambda v: v[0], w))
    _same(T.tmap(lambda v: v[1], s2.custom), pair)
    # the next start of client 1: its critical parameters from its customized model, the others from the global one
    state = CACClient(torch.tensor(1), T.tmap(lambda m: m[1], u))
    start = alg.start(s2, state)
    expect = torch.where(u["weight"][1] > 0, pair["weight"], s2.params["weight"])
    assert torch.allclose(start["weight"], expect) and torch.equal(start["bias"], s2.params["bias"])


@pytest.mark.correctness(
    ("fedcac",), "tau = 0 (no critical parameters) is FedAvg, and every client predicts with the global model",
    guards="non-critical parameters not taken from the global model, a mask that marks parameters with tau = 0",
)
def test_fedcac_without_critical_parameters_is_fedavg(small_data):
    cac = make_sim(FedCAC(tau=0.0), small_data, sampling_rate=0.5, rounds=3)
    sc, _ = run_rounds(cac, 3)
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5, rounds=3), 3)
    _same(sc.server.params, sa.server.params, atol=1e-6)
    state = cac.clients.read(torch.arange(2))
    assert all(float(v.abs().sum()) == 0 for v in state.mask.values())


@pytest.mark.parametrize("cls", [FendaFL, FedDBE])
def test_a_model_without_a_linear_head_is_refused_naming_the_method(cls, small_data):
    with pytest.raises(ModelError, match=f"{cls.name} .*no body/head split"):
        make_sim(cls(), small_data)  # the linear model: no body
    if cls is not FendaFL:
        return
    deep = build_model("mlp", 10, 2, hidden=(4, 4))
    deep = dataclasses.replace(deep, head=("2.weight", "2.bias", "4.weight", "4.bias"))
    with pytest.raises(ModelError, match=cls.name):
        cls().check_model(deep)  # a head of two layers


# ------------------------------------------------------------------------------------------------- bundled configs
@pytest.mark.parametrize("name", ["mrmtl", "fenda_fl", "feddbe", "fedcac"])
def test_bundled_configs_build_their_method_on_local_s_settings(name):
    from fedmtl import config

    path = Path(__file__).resolve().parents[1] / f"src/fedmtl/configs/fmnist/{name}.toml"
    alg = config.load(path).build_algorithm()
    assert alg.name == name
    raw, local = config.read_toml(path), config.read_toml(path.parent / "local.toml")
    for table in ("data", "model", "optim", "run"):  # compares directly with Local
        assert raw[table] == local[table], table
