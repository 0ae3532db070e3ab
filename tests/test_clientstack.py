"""The clients form of a user module (``fedmtl.models.clientstack``): every standard layer's client-stacked form gives
each of K clients exactly the output and the gradient of the module run on that client alone; fallback units (vmap,
then the loop) cover any other layer with parameters; a module whose code mixes examples is refused on the data and
the run takes another path; and a run on the stacked executor equals the loop executor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import tree as T
from fedmtl.algorithms import FedAvg
from fedmtl.data.federated import ClientGroup, FederatedData, Split
from fedmtl.models import build_model, clientstack
from fedmtl.models.base import Model
from fedmtl.models.clientstack import LOOP, STACKED, VMAP, ClientsForm, StackedConv
from fedmtl.models.stacking import clients_paths, supports_clients, value_and_grad_clients
from fedmtl.testing import run_rounds, simulator


class Seq(nn.Module):
    """Sequence models: an embedding (with a padding index), a layer norm, a recurrent layer and attention."""

    def __init__(self, rnn: str, batch_first: bool, attention_mask: bool):
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        kind = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[rnn]
        extra = {"nonlinearity": "relu"} if rnn == "rnn" else {}
        self.rnn = kind(8, 6, num_layers=2, batch_first=batch_first, bidirectional=True, **extra)
        self.att = nn.MultiheadAttention(12, 3, batch_first=batch_first)
        self.head = nn.Linear(12, 5)
        self.batch_first, self.attention_mask = batch_first, attention_mask

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(idx))  # (N, T, 8)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h, _ = self.rnn(h)
        t = h.shape[1] if self.batch_first else h.shape[0]
        if self.attention_mask:
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            pad = idx == 0
            h, _ = self.att(h, h, h, attn_mask=causal, key_padding_mask=pad, need_weights=False)
        else:
            h, w = self.att(h, h, h)  # w (N, T, T): the weights averaged over heads reach the loss too
            s = w.sum((1, 2))
            h = h + (s[:, None, None] if self.batch_first else s[None, :, None])
        last = h[:, -1] if self.batch_first else h[-1]
        return self.head(last)


class Scale(nn.Module):
    """A layer fedmtl does not know: its parameters are a fallback unit (vmapped over the clients)."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.tanh(x) * self.scale ** 2


class Branchy(Scale):
    """A layer that branches on a value in Python: vmap cannot run it, so it is looped over the clients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if float(self.scale.detach().sum()) > 0 else x


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, stride=2), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.Conv2d(4, 6, 3, groups=2, dilation=1), nn.MaxPool2d(2), nn.Flatten(), Scale(6),
                         nn.Unflatten(1, (6, 1)), nn.Conv1d(6, 4, 1), nn.Flatten(), Branchy(4), nn.Linear(4, 3))


def _check_clients(model: Model, x: torch.Tensor, classes: int) -> None:
    """Outputs and gradients of K = 4 clients' stacked models against each client's own autograd, 1e-5."""
    k, n = 4, x.shape[0] // 4
    gen = torch.Generator().manual_seed(1)
    params = {key: torch.stack([v + 0.3 * torch.randn(v.shape, generator=gen) * (i > 0) for i in range(k)])
              for key, v in model.init(0).items()}
    xs = x[:k * n].reshape(k, n, *x.shape[1:])
    ys = torch.randint(0, classes, (k, n), generator=gen)
    mask = torch.ones(k, n)
    mask[2, -1] = 0  # a short batch
    grads, losses = value_and_grad_clients(model, params, xs, ys, mask)
    for i in range(k):
        gi, li = model.value_and_grad({key: v[i] for key, v in params.items()}, xs[i], ys[i], mask[i])
        assert torch.allclose(losses[i], li, atol=1e-5), (i, float(losses[i] - li))
        for key in gi:
            err = float((grads[key][i] - gi[key]).abs().max())
            assert torch.allclose(grads[key][i], gi[key], atol=1e-5), (i, key, err)


@pytest.mark.slow
@pytest.mark.parametrize("rnn,batch_first,attention_mask", [("lstm", True, True), ("gru", False, False),
                                                             ("rnn", True, False)])
def test_sequence_layers_equal_the_module_client_by_client(rnn, batch_first, attention_mask):
    torch.manual_seed(0)
    model = Model.from_module(Seq(rnn, batch_first, attention_mask), num_classes=5)
    assert model.clients_form is not None
    assert set(clients_paths(model).values()) == {STACKED}
    x = torch.randint(1, 12, (16, 7))
    x[3, :2] = 0  # padding tokens
    model.check_features(x)
    assert model.clients_form.usable, model.clients_form.reason
    _check_clients(model, x, 5)


def test_convolutions_norms_and_fallback_units_equal_the_module_client_by_client():
    torch.manual_seed(0)
    model = Model.from_module(conv_net(), num_classes=3)
    x = torch.randn(16, 1, 9, 9)
    model.check_features(x)
    assert model.clients_form is not None and model.clients_form.usable, model.clients_form
    paths = clients_paths(model)
    assert paths == {"0": STACKED, "1": STACKED, "3": STACKED, "6": VMAP, "8": STACKED, "10": LOOP, "11": STACKED}
    _check_clients(model, x, 3)


def test_a_module_that_mixes_examples_is_refused_with_the_reason():
    class Centered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x - x.mean(0))  # a batch statistic of its own: clients' examples would mix

    model = Model.from_module(Centered(), num_classes=3)
    assert supports_clients(model)  # not yet checked
    model.check_features(torch.randn(9, 4))
    assert not supports_clients(model) and "differ" in model.clients_form.reason  # type: ignore[union-attr]


def test_forms_that_cannot_exist():
    assert ClientsForm.of(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))) is None  # random masks
    assert ClientsForm.of(nn.Sequential(Scale(3))) is None  # no layer with a stacked form: nothing to gain
    root = Model.from_module(nn.Conv1d(2, 3, 1), num_classes=3).clients_form  # the module is one standard layer
    assert root is not None and root.layers == {"": STACKED}


@pytest.fixture
def im2col(monkeypatch):
    """Force the im2col path of single-input-channel stacked convolutions (CUDA only by default) on the CPU; the
    fixture's value counts the convolutions that took it."""
    taken = [0]
    original = StackedConv._im2col

    def counted(self, *args):
        out = original(self, *args)
        taken[0] += out is not None
        return out

    monkeypatch.setattr(clientstack, "use_im2col", lambda x: True)
    monkeypatch.setattr(StackedConv, "_im2col", counted)
    return taken


