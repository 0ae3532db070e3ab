"""FedProto (Tan et al., AAAI 2022): the contract, the reduction to Local training at lambda = 0, the server's
class-wise prototype aggregation (eq. 6) and the local prototypes (eq. 3) by hand, prototype inference (eq. 4) and
the regularizer's pull of the representation towards the global prototypes."""

from pathlib import Path

import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.fedproto import (
    FedProto,
    GlobalPrototypes,
    LocalPrototypes,
    PersonalModel,
    ProtoEval,
    ProtoServer,
    local_prototypes,
)
from fedmtl.algorithms.local import Local
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", 10, 2, hidden=(16,))


def _batches(s: int, b: int, d: int, classes: int, seed: int, pad: int = 0, pad_step: int = -1) -> Batches:
    """S steps of B examples (the last ``pad`` slots of step ``pad_step`` padding), labels in 0..classes-1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, d, generator=g)
    y = torch.randint(0, classes, (s, b), generator=g)
    mask = torch.ones(s, b)
    if pad:
        mask[pad_step, -pad:] = 0.0
    return Batches(x, y, mask, torch.arange(s * b).reshape(s, b), mask.sum())


def test_refuses_a_model_without_a_head(small_model):
    with pytest.raises(ModelError, match="fedproto"):
        FedProto().check_model(small_model)
    with pytest.raises(ValueError, match="privacy"):
        FedProto().check_privacy()


@pytest.mark.correctness(
    ("fedproto",), "lambda = 0 is Local bit for bit",
    guards="a regularizer that stays on",
)
def test_lambda_zero_is_local_training(small_data, mlp):
    """lambda = 0: every client trains its own model from the common initial model on the plain loss, exactly as
    Local does (same personal models, losses and seen clients' evaluation)."""
    a = make_sim(Local(), small_data, model=mlp, sampling_rate=0.5)
    sa, ra = run_rounds(a, 3)
    b = make_sim(FedProto(lam=0.0), small_data, model=mlp, sampling_rate=0.5)
    sb, rb = run_rounds(b, 3)
    for x, y in zip(T.leaves(all_client_states(a)), T.leaves(all_client_states(b)), strict=True):
        assert torch.equal(x, y)
    assert [r["train_loss"] for r in ra] == [r["train_loss"] for r in rb]
    ea, eb = summarize(a.evaluate(sa, ("seen",))), summarize(b.evaluate(sb, ("seen",)))
    assert ea == eb
    assert float(sb.server.counts.sum()) > 0  # the prototypes were still formed and aggregated


def test_regularizer_without_global_prototypes_is_the_plain_loss(mlp):
    """Before any global prototype exists (the first round) the term is left out: FedProto's step is the model's
    own gradient of the cross-entropy, for any lambda."""
    ctx = Context(mlp, SGD(0.1), 1, 1.0)
    p = mlp.init(0)
    b = _batches(1, 8, 10, 2, seed=1, pad=3)
    none = GlobalPrototypes(torch.randn(2, 16), torch.zeros(2))
    g, loss = FedProto(lam=5.0).grad_fn(ctx, none)(p, b.x[0], b.y[0], b.mask[0], None)
    g0, loss0 = mlp.value_and_grad(p, b.x[0], b.y[0], b.mask[0])
    assert abs(float(loss) - float(loss0)) < 1e-6
    for k in g0:
        assert torch.allclose(g[k], g0[k], atol=1e-6), k


def test_regularizer_gradient_by_hand(mlp):
    """With prototypes for class 1 only: the gradient is CE's plus lambda * grad of mean_i [y_i = 1] *
    ||f(x_i) - Cbar^(1)||^2 / d (the coordinate mean: ``distance = "mean"``; "sum" is d times as strong)."""
    ctx = Context(mlp, SGD(0.1), 1, 1.0)
    p = mlp.init(0)
    b = _batches(1, 8, 10, 2, seed=2)
    x, y, m = b.x[0], b.y[0], b.mask[0]
    c1 = torch.randn(16)
    payload = GlobalPrototypes(torch.stack([torch.zeros(16), c1]), torch.tensor([0.0, 4.0]))
    for distance, scale in (("mean", 1 / 16), ("sum", 1.0)):
        g, loss = FedProto(lam=0.7, distance=distance).grad_fn(ctx, payload)(p, x, y, m, None)

        def ref(q, scale=scale):
            z = mlp.features(q, x)
            reg = ((z - c1) ** 2).sum(-1) * (y == 1).float() * scale
            return (mlp.nll(mlp.apply_head(q, z), y) + 0.7 * reg).mean()

        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        want = torch.autograd.grad(ref(leaves), list(leaves.values()))
        for (k, _), w in zip(p.items(), want, strict=True):
            assert torch.allclose(g[k], w, atol=1e-5), (distance, k)
        assert abs(float(loss) - float(mlp.loss(p, x, y, m))) < 1e-6  # the logged loss is L_S


def test_local_prototypes_are_per_class_feature_means():
    m = build_model("mlp", 6, 4, hidden=(5,))
    p = m.init(3)
    b = _batches(3, 5, 6, 3, seed=4, pad=2)  # classes 0..2 of 4 present; class 3 absent; two padding slots
    x, y, mask = b.x.reshape(15, 6), b.y.reshape(15), b.mask.reshape(15)
    got = local_prototypes(m, p, x, y, mask)
    for j in range(4):
        rows = [m.features(p, x[i:i + 1])[0] for i in range(15) if mask[i] > 0 and int(y[i]) == j]
        assert float(got.counts[j]) == len(rows)
        want = torch.stack(rows).mean(0) if rows else torch.zeros(5)
        assert torch.allclose(got.protos[j], want, atol=1e-6), j


@pytest.mark.correctness(
    ("fedproto",), "the prototypes sent come from the trained model",
    guards="prototypes from the model before training",
)
def test_client_update_sends_the_trained_models_prototypes(mlp):
    """The update: prototypes of the model after the round's training, over the client's training examples (its
    first epoch; two epochs here), and the new state is that model."""
    ctx = Context(mlp, SGD(0.1, momentum=0.9), 1, 1.0, local_epochs=2)
    b = _batches(6, 8, 10, 2, seed=5, pad=3, pad_step=2)  # two epochs of three steps, each ending short
    payload = GlobalPrototypes(torch.randn(2, 16), torch.tensor([3.0, 0.0]))
    upd, st, loss = FedProto().client_update(ctx, payload, PersonalModel(mlp.init(0)), b, 0.1)
    want = local_prototypes(mlp, st.params, b.x[:3].reshape(24, 10), b.y[:3].reshape(24), b.mask[:3].reshape(24))
    assert torch.allclose(upd.protos, want.protos, atol=1e-6)
    assert torch.equal(upd.counts, want.counts) and float(upd.counts.sum()) == 21
    assert float((upd.protos - local_prototypes(mlp, mlp.init(0), *(t[:3].reshape(24, *t.shape[2:]) for t in
                                                                   (b.x, b.y, b.mask))).protos).abs().max()) > 1e-3
    assert bool(torch.isfinite(loss))


@pytest.mark.correctness(
    ("fedproto",), "prototypes averaged per class by counts; missing classes kept; NaN rows ignored",
    guards="an extra 1/|N_j| factor (as eq. 6 is printed) shrinking the prototypes",
)
def test_server_aggregates_prototypes_by_class_counts(mlp):
    """Eq. 6 by hand: class 0 from clients 0 and 1 weighted 2 : 1; class 1 from client 1 only (client 0 sends a zero
    count whatever its row holds); class 2 from nobody keeps its previous prototype and count; client 2's NaN update
    (weight 0, excluded) is ignored in every class, its counts included."""
    ctx = Context(mlp, SGD(0.1), 3, 1.0)
    old = torch.tensor([[9.0, 9.0], [8.0, 8.0], [7.0, -7.0]])
    server = ProtoServer(old, torch.tensor([1.0, 1.0, 5.0]), {})
    protos = torch.tensor([
        [[1.0, 2.0], [100.0, 100.0], [0.0, 0.0]],
        [[4.0, -1.0], [3.0, 5.0], [0.0, 0.0]],
        [[float("nan")] * 2] * 3,
    ])
    counts = torch.tensor([[2.0, 0.0, 0.0], [1.0, 3.0, 0.0], [float("nan"), 7.0, 7.0]])
    weights = torch.tensor([10.0, 4.0, 0.0], dtype=torch.float64)
    new = FedProto().aggregate(ctx, server, LocalPrototypes(protos, counts), weights, torch.arange(3))
    want = torch.tensor([[(2 * 1.0 + 4.0) / 3, (2 * 2.0 - 1.0) / 3], [3.0, 5.0], [7.0, -7.0]])
    assert torch.allclose(new.protos, want, atol=1e-6)
    assert torch.equal(new.counts, torch.tensor([3.0, 3.0, 5.0]))
    # nobody valid: the server is unchanged
    same = FedProto().aggregate(ctx, server, LocalPrototypes(protos, counts), torch.zeros(3, dtype=torch.float64),
                                torch.arange(3))
    assert torch.equal(same.protos, old)


def test_prototype_inference_picks_the_nearest_global_prototype():
    m = build_model("mlp", 4, 3, hidden=(6,))
    ctx = Context(m, SGD(0.1), 1, 1.0)
    p = m.init(1)
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(6))
    z = m.features(p, x)
    protos = z[:3] + 0.01  # each of the first three examples sits next to "its" prototype
    alg = FedProto(inference="prototype")
    lp = alg.predict_log_proba(ctx, ProtoEval(p, protos, torch.ones(3)), x)
    d2 = torch.cdist(z, protos) ** 2
    assert torch.equal(lp.argmax(-1), d2.argmin(-1))
    assert torch.equal(lp[:3].argmax(-1), torch.arange(3))
    assert torch.allclose(lp.exp().sum(-1), torch.ones(50), atol=1e-5)
    # a class without a global prototype is never predicted, even where its (zero) row is the nearest
    far = torch.stack([torch.zeros(6), protos[1] + 100.0, protos[2] + 100.0])
    lp = alg.predict_log_proba(ctx, ProtoEval(p, far, torch.tensor([0.0, 2.0, 2.0])), x)
    assert bool(torch.isfinite(lp).all()) and not bool((lp.argmax(-1) == 0).any())
    # no prototype at all (before the first aggregation): uniform
    lp = alg.predict_log_proba(ctx, ProtoEval(p, protos, torch.zeros(3)), x)
    assert torch.allclose(lp, torch.full_like(lp, -torch.log(torch.tensor(3.0))), atol=1e-6)
    # the model's own logits otherwise
    lm = FedProto().predict_log_proba(ctx, ProtoEval(p, protos, torch.ones(3)), x)
    assert torch.allclose(lm, m.log_proba(m.apply(p, x)))


