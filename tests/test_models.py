"""Models: functional forms equal their modules; vmap over clients equals a loop."""

import dataclasses

import pytest
import torch
from torch.func import vmap

from fedmtl import tree as T
from fedmtl.algorithms import FedAvg
from fedmtl.data.federated import ClientGroup, FederatedData, Split
from fedmtl.engine.executors import make_executor
from fedmtl.models import build_model
from fedmtl.models.lstm import lstm_forward
from fedmtl.models.stacking import (
    supports_clients,
    value_and_grad_clients,
    value_and_grad_clients_stacked,
    value_and_grad_stacked,
)

from .conftest import make_sim, run_rounds


def test_functional_lstm_equals_nn_lstm_module():
    m = build_model("lstm", (80,), 80, hidden=32)
    p = m.init(0)
    x = torch.randint(0, 80, (5, 80))
    with torch.no_grad():
        ref = m.module(x)
    assert torch.allclose(lstm_forward(p, x), ref, atol=1e-5)
    assert torch.allclose(m.apply(p, x), ref, atol=1e-5)


def test_functional_lstm_under_vmap_equals_per_client():
    m = build_model("lstm", (12,), 80, embed=4, hidden=16)
    ps = T.stack([m.init(s) for s in range(3)])
    x = torch.randint(0, 80, (3, 6, 12))
    out = vmap(m.apply)(ps, x)
    for k in range(3):
        assert torch.allclose(out[k], m.apply(T.take(ps, k), x[k]), atol=1e-5)
    g = vmap(lambda p, xx: m.value_and_grad(p, xx, xx[:, 0], torch.ones(6))[0])(ps, x)
    g1 = m.value_and_grad(T.take(ps, 1), x[1], x[1][:, 0], torch.ones(6))[0]
    for k in g1:
        assert torch.allclose(g[k][1], g1[k], atol=1e-5)


@pytest.mark.parametrize("name,shape,classes", [("cnn_femnist", (28, 28), 62), ("cnn_cifar", (3, 32, 32), 10)])
def test_cnn_shapes_and_vmap(name, shape, classes):
    meta = {"input": "image", "mean": 0.5, "std": 0.25} if len(shape) == 2 else {
        "input": "image", "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    m = build_model(name, shape, classes, meta, hidden=64)
    ps = T.stack([m.init(s) for s in range(2)])
    x = torch.randint(0, 256, (2, 3, *shape), dtype=torch.uint8)
    out = vmap(m.apply)(ps, x)
    assert out.shape == (2, 3, classes)
    assert torch.allclose(out[1], m.apply(T.take(ps, 1), x[1]), atol=1e-5)
    assert m.prefer_loop_on_cpu


def test_femnist_cnn_has_the_paper_architecture():
    m = build_model("cnn_femnist", (28, 28), 62)
    shapes = {k: tuple(v.shape) for k, v in m.init(0).items()}
    assert shapes["0.0.weight"] == (32, 1, 5, 5) and shapes["0.3.weight"] == (64, 32, 5, 5)
    assert shapes["1.weight"] == (2048, 1024) and shapes["3.weight"] == (62, 2048)


def test_pfl_cnn_is_pfl_researchs_simple_cnn():
    """cnn_pfl = pfl-research's simple_cnn without dropout, written out as a plain module: the same parameter shapes
    (12,544 features into the hidden layer on 32 x 32 x 3) and the same logits under the same weights."""
    m = build_model("cnn_pfl", (3, 32, 32), 10)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(14 * 14 * 64, 128),
                              torch.nn.ReLU(), torch.nn.Linear(128, 10))
    p = m.init(0)
    assert [tuple(v.shape) for v in p.values()] == [tuple(v.shape) for v in ref.parameters()]
    with torch.no_grad():
        for w, v in zip(ref.parameters(), p.values(), strict=True):
            w.copy_(v)
        x = torch.randn(4, 3, 32, 32)
        assert torch.allclose(m.apply(p, x), ref(x), atol=1e-5)


