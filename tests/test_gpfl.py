"""GPFL (Zhang et al., ICCV 2023): the contract, the angle- and magnitude-level guidance losses (Eq. 8, 9) and the
Conditional Valve with its conditional inputs (Eq. 3-7) by hand, the local objective of Eq. (11) on one step, the
frozen embeddings of L^mlg, the reduction to FedPer without CoV and GCE (Table 6's variant (e)) on a local step,
personalization of label-permuted groups that FedAvg cannot serve, and FedBuff with a buffer of every client."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedmtl import tree as T
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.fedavg import FedAvg
from fedmtl.algorithms.fedper import FedPer, PersonalHead
from fedmtl.algorithms.gpfl import (
    GPFL,
    GPClient,
    GPServer,
    GPShared,
    angle_guidance,
    class_proportions,
    conditional_inputs,
    magnitude_guidance,
    valve,
)
from fedmtl.data.synthetic import permuted_groups
from fedmtl.engine.async_config import AsyncConfig
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds


def test_refuses_a_model_without_a_head(small_model):
    with pytest.raises(ModelError, match="gpfl"):
        GPFL().check_model(small_model)
    with pytest.raises(ValueError, match="lam"):
        GPFL(lam=-1.0)
    with pytest.raises(ValueError, match="mu"):
        GPFL(mu=-0.1)


def _batches(s: int, b: int, d: int, classes: int, seed: int) -> Batches:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, d, generator=g)
    y = torch.randint(0, classes, (s, b), generator=g)
    mask = torch.ones(s, b)
    return Batches(x, y, mask, torch.arange(s * b).reshape(s, b), mask.sum())


def _ctx(model, opt=None) -> Context:
    return Context(model, opt or SGD(0.1), 1, 1.0)


@pytest.mark.correctness(
    ("gpfl",), "the angle-level guidance (Eq. 8: softmax cross-entropy of the cosines to the trained embeddings) and "
    "the magnitude-level guidance (Eq. 9: the unsquared L2 distance to the example's frozen embedding) by hand",
    guards="dot products instead of cosines (the feature's magnitude entering L^alg), a squared or mean-squared "
    "distance in L^mlg, the wrong class's embedding as the target",
)
def test_guidance_losses_by_hand():
    c = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, -1.0]])  # three embeddings, K = 2
    f = torch.tensor([[5.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # the last f^G all zero: every cosine 0
    y = torch.tensor([0, 1, 2])
    r = 1 / math.sqrt(2)
    cos = [[1.0, 0.0, -r], [r, r, -1.0], [0.0, 0.0, 0.0]]
    want = [-c_[i] + math.log(sum(math.exp(v) for v in c_)) for i, c_ in zip(y.tolist(), cos, strict=True)]
    got = angle_guidance(f, c, y)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert abs(float(got[2]) - math.log(3)) < 1e-6
    # magnitude: ||f - C_y||: |(5,0) - (2,0)| = 3, |(1,1) - (0,3)| = sqrt(5), |(0,0) - (-1,-1)| = sqrt(2)
    assert torch.allclose(magnitude_guidance(f, c, y), torch.tensor([3.0, math.sqrt(5), math.sqrt(2)]), atol=1e-6)
    # scaling a feature changes L^mlg but not L^alg
    assert torch.allclose(angle_guidance(3 * f, c, y), got, atol=1e-6)
    # at zero distance the loss is 0 with a zero (not NaN) gradient
    fz = c[:1].clone().requires_grad_()
    magnitude_guidance(fz, c, y[:1]).sum().backward()
    assert fz.grad is not None and torch.equal(fz.grad, torch.zeros_like(fz))


@pytest.mark.correctness(
    ("gpfl",), "the Conditional Valve and its conditional inputs by hand: g the mean of the frozen embeddings (Eq. "
    "5), p_i their alpha_i-weighted sum / U (Eq. 6-7), gamma and beta from FC-ReLU-LayerNorm of the conditional "
    "input (Eq. 4), ReLU[(gamma + 1) f + beta] (Eq. 3); a client predicts with its head on f^P",
    guards="gamma used without the + 1 (the feature multiplied by gamma alone), the feature fed to the sub-modules, "
    "p_i not weighted by the class proportions, the global route used at inference",
)
def test_valve_conditional_inputs_and_prediction_by_hand():
    g = torch.Generator().manual_seed(0)
    k, u = 3, 4
    cov = {f"{part}.{name}": torch.randn(shape, generator=g) for part in ("gamma", "beta")
           for name, shape in (("fc.weight", (k, k)), ("fc.bias", (k,)), ("norm.weight", (k,)), ("norm.bias", (k,)))}
    c = torch.randn(u, k, generator=g)
    y = torch.tensor([0, 0, 0, 2, 5, 1])
    alpha = class_proportions(build_model("mlp", 2, u, hidden=(k,)), y, torch.tensor([1.0, 1, 1, 1, 0, 1]))
    assert torch.allclose(alpha, torch.tensor([0.6, 0.2, 0.2, 0.0]))  # the padded example (label 5) left out
    gi, pi = conditional_inputs(c, alpha)
    assert torch.allclose(gi, c.mean(0), atol=1e-6)
    assert torch.allclose(pi, (0.6 * c[0] + 0.2 * c[1] + 0.2 * c[2]) / 4, atol=1e-6)

    def sub(part, v):  # FC, ReLU, LayerNorm written out
        z = torch.relu(cov[f"{part}.fc.weight"] @ v + cov[f"{part}.fc.bias"])
        z = (z - z.mean()) / torch.sqrt(z.var(unbiased=False) + 1e-5)
        return z * cov[f"{part}.norm.weight"] + cov[f"{part}.norm.bias"]

    f = torch.randn(5, k, generator=g)
    want = torch.relu((sub("gamma", pi) + 1) * f + sub("beta", pi))
    assert torch.allclose(valve(cov, f, pi), want, atol=1e-5)
    assert not torch.allclose(valve(cov, f, gi), want, atol=1e-3)  # the two routes differ

    # prediction: the personalized route through the model's own head
    mlp = build_model("mlp", 2, u, hidden=(k,))
    params = mlp.init(1)
    body, head = mlp.split(params)
    alg = GPFL()
    ctx = _ctx(mlp)
    ev = alg.personalize(ctx, GPShared(body, cov, c), GPClient(head, alpha), None, 0.1, True)
    x = torch.randn(5, 2, generator=g)
    h = torch.relu(x @ params["0.weight"].T + params["0.bias"])
    out = valve(cov, h, pi) @ params["2.weight"].T + params["2.bias"]
    assert torch.allclose(alg.predict_log_proba(ctx, ev, x), F.log_softmax(out, -1), atol=1e-5)


@pytest.mark.correctness(
    ("gpfl",), "one local step's loss is Eq. (11) by hand: L^P + L^alg + lambda L^mlg + (mu / 2) times the squared "
    "norms of V and C, with g, p_i from the received embeddings and alpha_i from the client's labels",
    guards="lambda or mu applied to the wrong term, L^alg weighted, the regularizer on the feature extractor",
)
def test_one_step_loss_is_the_local_objective_by_hand():
    mlp = build_model("mlp", 4, 3, hidden=(5,))
    alg = GPFL(lam=0.7, mu=0.3)
    ctx = _ctx(mlp)
    server: GPServer = alg.init_server(ctx, mlp.init(0), 2)
    state = alg.init_client(ctx, server)
    b = _batches(1, 8, 4, 3, seed=3)
    _, new, loss = alg.client_update(ctx, alg.payload(server), state, b, 0.1)
    x, y = b.x[0], b.y[0]
    alpha = torch.stack([(y == j).float().mean() for j in range(3)])
    assert torch.allclose(new.alpha, alpha)
    gi, pi = server.gce.mean(0), alpha @ server.gce / 3
    p = {**server.params, **server.fixed}
    h = torch.relu(x @ p["0.weight"].T + p["0.bias"])
    fg, fp = valve(server.cov, h, gi), valve(server.cov, h, pi)
    lp = F.cross_entropy(fp @ p["2.weight"].T + p["2.bias"], y)
    cos = F.normalize(fg, dim=-1) @ F.normalize(server.gce, dim=-1).T
    la = F.cross_entropy(cos, y)
    lm = (fg - server.gce[y]).norm(dim=-1).mean()
    reg = sum(float((v * v).sum()) for v in server.cov.values()) + float((server.gce ** 2).sum())
    want = float(lp + la + 0.7 * lm) + 0.5 * 0.3 * reg
    assert abs(float(loss) - want) < 1e-4 * max(1.0, want), (float(loss), want)


@pytest.mark.correctness(
    ("gpfl",), "L^mlg pulls f^G towards the frozen received embeddings: it moves the feature extractor and CoV but "
    "not C (lambda changes W^fe's step, never C's)",
    guards="L^mlg's targets taken from the embeddings being trained (a gradient of L^mlg into C)",
)
def test_magnitude_guidance_targets_are_frozen():
    mlp = build_model("mlp", 4, 3, hidden=(5,))
    b = _batches(1, 8, 4, 3, seed=4)
    outs = []
    for lam in (0.0, 5.0):
        alg = GPFL(lam=lam)
        ctx = _ctx(mlp)
        server = alg.init_server(ctx, mlp.init(0), 2)
        outs.append(alg.client_update(ctx, alg.payload(server), alg.init_client(ctx, server), b, 0.1)[0])
    a, c = outs
    assert torch.equal(a.gce, c.gce)
    assert not torch.allclose(a.params["0.weight"], c.params["0.weight"])
    assert not torch.allclose(a.cov["gamma.norm.bias"], c.cov["gamma.norm.bias"])


@pytest.mark.correctness(
    ("gpfl",), "without CoV and GCE (Table 6, variant (e): CoV at identity, gamma = beta = 0; embeddings all equal, "
    "so L^alg sends no gradient to the features; lambda = mu = 0) a local step is FedPer's: body and head trained "
    "together on the plain loss (FedPer, not FedRep: Algorithm 1 updates them simultaneously)",
    guards="the feature extractor trained only through the global route, the head fed f instead of f^P's transform, "
    "the head trained before/after the body (FedRep), gamma without its + 1",
)
def test_one_step_without_valve_and_embeddings_is_fedper():
    mlp = build_model("mlp", 10, 4, hidden=(16,))
    ctx = _ctx(mlp, SGD(0.1, 0.9, 5e-4))
    alg = GPFL(lam=0.0, mu=0.0)
    server = alg.init_server(ctx, mlp.init(0), 1)
    identity = {k: torch.zeros_like(v) if ".norm." in k else v for k, v in server.cov.items()}  # gamma = beta = 0
    same = torch.randn(16).expand(4, 16).clone()  # U equal embeddings: every cosine equal, L^alg flat in f^G
    payload = GPShared(server.params, identity, same)
    b = _batches(1, 32, 10, 4, seed=5)
    upd, st, _ = alg.client_update(ctx, payload, alg.init_client(ctx, server), b, 0.1)
    body, per, _ = FedPer().client_update(ctx, server.params, PersonalHead(server.fixed), b, 0.1)
    for k in body:
        assert torch.allclose(upd.params[k], body[k], atol=1e-6), k
        assert not torch.equal(body[k], server.params[k])
    for k in per.head:
        assert torch.allclose(st.head[k], per.head[k], atol=1e-6), k
    # CoV and GCE did train (so over more steps the two part ways)
    assert not torch.equal(upd.cov["gamma.norm.bias"], identity["gamma.norm.bias"])
    assert not torch.equal(upd.gce, same)


def test_unseen_client_trains_its_head_alone_with_its_own_class_proportions(small_data):
    mlp = build_model("mlp", 10, 2, hidden=(16,))
    alg = GPFL(unseen_head_epochs=2)
    eng = make_sim(alg, small_data, model=mlp)
    server: GPServer = eng.init_state().server
    state = alg.init_client(eng.ctx, server)
    assert all(torch.equal(state.head[k], server.fixed[k]) for k in server.fixed) and not bool(state.alpha.any())
    b = _batches(4, 8, 10, 2, seed=6)
    ev = alg.personalize(eng.ctx, alg.payload(server), state, b, 0.1, False)
    assert ev.params is server.params and ev.cov is server.cov  # W^fe, V as received
    assert all(not torch.equal(ev.head[k], server.fixed[k]) for k in server.fixed)  # its own head trained
    alpha = torch.stack([(b.y[:2] == j).float().mean() for j in range(2)])  # the first of two epochs
    assert torch.allclose(ev.p, alpha @ server.gce / 2, atol=1e-6)
    assert alg.personalize(eng.ctx, alg.payload(server), state, None, 0.1, True).head is state.head


@pytest.mark.slow
def test_server_averages_the_shared_parts_and_clients_keep_their_heads(small_data):
    mlp = build_model("mlp", 10, 2, hidden=(16,))
    sim = make_sim(GPFL(), small_data, model=mlp, rounds=2)
    st = sim.init_state()
    init: GPServer = st.server
    for _ in range(2):
        sim.round(st)
    assert all(not torch.equal(st.server.params[k], init.params[k]) for k in init.params)
    assert not torch.equal(st.server.gce, init.gce) and not torch.equal(st.server.cov["beta.fc.weight"],
                                                                        init.cov["beta.fc.weight"])
    assert all(torch.equal(st.server.fixed[k], init.fixed[k]) for k in init.fixed)  # the initial head, kept
    states = all_client_states(sim)
    w = states.head["2.weight"]
    assert float((w - w[0]).abs().max()) > 1e-3  # every client its own head
    assert torch.allclose(states.alpha.sum(-1), torch.ones(16))  # every seen client trained (full participation)


@pytest.mark.slow
def test_personalizes_label_permuted_groups_better_than_fedavg():
    # two groups whose labels are permuted: one global model cannot serve both; a personalized head can
    permuted = permuted_groups(num_clients=12, num_groups=2, dim=10, num_classes=4, n_train=120, n_test=100, seed=1)
    mlp4 = build_model("mlp", 10, 4, hidden=(16,))
    opt = SGD(0.1, 0.9)
    fed = make_sim(FedAvg(), permuted, model=mlp4, opt=opt, rounds=20, batch_size=32)
    sf, _ = run_rounds(fed, 20)
    sim = make_sim(GPFL(), permuted, model=mlp4, opt=opt, rounds=20, batch_size=32)
    st, _ = run_rounds(sim, 20)
    acc, base = summarize(sim.evaluate(st))["seen_test_acc_mean"], summarize(fed.evaluate(sf))["seen_test_acc_mean"]
    assert acc > base + 0.2, (acc, base)


@pytest.mark.slow  # about 6 s
def test_fedbuff_with_a_buffer_of_every_client_is_the_synchronous_method(small_data):
    # updates in the payload's coordinates (runs_async): every client dispatched together, no staleness -- GPFL
    mlp = build_model("mlp", 10, 2, hidden=(16,))
    n = small_data.seen.num_clients
    a = make_sim(GPFL(), small_data, model=mlp, opt=SGD(0.1))
    sa, _ = run_rounds(a, 2)
    buff = AsyncConfig(mode="fedbuff", concurrency=n, buffer_size=n, staleness="constant")
    b = make_sim(GPFL(), small_data, model=mlp, opt=SGD(0.1), asynchronous=buff)
    sb, _ = run_rounds(b, 2)
    for x, y in zip(T.leaves(sa.server), T.leaves(sb.server), strict=True):
        assert torch.allclose(x, y, atol=1e-5)
    for x, y in zip(T.leaves(all_client_states(a)), T.leaves(all_client_states(b)), strict=True):
        assert torch.allclose(x, y, atol=1e-5)