def test_regularizer_pulls_the_representation_to_the_global_prototypes(mlp):
    """Local training with the term ends with representations much nearer their class's global prototype than
    without; the "mean" distance with lambda = d is the "sum" distance with lambda = 1 (d = 16 here)."""
    ctx = Context(mlp, SGD(0.1), 1, 1.0)
    b = _batches(16, 8, 10, 2, seed=7)
    p0 = mlp.init(0)
    protos = torch.randn(2, 16, generator=torch.Generator().manual_seed(8)).abs()
    payload = GlobalPrototypes(protos, torch.ones(2))
    x, y = b.x.reshape(128, 10), b.y.reshape(128)

    def train(**kw):
        return FedProto(**kw).client_update(ctx, payload, PersonalModel(p0), b, 0.1)[1].params

    def dist(p):
        return float(((mlp.features(p, x) - protos[y]) ** 2).sum(-1).mean())

    plain, pulled = train(lam=0.0), train(lam=1.0, distance="sum")
    assert dist(pulled) < 0.5 * dist(plain), (dist(pulled), dist(plain))
    for k, v in train(lam=16.0, distance="mean").items():
        assert torch.allclose(v, pulled[k], atol=1e-5), k


def test_unseen_clients_fine_tune_the_initial_model(small_data, mlp):
    sim = make_sim(FedProto(), small_data, model=mlp)
    st, _ = run_rounds(sim, 2)
    ev = summarize(sim.evaluate(st))
    assert ev["unseen_test_acc_mean"] > 0.55  # the initial model is at chance on the toy task
    init = sim.alg.init_clients(sim.ctx, st.server, torch.arange(2))
    for k, v in st.server.init.items():
        assert torch.equal(init.params[k][1], v)


def test_bundled_config():
    from fedmtl import config

    path = Path(__file__).resolve().parents[1] / "src/fedmtl/configs/fmnist/fedproto.toml"
    cfg = config.load(path)
    alg = cfg.build_algorithm()
    assert isinstance(alg, FedProto) and alg.lam == 1.0 and alg.inference == "model"
    local = config.read_toml(path.parent / "local.toml")
    raw = config.read_toml(path)
    for table in ("data", "model", "optim", "run"):
        assert raw[table] == local[table], table
