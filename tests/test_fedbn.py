"""Batch normalization inside the pure, batched engine (``fedmtl.BatchNorm``), the ``cnn_bn`` model and FedBN:
equal to torch's BatchNorm (train and eval, running statistics, gradients), padding kept out of the statistics,
loop == vmap, FedBN's reductions and its point (clients whose features are shifted differently)."""

import numpy as np
import pytest
import torch
from torch import nn

from fedmtl import BatchNorm, Model
from fedmtl import tree as T
from fedmtl.algorithms import FedAvg, FedBN, FedPer, Local, PFedMe
from fedmtl.batchnorm import training
from fedmtl.data.federated import from_clients
from fedmtl.engine.evaluation import summarize
from fedmtl.engine.server_opt import ServerOptConfig
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, Batches, local_sgd
from fedmtl.testing import check_algorithm

from .conftest import all_client_states, make_sim, run_rounds


def _bn_mlp(d: int = 10, classes: int = 2, hidden: int = 16) -> Model:
    out = 1 if classes == 2 else classes
    return Model.from_module(nn.Sequential(nn.Linear(d, hidden), BatchNorm(hidden), nn.ReLU(), nn.Linear(hidden, out)),
                             classes, name="bn_mlp")


def _torch_twin(m: Model, params) -> nn.Module:
    """The same network with torch's BatchNorm (the reference)."""
    layers = []
    for mod in m.module:
        layers.append(nn.BatchNorm1d(mod.num_features) if isinstance(mod, BatchNorm) else type(mod)(
            *((mod.in_features, mod.out_features) if isinstance(mod, nn.Linear) else ())))
    net = nn.Sequential(*layers)
    sd = {k: v for k, v in params.items()}
    net.load_state_dict(sd, strict=False)
    return net


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 3, 3)], ids=["1d", "2d"])
def test_batchnorm_equals_torch_in_training_and_eval_with_padding_left_out(shape):
    torch.manual_seed(0)
    c = shape[1]
    bn, ref = BatchNorm(c), (nn.BatchNorm1d(c) if len(shape) == 2 else nn.BatchNorm2d(c))
    with torch.no_grad():
        for p in (bn.weight, bn.bias):
            p.copy_(torch.randn(c))
        ref.weight.copy_(bn.weight)
        ref.bias.copy_(bn.bias)
    x = torch.randn(*shape) * 3 + 1
    padded = torch.cat([x, 100 * torch.randn(3, *shape[1:])])  # padding far off: it must not enter the statistics
    mask = torch.cat([torch.ones(shape[0]), torch.zeros(3)])
    with training(mask) as updates:
        y = bn(padded)[: shape[0]]
    ref.train()
    assert torch.allclose(y, ref(x), atol=1e-5)
    # the running statistics move as torch's (momentum 0.1, unbiased variance)
    assert torch.allclose(updates["running_mean"], ref.running_mean, atol=1e-6)
    assert torch.allclose(updates["running_var"], ref.running_var, atol=1e-5)
    # eval: normalized by the running statistics
    with torch.no_grad():
        bn.running_mean.copy_(updates["running_mean"])
        bn.running_var.copy_(updates["running_var"])
    ref.eval()
    assert torch.allclose(bn(x), ref(x), atol=1e-5)


def test_value_and_grad_of_a_batchnorm_model_equals_torch_and_returns_the_new_statistics():
    m = _bn_mlp(classes=3)
    p = m.init(3)
    x, y = torch.randn(9, 10), torch.randint(0, 3, (9,))
    g, loss = m.value_and_grad(p, x, y, torch.ones(9))
    net = _torch_twin(m, p)
    net.train()
    ref_loss = nn.functional.cross_entropy(net(x), y)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for k, prm in net.named_parameters():
        assert torch.allclose(g[k], prm.grad, atol=1e-6), k
    assert torch.allclose(g["1.running_mean"], net[1].running_mean, atol=1e-6)
    assert torch.allclose(g["1.running_var"], net[1].running_var, atol=1e-6)
    # the same under vmap, with padding
    xp, yp = torch.cat([x, torch.randn(4, 10) * 50]), torch.cat([y, torch.zeros(4, dtype=torch.long)])
    mask = torch.cat([torch.ones(9), torch.zeros(4)])
    gv, lv = torch.func.vmap(m.value_and_grad, in_dims=(None, 0, 0, 0, None))(p, xp[None], yp[None], mask[None], None)
    assert torch.allclose(lv[0], loss, atol=1e-6)
    for k in g:
        assert torch.allclose(gv[k][0], g[k], atol=1e-5), k