@pytest.mark.parametrize("name,shape", [("cnn_femnist", (28, 28)), ("cnn_bn", (28, 28)), ("cnn_cifar", (3, 32, 32))])
def test_channels_last_cnn_step_equals_the_default_layout(name, shape):
    """The loop runner runs CNNs channels-last on CPU: loss, gradients (and batch-norm statistics) equal the default
    layout's (a plain Model without the option), and the gradients come back in the parameters' layout."""
    c = 1 if len(shape) == 2 else 3
    meta = {"input": "image", "mean": (0.5,) * c if c > 1 else 0.5, "std": (0.25,) * c if c > 1 else 0.25}
    m = build_model(name, shape, 10, meta, hidden=32)
    assert m.channels_last
    plain = dataclasses.replace(m, channels_last=False)
    assert plain.batch_norm == m.batch_norm
    p = m.init(3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (12, *shape), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (12,), generator=g)
    mask = torch.ones(12)
    mask[-3:] = 0
    # the layout each call really ran in (the module is shared by both models): apply() takes the default layout
    # without a word where the input is not 4-d, a torch.func transform is active or the device is not the CPU
    layouts: list[bool] = []
    conv = next(mod for mod in m.module.modules() if isinstance(mod, torch.nn.Conv2d))
    conv.register_forward_hook(lambda mod, inp, out: layouts.append(
        out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()))
    g_cl, l_cl = m.value_and_grad(p, x, y, mask)
    g_ref, l_ref = plain.value_and_grad(p, x, y, mask)
    assert torch.allclose(l_cl, l_ref, atol=1e-6)
    for k in p:
        assert torch.allclose(g_cl[k], g_ref[k], atol=1e-5, rtol=1e-4), k
        assert g_cl[k].is_contiguous(), k
    with torch.no_grad():
        assert torch.allclose(m.apply(p, x), plain.apply(p, x), atol=1e-5)
    assert layouts == [True, False, True, False], layouts  # channels-last, then the default layout, twice


def _image_data(n_clients=4, per=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (per, 28, 28), dtype=torch.uint8, generator=g) for _ in range(n_clients)]
    ys = [torch.randint(0, 10, (per,), generator=g) for _ in range(n_clients)]
    tr = Split.from_lists([x[:16] for x in xs], [y[:16] for y in ys])
    te = Split.from_lists([x[16:] for x in xs], [y[16:] for y in ys])
    return FederatedData(ClientGroup(tr, te), 10, meta={"input": "image", "mean": 0.3, "std": 0.3})


@pytest.mark.parametrize("name", ["linear", "mlp", "cnn_femnist"])
def test_image_models_loop_and_vmap_agree(name):
    data = _image_data()
    kw = {"hidden": 32} if name == "cnn_femnist" else {}
    model = build_model(name, data.feature_shape, 10, data.meta, **kw)
    states = []
    for runner in ("vmap", "loop"):
        st, _ = run_rounds(make_sim(FedAvg(), data, model=model, runner=runner, batch_size=8), 2)
        states.append(st.server.params)
    for a, b in zip(T.leaves(states[0]), T.leaves(states[1]), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_auto_runner_picks_loop_for_cnn_on_cpu():
    data = _image_data()
    cnn = build_model("cnn_femnist", (28, 28), 10, data.meta, hidden=16)
    assert make_sim(FedAvg(), data, model=cnn).clients.executor.name == "loop"
    mlp = build_model("mlp", (28, 28), 10, data.meta)
    assert make_sim(FedAvg(), data, model=mlp).clients.executor.name == "stacked"


def test_lstm_loop_and_vmap_runners_agree():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 80, (n, 10), dtype=torch.uint8, generator=g) for n in (9, 14, 5)]
    ys = [torch.randint(0, 80, (n,), generator=g) for n in (9, 14, 5)]
    data = FederatedData(ClientGroup(Split.from_lists(xs, ys), Split.from_lists(xs, ys)), 80)
    model = build_model("lstm", (10,), 80, hidden=16, embed=4)
    assert model.prefer_loop_on_cpu and make_sim(FedAvg(), data, model=model).clients.executor.name == "loop"
    # on a GPU its clients form runs every client's recurrence as one (methods without one loop: cuDNN's fused
    # recurrence per client); the MLP runs stacked on both
    on_gpu = make_executor("auto", model, torch.device("cuda"))
    assert on_gpu.name == "stacked" and on_gpu.fallback.name == "loop"
    assert make_executor("auto", build_model("mlp", (10,), 80), torch.device("cuda")).name == "stacked"
    states = []
    for runner in ("vmap", "loop"):
        st, _ = run_rounds(make_sim(FedAvg(), data, model=model, runner=runner, batch_size=4), 2)
        states.append(st.server.params)
    for a, b in zip(T.leaves(states[0]), T.leaves(states[1]), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_a_users_relu_mlp_runs_the_closed_form_and_equals_its_module():
    """A ReLU MLP written as nn.Sequential (with a leading Flatten) is converted to the stacked closed form: its
    forward and gradient equal autograd through the module; anything else keeps the module path."""
    from torch import nn

    from fedmtl.models.base import Model

    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ReLU(), nn.Dropout(0.0), nn.Linear(7, 3))
    fast = Model.from_module(module, num_classes=3)
    slow = Model.from_module(module, num_classes=3)
    slow = type(slow)(module, "multiclass", 3, name="slow")  # the plain module path, for reference
    assert fast.path == "closed form" and supports_clients(fast) and slow.path == "module"
    params = fast.init(1)
    x, y = torch.randn(9, 3, 4), torch.randint(0, 3, (9,))
    mask = torch.tensor([1.0] * 7 + [0.0] * 2)
    assert torch.allclose(fast.apply(params, x), slow.apply(params, x), atol=1e-6)
    ga, la = fast.value_and_grad(params, x, y, mask)
    gb, lb = slow.value_and_grad(params, x, y, mask)
    assert torch.allclose(la, lb, atol=1e-6)
    for k in params:
        assert torch.allclose(ga[k], gb[k], atol=1e-6), k
    for other in (nn.Sequential(nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3)),
                  nn.Sequential(nn.Linear(12, 7), nn.ReLU(), nn.Dropout(0.5), nn.Linear(7, 3)),
                  nn.Sequential(nn.Linear(12, 7), nn.ReLU())):
        assert Model.from_module(other, num_classes=3).path == "module"