@pytest.mark.parametrize("kw", [{}, {"padding": 2, "stride": 2, "bias": False},
                                {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2)},
                                {"padding": "same", "dilation": 2}])
def test_im2col_of_a_one_channel_convolution_equals_the_grouped_convolution(kw, im2col, monkeypatch):
    torch.manual_seed(0)
    layer = nn.Conv2d(1, 5, 3 if kw.get("padding") == "same" else (3, 4), **kw)
    k, n = 3, 4
    w = torch.randn(k, *layer.weight.shape, requires_grad=True)
    b = None if layer.bias is None else torch.randn(k, 5, requires_grad=True)
    x = torch.randn(k * n, 1, 11, 9, requires_grad=True)
    leaves = [t for t in (w, b, x) if t is not None]
    conv = StackedConv(layer)
    del conv.weight, conv.bias
    conv.weight, conv.bias = w, b  # the clients' stacked weights, as ``functional_call`` supplies them

    def run(forced: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        monkeypatch.setattr(clientstack, "use_im2col", lambda x: forced)
        y = conv(x)
        return y, torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum(), leaves)

    (y0, g0), (y1, g1) = run(False), run(True)
    assert im2col[0] == 1 and y1.shape == y0.shape
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for name, a, c in zip(("weight", "bias", "input") if b is not None else ("weight", "input"), g1, g0, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)
    unfolded = y0.numel() // 5 * layer.weight[0, 0].numel()  # K x B x L x kh x kw
    monkeypatch.setattr(clientstack, "IM2COL_MAX_ELEMENTS", unfolded - 1)
    torch.testing.assert_close(conv(x), y0, rtol=0, atol=0)  # over the bound: the grouped convolution itself
    assert im2col[0] == 1