def test_local_sgd_assigns_the_statistics_and_steps_only_the_weights():
    m = _bn_mlp()
    p = m.init(0)
    x, y = torch.randn(1, 8, 10), torch.randint(0, 2, (1, 8))
    b = Batches(x, y, torch.ones(1, 8), torch.arange(8)[None], torch.tensor(8.0))
    opt = SGD(0.1, momentum=0.9, weight_decay=0.5)
    new, _ = local_sgd(m.value_and_grad, p, b, 0.1, opt, prox_center=T.zeros_like(p), prox_mu=1.0)
    g, _ = m.value_and_grad(p, x[0], y[0], torch.ones(8))
    for k in p:
        if k.endswith(("running_mean", "running_var")):
            assert torch.equal(new[k], g[k])  # no rate, decay, momentum or proximal term on a statistic
        else:
            assert torch.allclose(new[k], p[k] - 0.1 * (g[k] + 0.5 * p[k] + p[k]), atol=1e-6)


def test_models_with_torch_batchnorm_or_stray_statistic_names_are_refused():
    with pytest.raises(ModelError, match="fedmtl.BatchNorm"):
        Model.from_module(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), 3)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.running_mean = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.lin(x) + self.running_mean

    with pytest.raises(ModelError, match="named like batch-norm statistics"):
        Model.from_module(Odd(), 3)


def test_cnn_bn_normalizes_after_each_convolution_and_the_hidden_layer():
    m = build_model("cnn_bn", (1, 28, 28), 10, hidden=32)
    assert len(m.batch_norm) == 12 and m.head is not None and not set(m.head) & set(m.batch_norm)
    p = m.init(0)
    x = torch.randn(5, 1, 28, 28)
    g, _ = m.value_and_grad(p, x, torch.randint(0, 10, (5,)), torch.ones(5))
    assert all(not torch.equal(g[k], p[k]) for k in m.batch_norm if k.endswith("running_mean"))
    assert m.apply(p, x).shape == (5, 10)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [FedAvg, Local, FedPer])
def test_contract_with_a_batchnorm_model(cls):
    # loop == vmap (padded batches under vmap), determinism, checkpoints, NaN updates.  FedBN is not repeated here:
    # its toy model (Toy(model="batchnorm"): fedmtl.testing.toy_model, the same layers as _bn_mlp) gets every contract
    # check, these included, in tests/test_contract.py::test_every_registered_algorithm_keeps_the_contract[fedbn-*]
    checks = ("loop_equals_vmap", "deterministic", "checkpoint_round_trip", "nan_excluded", "learns")
    assert set(check_algorithm(cls, model=_bn_mlp(), checks=checks).values()) == {"ok"}


def test_methods_that_cannot_train_batchnorm_refuse_it_and_fedbn_needs_it(small_data):
    with pytest.raises(ModelError, match="does not support"):
        make_sim(PFedMe(), small_data, model=_bn_mlp())
    with pytest.raises(ModelError, match="cnn_bn"):
        make_sim(FedBN(), small_data, model=build_model("mlp", 10, 2, hidden=(8,)))


@pytest.mark.correctness(
    ("fedbn",), "batch-norm layers stay per client, the rest is averaged",
    guards="running statistics stepped by SGD",
)
def test_fedbn_keeps_batchnorm_per_client_and_averages_the_rest(small_data):
    m = _bn_mlp()
    sim = make_sim(FedBN(), small_data, model=m)
    st, _ = run_rounds(sim, 2)
    assert set(st.server.params) == set(m.init(0)) - set(m.batch_norm)
    bn = all_client_states(sim).bn
    assert set(bn) == set(m.batch_norm)
    for k, v in bn.items():  # every seen client has its own layers (affine and statistics)
        seen = v[: small_data.num_clients]
        assert float((seen - seen[0]).abs().max()) > 1e-4, k


@pytest.mark.correctness(
    ("fedbn",), "one client: FedAvg",
    guards="batch-norm statistics averaged by the server",
)
def test_fedbn_with_one_client_is_fedavg():
    data = _feature_shift(num_clients=1, seed=2)
    m = _bn_mlp(d=6, classes=3)
    sa, _ = run_rounds(make_sim(FedAvg(), data, model=m), 3)
    fb = make_sim(FedBN(), data, model=m)
    sb, _ = run_rounds(fb, 3)
    bn = T.tmap(lambda v: v[0], all_client_states(fb).bn)
    full = {**sb.server.params, **bn}
    for k, v in sa.server.params.items():
        assert torch.allclose(v, full[k], atol=1e-6), k


def test_server_optimizers_average_the_statistics(small_data):
    m = _bn_mlp()
    plain, _ = run_rounds(make_sim(FedAvg(), small_data, model=m), 1)
    sim = make_sim(FedAvg(), small_data, model=m, server_opt=ServerOptConfig(name="adam", lr=0.05))
    st, _ = run_rounds(sim, 1)
    for k in m.batch_norm:
        if k.endswith(("running_mean", "running_var")):
            assert torch.allclose(st.server.params[k], plain.server.params[k], atol=1e-6), k
    assert not torch.allclose(st.server.params["0.weight"], plain.server.params["0.weight"])