def test_the_fused_clients_step_equals_gradient_then_update():
    """``Model.clients_step`` (the gradient products accumulated straight into the weights) equals the stacked
    gradient followed by p -= lr g, for K clients with their own batches and padding."""
    from fedmtl.models import build_model
    from fedmtl.models.stacked import Step

    model = build_model("mlp", 6, 4, hidden=(5, 3))
    k = 4
    params = {n: torch.stack([model.init(s)[n] for s in range(k)]) for n in model.init(0)}
    x, y = torch.randn(k, 8, 6), torch.randint(0, 4, (k, 8))
    mask = (torch.arange(8).unsqueeze(0) < torch.tensor([[8], [5], [1], [3]])).float()
    g, loss = value_and_grad_clients(model, params, x, y, mask)
    want = {n: v - 0.3 * g[n] for n, v in params.items()}
    got = {n: v.clone() for n, v in params.items()}
    loss2 = model.clients_step(got, x, y, mask, Step(0.3))  # type: ignore[misc]
    assert torch.allclose(loss, loss2)
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-6), n
    for i in range(k):  # each client's loss is its own batch's mean, as one client alone
        gi, li = model.value_and_grad({n: v[i] for n, v in params.items()}, x[i], y[i], mask[i])
        assert torch.allclose(loss[i], li, atol=1e-6)
        assert torch.allclose(g["0.weight"][i], gi["0.weight"], atol=1e-6)
    # with momentum and weight decay (and without momentum), two steps: torch.optim.SGD's update
    for mom, wd in ((0.9, 1e-2), (0.0, 1e-2)):
        want = {n: v.clone() for n, v in params.items()}
        buf = {n: torch.zeros_like(v) for n, v in params.items()}
        got = {n: v.clone() for n, v in params.items()}
        fused_buf = {n: torch.zeros_like(v) for n, v in params.items()}
        for _ in range(2):
            g, _ = value_and_grad_clients(model, want, x, y, mask)
            for n in want:
                buf[n] = mom * buf[n] + g[n] + wd * want[n]
                want[n] = want[n] - 0.3 * buf[n]
            model.clients_step(got, x, y, mask, Step(0.3, mom, wd, fused_buf if mom else None))  # type: ignore[misc]
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6), (mom, n)