def test_a_cnn_femnist_round_with_im2col_equals_the_grouped_convolution(im2col, monkeypatch):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g) for n in (12, 7, 10)]
    ys = [torch.randint(0, 10, (len(x),), generator=g) for x in xs]
    split = Split.from_lists(xs, ys)
    data = FederatedData(ClientGroup(split, split), 10, meta={"input": "image", "mean": 0.3, "std": 0.3})
    servers = []
    for forced in (True, False):
        monkeypatch.setattr(clientstack, "use_im2col", lambda x, forced=forced: forced)
        model = build_model("cnn_femnist", data.feature_shape, 10, data.meta, hidden=16)
        eng = simulator(FedAvg(), data, model, runner="stacked", batch_size=4)
        before = im2col[0]  # the clients form's check on the data (building the engine) takes the path too
        st, _ = run_rounds(eng, 1)
        assert (im2col[0] > before) == forced, (forced, before, im2col[0])  # the round's own steps took it, or not
        servers.append(st.server.params)
    for a, b in zip(T.leaves(servers[0]), T.leaves(servers[1]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _image_data(seed: int = 0, sizes: tuple[int, ...] = (23, 9, 31, 14)) -> fedmtl.FederatedData:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(81, 3))
    pairs = []
    for n in sizes:
        x = rng.normal(size=(n, 1, 9, 9)).astype(np.float32)
        pairs.append((x, np.argmax(x.reshape(n, -1) @ w, 1)))
    return fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("algorithm,optim", [({"name": "fedavg"}, {"lr": 0.05}),
                                             ({"name": "ditto", "lam": 0.2}, {"lr": 0.05, "momentum": 0.9})])
def test_a_user_cnn_on_the_stacked_executor_equals_the_loop(algorithm, optim):
    data, out = _image_data(), {}
    for runner in ("stacked", "loop"):
        torch.manual_seed(0)
        model = Model.from_module(_cnn(), num_classes=3, init="module")
        cfg = {"algorithm": algorithm, "optim": optim,
               "run": {"rounds": 3, "batch_size": 5, "runner": runner, "eval_every": 3}}
        out[runner] = fedmtl.run(cfg, data=data, model=model)
    a, b = out["stacked"], out["loop"]
    assert a.summary["path"] == {"executor": "stacked", "model": "clients form",
                                 "layers": {"0": STACKED, "3": STACKED, "6": STACKED, "8": STACKED}}
    assert b.summary["path"]["executor"] == "loop"
    for x, y in zip(T.leaves(a.server), T.leaves(b.server), strict=True):
        assert torch.allclose(x, y, atol=1e-5), float((x - y).abs().max())
    for ra, rb in zip(a.history, b.history, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) < 1e-5


@pytest.mark.slow
def test_auto_takes_the_loop_for_a_cnn_on_a_cpu_and_a_refused_form_is_recorded():
    torch.manual_seed(0)
    cfg = {"algorithm": {"name": "fedavg"}, "run": {"rounds": 1, "batch_size": 5}}
    res = fedmtl.run(cfg, data=_image_data(), model=Model.from_module(_cnn(), num_classes=3))
    assert res.summary["path"] == {"executor": "loop", "model": "module"}

    class Mixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(81, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1) - x.flatten(1).mean(0))

    res = fedmtl.run(cfg, data=_image_data(), model=Model.from_module(Mixing(), num_classes=3))
    assert res.summary["path"]["executor"] == "vmap" and "differ" in res.summary["path"]["clients_form_refused"]


def _compile_run(compile_: bool, sizes: tuple[int, ...] = (23, 9, 31, 14)) -> fedmtl.RunResult:
    torch.manual_seed(0)
    model = Model.from_module(nn.Sequential(nn.Flatten(), nn.Linear(81, 8), nn.Tanh(), nn.Linear(8, 3)), 3,
                              init="module")
    cfg = {"algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1, "momentum": 0.5},
           "run": {"rounds": 2, "batch_size": 8, "runner": "stacked", "compile": compile_}}
    return fedmtl.run(cfg, data=_image_data(sizes=sizes), model=model)


def test_run_compile_falls_back_to_the_eager_step_where_the_compiler_fails(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="fedmtl"):
        a = _compile_run(True)
    assert "torch.compile failed (RuntimeError: no C++ compiler); the step runs eagerly" in caplog.text
    b = _compile_run(False)
    for x, y in zip(T.leaves(a.server), T.leaves(b.server), strict=True):
        assert torch.equal(x, y)


@pytest.mark.slow
def test_run_compile_equals_the_eager_step(caplog):
    """Clients of one size: every step has all four clients, so the step compiles once (each other number of live
    clients would be one more graph to compile, most of this test's time on a CPU).  The compiled step must really
    run: a compiler that fails falls back to the eager step with a warning, and would make the two runs equal
    trivially (an unset or malformed inductor setting such as ``TORCHINDUCTOR_COMPILE_THREADS=`` does that)."""
    from torch._dynamo.utils import counters

    counters.clear()
    with caplog.at_level("WARNING", logger="fedmtl"):
        a = _compile_run(True, (24, 24, 24, 24))
    assert "torch.compile failed" not in caplog.text, caplog.text
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    b = _compile_run(False, (24, 24, 24, 24))
    for x, y in zip(T.leaves(a.server), T.leaves(b.server), strict=True):
        assert torch.allclose(x, y, atol=1e-5), float((x - y).abs().max())