def _feature_shift(num_clients: int = 8, seed: int = 0, d: int = 6, classes: int = 3, n_train: int = 120,
                   n_test: int = 200):
    """One labelling rule on latent x ~ N(0, I); client k observes a_k x + b_k (a_k from 0.2 to 5, offsets of a
    few units): FedBN's setting, non-IID features with shared labels."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(d, classes))
    scales = np.geomspace(0.2, 5.0, max(num_clients, 2))[:num_clients]
    train, test = [], []
    for k in range(num_clients):
        shift = rng.normal(scale=3.0, size=d)
        for n, out in ((n_train, train), (n_test, test)):
            z = rng.normal(size=(n, d))
            x = (scales[k] * z + shift).astype(np.float32)
            out.append((torch.from_numpy(x), torch.from_numpy(np.argmax(z @ w, axis=1))))
    return from_clients(train, test, classes, name="feature_shift")


@pytest.mark.slow
def test_fedbn_beats_fedavg_on_clients_with_shifted_features():
    data = _feature_shift()
    m = _bn_mlp(d=6, classes=3, hidden=32)
    opt = SGD(0.05, 0.9)
    acc = {}
    for alg in (FedAvg(), FedBN()):
        sim = make_sim(alg, data, model=m, opt=opt, rounds=30, batch_size=32)
        st, _ = run_rounds(sim, 30)
        acc[alg.name] = summarize(sim.evaluate(st))["seen_test_acc_mean"]
    # FedAvg's averaged statistics normalize no client's features well; FedBN's local layers do
    assert acc["fedbn"] > acc["fedavg"] + 0.1, acc
    assert acc["fedbn"] > 0.8, acc


def test_mlp_batch_norm_option_builds_the_bn_network_on_the_generic_path():
    m = build_model("mlp", 10, 3, hidden=(8, 6), batch_norm=True)
    assert m.batch_norm and len(m.batch_norm) == 8  # two BatchNorm layers: weight, bias, running mean and var
    assert not m.stacks and m.head is not None
    plain = build_model("mlp", 10, 3, hidden=(8,))
    assert plain.stacks and not plain.batch_norm
    with pytest.raises(ValueError, match="batch_norm"):
        build_model("mlp", 10, 3, hidden=(8,), batch_norm="yes")


def _bn_images(seed: int = 0):
    """4 clients of unequal sizes (ragged batches: padding and clients that stop early), 1 x 16 x 16 images whose
    brightness differs per client."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(256, 3))
    pairs = []
    for k, n in enumerate((11, 5, 8, 3)):
        x = torch.tensor(rng.normal(size=(n, 1, 16, 16)), dtype=torch.float32)
        pairs.append((x * (1 + k) + k, torch.tensor(np.argmax(x.reshape(n, -1).numpy() @ w, 1))))
    return from_clients(pairs, pairs, 3)


@pytest.mark.correctness(
    ("fedavg", "fedbn"), "cnn_bn on the stacked executor: the loop's and vmap's model, running statistics included",
    guards="padding or other clients' samples in a client's batch statistics; statistics stepped, not assigned",
)
@pytest.mark.slow
@pytest.mark.parametrize("alg", [FedAvg(), FedBN()], ids=["fedavg", "fedbn"])
def test_cnn_bn_on_the_stacked_executor_equals_the_loop_and_vmap(alg):
    data, m = _bn_images(), build_model("cnn_bn", (1, 16, 16), 3, hidden=8)
    out = {}
    for runner in ("stacked", "loop", "vmap"):
        sim = make_sim(alg, data, model=m, runner=runner, batch_size=4, local_epochs=2, sampling_rate=1.0)
        assert sim.clients.executor.name == runner
        st, rows = run_rounds(sim, 2)
        out[runner] = (st.server, all_client_states(sim), [r["train_loss"] for r in rows])
    assert m.clients_form is not None and m.clients_form.layers["0.1"] == "stacked"  # the norms are stacked too
    for runner in ("loop", "vmap"):
        for a, b in zip(T.leaves(out["stacked"][:2]), T.leaves(out[runner][:2]), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (runner, float((a - b).abs().max()))
        assert np.allclose(out["stacked"][2], out[runner][2], atol=1e-5)
    stats = [k for k in m.batch_norm if k.endswith("running_var")]
    moved = out["stacked"][1].bn if isinstance(alg, FedBN) else out["stacked"][0].params
    assert all(float((moved[k] - 1).abs().max()) > 1e-3 for k in stats)  # the statistics were trained


def test_auto_runs_batchnorm_models_stacked_where_their_other_layers_would():
    from fedmtl.engine.executors import make_executor

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # the rule only (nothing runs on the device)
    mlp = build_model("mlp", 10, 3, hidden=(8,), batch_norm=True)
    mlp.check_features(torch.randn(6, 10))
    cnn = build_model("cnn_bn", (1, 16, 16), 3, hidden=8)
    cnn.check_features(torch.randn(6, 1, 16, 16))
    assert make_executor("auto", mlp, cpu).name == "stacked"
    assert make_executor("auto", cnn, cpu).name == "loop"  # convolutions loop on a CPU (fedmtl bench batchnorm)
    assert make_executor("auto", cnn, gpu).name == "stacked"