def test_fedem_with_a_module_model_loops_its_components_and_equals_vmap():
    """The loop runner runs the M components of a module model one after another (a vmapped convolution is several
    times slower on a CPU); the result equals the vmap runner's."""
    from torch import nn

    import fedmtl
    from fedmtl import tree as T

    rng = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(n, 1, 6, 6, generator=rng), torch.randint(0, 3, (n,), generator=rng)) for n in (13, 30, 7)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)
    out = {}
    for runner in ("loop", "vmap"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
        model = fedmtl.Model.from_module(module, 3, init="module", channels_last=False)
        res = fedmtl.run({"algorithm": {"name": "fedem", "num_components": 2}, "optim": {"lr": 0.1},
                          "run": {"rounds": 2, "batch_size": 5, "runner": runner}}, data=data, model=model)
        out[runner] = (res.server, res.client_states(), res.final["seen_test_acc_mean"])
    for a, b in zip(T.leaves(out["loop"][:2]), T.leaves(out["vmap"][:2]), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert abs(out["loop"][2] - out["vmap"][2]) < 1e-6


@pytest.mark.parametrize("flatten,shape", [(True, (5, 28, 28)), (False, (5, 3, 8, 8))])
def test_image_normalize_into_a_workspace_equals_the_transform(flatten, shape):
    """The stacked executor converts a round's images into one reused buffer: the same bits as the transform."""
    from fedmtl.models.inputs import ImageNormalize

    t = ImageNormalize((0.5, 0.4, 0.3)[: shape[1] if len(shape) == 4 else 1], (0.2, 0.25, 0.3)[
        : shape[1] if len(shape) == 4 else 1], flatten)
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    buf = torch.full((x.numel() + 7,), float("nan"))
    got = t.into(x, buf)
    assert torch.equal(got, t(x)) and got.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("name,kw,classes", [("mlp", {"hidden": (5, 4)}, 4), ("linear", {}, 2)])
def test_k_clients_m_components_gradient_and_fused_step(name, kw, classes):
    """FedEM's components on the stacked executor: K clients' M components each, with per-sample weights, equal
    each client's ``value_and_grad_stacked``; the fused step (momentum, weight decay) equals the gradient then the
    update, over two steps."""
    from fedmtl.models import build_model
    from fedmtl.models.stacked import Step

    model = build_model(name, 6, classes, **kw)
    k, m, n = 3, 2, 7
    params = {p: torch.stack([torch.stack([model.init(10 * i + j)[p] for j in range(m)]) for i in range(k)])
              for p in model.init(0)}
    x, y = torch.randn(k, n, 6), torch.randint(0, classes, (k, n))
    mask = torch.ones(k, n)
    mask[1, 4:] = 0
    w = torch.rand(k, m, n)
    g, loss = value_and_grad_clients_stacked(model, params, x, y, mask, w)
    assert loss.shape == (k, m)
    for i in range(k):
        gi, li = value_and_grad_stacked(model, {p: v[i] for p, v in params.items()}, x[i], y[i], mask[i], w[i])
        assert torch.allclose(loss[i], li, atol=1e-6)
        assert all(torch.allclose(g[p][i], gi[p], atol=1e-6) for p in gi)
    for mom, wd in ((0.9, 1e-2), (0.0, 1e-2), (0.0, 0.0)):
        want = {p: v.clone() for p, v in params.items()}
        buf = {p: torch.zeros_like(v) for p, v in params.items()}
        got = {p: v.clone() for p, v in params.items()}
        fused_buf = {p: torch.zeros_like(v) for p, v in params.items()}
        for _ in range(2):
            gw, _ = value_and_grad_clients_stacked(model, want, x, y, mask, w)
            for p in want:
                buf[p] = mom * buf[p] + gw[p] + wd * want[p]
                want[p] = want[p] - 0.3 * buf[p]
            model.components_step(got, x, y, mask, w, Step(0.3, mom, wd, fused_buf if mom else None))  # type: ignore
        for p in want:
            assert torch.allclose(got[p], want[p], atol=1e-6), (mom, wd, p)


def test_activation_estimate_is_the_largest_operation_per_example():
    """``Model.activation_elems``: per example, the most elements one operation reads and writes, the parameters
    left out (closed forms from the layer shapes)."""
    from torch import nn

    from fedmtl.models.base import Model

    mlp = build_model("mlp", 30, 5, hidden=(200,))
    # the first layer reads 30 and writes 200 elements an example; its ReLU reads and writes 200: the largest
    assert mlp.activation_elems(torch.randn(4, 30)) == max(30 + 200, 2 * 200)
    conv = Model.from_module(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)), 3,
                             channels_last=False)
    assert conv.activation_elems(torch.randn(3, 1, 8, 8)) == max(64 + 144, 2 * 144)  # the conv; the ReLU
