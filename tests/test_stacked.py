"""The ``stacked`` executor: all clients of a round as one eager computation on stacked tensors, each step on the
clients still live (a prefix).  It equals the loop executor on every path it takes (plain SGD with the fused step,
momentum, drop_last, several epochs, stragglers, several seeds batched), is what ``auto`` picks for models with a
clients form, falls back to vmap for algorithms without one, and says so in the summary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import tree as T
from fedmtl.data.federated import client_batches, epoch_orders
from fedmtl.runs.seeds import run_seeds


def _data(seed: int = 0) -> fedmtl.FederatedData:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(6, 3))
    pairs = []
    for n in (57, 9, 33, 120, 14, 71):  # unequal clients: many steps for some, one for others
        x = rng.normal(size=(n, 2, 3)).astype(np.float32)
        pairs.append((x, np.argmax(x.reshape(n, -1) @ w + rng.normal(size=(n, 3)), 1)))
    return fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)


def _module() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _run(runner: str, algorithm: dict, optim: dict, run: dict | None = None) -> fedmtl.RunResult:
    torch.manual_seed(0)
    run = dict(run or {})
    systems = run.pop("systems", None)
    cfg = {"algorithm": algorithm, "optim": optim, "run": {"rounds": 3, "batch_size": 10, "runner": runner,
                                                            "eval_every": 3, **run}}
    if systems:
        cfg["systems"] = systems
    return fedmtl.run(cfg, data=_data(), model=fedmtl.Model.from_module(_module(), 3, init="module"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,optim,run", [
    ({"name": "fedavg"}, {"lr": 0.1}, {}),  # plain SGD: the fused step
    ({"name": "fedavg"}, {"lr": 0.1}, {"drop_last": True, "sampling_rate": 0.5}),
    ({"name": "fedprox", "mu": 0.5}, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}, {"local_epochs": 2}),
    ({"name": "ditto", "lam": 0.3}, {"lr": 0.1, "momentum": 0.5}, {"batch_size": 7}),
    # FedEM: the E-step over every client's first epoch, per-sample weights in the M-step (closed form per component)
    ({"name": "fedem", "num_components": 2}, {"lr": 0.1}, {}),
    ({"name": "fedem", "num_components": 3}, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
     {"local_epochs": 2, "systems": {"speed_low": 0.2}}),  # stragglers: fewer steps, the E-step over all the data
    ({"name": "fedem", "num_components": 2}, {"lr": 0.1}, {"drop_last": True, "sampling_rate": 0.5}),
])
def test_stacked_equals_the_loop_on_every_path(algorithm, optim, run):
    a, b = _run("stacked", algorithm, optim, run), _run("loop", algorithm, optim, run)
    assert a.summary["path"] == {"executor": "stacked", "model": "closed form"}
    for x, y in zip(T.leaves(a.server), T.leaves(b.server), strict=True):
        assert torch.allclose(x, y, atol=1e-5), float((x - y).abs().max())
    if algorithm["name"] == "ditto":
        assert torch.allclose(a.client_states().v["1.weight"], b.client_states().v["1.weight"], atol=1e-5)
    if algorithm["name"] == "fedem":
        assert torch.allclose(a.client_states().pi, b.client_states().pi, atol=1e-5)
    for ra, rb in zip(a.history, b.history, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) < 1e-5
    assert abs(a.final["seen_test_acc_mean"] - b.final["seen_test_acc_mean"]) < 1e-6


def test_auto_picks_stacked_where_it_applies_and_vmap_elsewhere():
    assert _run("auto", {"name": "fedavg"}, {"lr": 0.1}).summary["path"]["executor"] == "stacked"
    assert _run("auto", {"name": "fedem", "num_components": 2}, {"lr": 0.1}).summary["path"]["executor"] == "stacked"
    scaffold = _run("auto", {"name": "scaffold"}, {"lr": 0.1})
    assert scaffold.summary["path"] == {"executor": "vmap", "model": "closed form"}  # no clients form: vmap
    torch.manual_seed(0)
    res = fedmtl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 1}}, data=_data(),
                     model=fedmtl.Model.from_module(nn.Sequential(nn.Flatten(), nn.Linear(6, 3), nn.Tanh()), 3))
    assert res.summary["path"] == {"executor": "stacked", "model": "clients form", "layers": {"1": "stacked"}}

    class Own(nn.Module):  # parameters of its own, used by code fedmtl cannot see: no clients form
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(6, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x.flatten(1) @ self.w)

    res = fedmtl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 1}}, data=_data(),
                     model=fedmtl.Model.from_module(Own(), 3))
    assert res.summary["path"] == {"executor": "vmap", "model": "module"}
    with pytest.raises(ValueError, match="no clients form"):
        fedmtl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 1, "runner": "stacked"}}, data=_data(),
                   model=fedmtl.Model.from_module(Own(), 3))


@pytest.mark.parametrize("algorithm,run", [
    ({"name": "fedavg"}, {}),
    ({"name": "fedem", "num_components": 2}, {}),  # the E-step over the batches themselves
    ({"name": "fedem", "num_components": 2}, {"local_epochs": 2}),  # over the first epochs gathered apart
])
def test_several_seeds_on_the_stacked_executor_equal_their_separate_runs(algorithm, run):
    """On the stacked executor the replicas train one after the other (evaluation shared) and each equals its run."""
    from fedmtl.config import validate

    raw = {"model": {"name": "mlp", "hidden": [8]}, "algorithm": algorithm, "optim": {"lr": 0.1},
           "run": {"rounds": 2, "batch_size": 10, "sampling_rate": 0.5, **run}}
    cfg = validate(raw, data_given=True)
    together = run_seeds(cfg, [4, 9], data=_data(), progress=False)
    for seed, res in zip((4, 9), together.runs, strict=True):
        alone = fedmtl.run({**raw, "run": {**raw["run"], "seed": seed}}, data=_data())
        for x, y in zip(T.leaves(res.server), T.leaves(alone.server), strict=True):
            assert torch.allclose(x, y, atol=1e-6)


def test_client_batches_hold_only_live_batches_in_step_major_prefix_order():
    data = _data()
    tr = data.seen.train
    counts = tr.counts
    orders = epoch_orders(counts, 2, torch.Generator().manual_seed(1))
    orders = orders._replace(limit=torch.tensor([3, 1, 5, 30, 2, 4]))  # stragglers: at most this many steps
    steps = torch.minimum(2 * ((counts + 9) // 10), orders.limit)
    with pytest.raises(ValueError, match="sorted by their live steps"):
        client_batches(tr, torch.arange(6), orders, torch.arange(6), 10)
    order = torch.argsort(-steps, stable=True)  # most live steps first
    x, y, mask, n, live = client_batches(tr, torch.arange(6), orders, order, 10)[:5]
    steps = steps[order]
    assert list(live) == [int((steps > s).sum()) for s in range(int(steps.max()))]
    assert x.shape[0] == sum(live) == int(steps.sum()) and mask.shape == (sum(live), 10)
    assert n.tolist() == counts[order].float().tolist()
    assert int(mask.sum()) <= 2 * int(counts.sum())
    # with the first epochs: each client's whole data once, packed, and every slot's example found there
    d = client_batches(tr, torch.arange(6), orders, order, 10, first_epoch=True)
    assert d.pos is not None and d.first is not None
    x0, y0, owner, real0 = d.first
    assert torch.bincount(owner, weights=real0, minlength=6).tolist() == counts[order].float().tolist()
    assert owner.tolist() == sorted(owner.tolist())  # client after client
    at = 0
    for t, k in enumerate(live):
        for c in range(k):
            real = d.mask[at + c] > 0
            p = d.pos[at + c][real]
            assert torch.equal(x0[p], d.x[at + c][real]) and torch.equal(y0[p], d.y[at + c][real]), (t, c)
            assert (owner[p] == c).all() and (real0[p] == 1).all()
        at += k
    # one epoch and no straggler: the batches are the first epoch (a view), each row's slots its own client's
    one = epoch_orders(counts, 1, torch.Generator().manual_seed(2))
    d = client_batches(tr, torch.arange(6), one, torch.argsort(-counts, stable=True), 10, first_epoch=True)
    assert d.first is not None and d.pos is not None and d.first[0].data_ptr() == d.x.data_ptr()
    assert torch.bincount(d.first[2], weights=d.first[3], minlength=6).tolist() == counts[
        torch.argsort(-counts, stable=True)].float().tolist()


@pytest.mark.parametrize("batch,drop_last,limit", [(10, False, None), (10, True, None), (200, False, None),
                                                   (7, False, [3, 1, 9, 30, 2, 4]), (16, True, [1, 1, 2, 0, 5, 3])])
def test_one_epoch_client_batches_are_the_padded_layouts_live_steps(batch, drop_last, limit):
    """With one epoch a round the stacked executor's rows are built for the live batches only
    (``federated._one_epoch_rows``); they are the padded layout's (``round_batches``) live steps, step-major: the same
    examples, labels, masks and padding, with and without stragglers, ``drop_last`` and a batch larger than every
    client.  The first epochs are a view where no straggler cuts them, and otherwise built whole."""
    from fedmtl.data.federated import round_batches

    tr = _data().seen.train
    orders = epoch_orders(tr.counts, 1, torch.Generator().manual_seed(3))
    if limit is not None:
        orders = orders._replace(limit=torch.tensor(limit))
    ref = round_batches(tr, torch.arange(6), orders, torch.arange(6), batch, drop_last=drop_last)
    nonempty = (ref.mask.sum(-1) > 0).sum(1)  # (K,): one epoch, a prefix of steps
    n_live = nonempty if limit is None else torch.minimum(nonempty, torch.tensor(limit))
    rows = torch.argsort(-n_live, stable=True)
    for first_epoch in (False, True):
        d = client_batches(tr, torch.arange(6), orders, rows, batch, drop_last=drop_last, first_epoch=first_epoch)
        picked = [(t, int(k)) for t in range(max(int(n_live.max()), 1)) for k in rows if t < n_live[k]]
        assert list(d.live) == [sum(1 for tt, _ in picked if tt == t) for t in range(len(d.live))]
        assert torch.equal(d.x, torch.stack([ref.x[k, t] for t, k in picked]) if picked else d.x[:0])
        assert torch.equal(d.y, torch.stack([ref.y[k, t] for t, k in picked]) if picked else d.y[:0])
        assert torch.equal(d.mask, torch.stack([ref.mask[k, t].float() for t, k in picked]) if picked else d.mask[:0])
        assert d.n.tolist() == tr.counts[rows].float().tolist()
        if first_epoch:
            assert d.first is not None and d.pos is not None
            assert (d.first[0].data_ptr() == d.x.data_ptr()) == bool((n_live == nonempty).all())
            x0, _, owner, real0 = d.first
            for r, (_, k) in enumerate(picked):  # every real slot's example, found in its client's first epoch
                at = d.pos[r][d.mask[r] > 0]
                assert torch.equal(x0[at], d.x[r][d.mask[r] > 0])
                assert (owner[at] == int((rows == k).nonzero())).all() and (real0[at] == 1).all()


def test_a_subclass_that_rewrites_client_update_does_not_inherit_the_clients_form():
    from dataclasses import dataclass
    from typing import ClassVar

    from fedmtl.algorithms import Ditto, FedAvg, FedEM, FedProx
    from fedmtl.algorithms.fedavg import FedAvgFT

    @dataclass(frozen=True)
    class Mine(FedAvg):
        name: ClassVar[str] = "mine_stacked_test"

        def client_update(self, ctx, payload, state, batches, lr):
            return super().client_update(ctx, payload, state, batches, lr)

    assert FedAvg.clients_form() and FedProx.clients_form() and FedAvgFT.clients_form() and Ditto.clients_form()
    assert FedEM.clients_form() and not Mine.clients_form()


def test_the_engine_picks_a_user_modules_path_by_its_layers():
    """No undocumented flag: on a CPU convolutions and recurrent layers loop, a ReLU MLP runs the stacked closed form,
    any other module with a clients form the stacked executor, the rest vmaps; on a GPU every module with a clients
    form runs stacked (recurrent layers loop for the methods without one); an explicit prefer_loop_on_cpu still
    decides."""
    from fedmtl.engine.executors import make_executor

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # make_executor reads only the device's type
    cnn = fedmtl.Model.from_module(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)), 3)
    assert cnn.prefer_loop_on_cpu and not cnn.prefer_loop_on_cuda and make_executor("auto", cnn, cpu).name == "loop"

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 3)

        def forward(self, x):
            return self.out(self.rnn(x)[0][:, -1])

    rec = fedmtl.Model.from_module(Rec(), 3)
    assert rec.prefer_loop_on_cpu and rec.prefer_loop_on_cuda
    assert make_executor("auto", fedmtl.Model.from_module(_module(), 3), cpu).name == "stacked"
    odd = fedmtl.Model.from_module(nn.Sequential(nn.Linear(6, 3), nn.Tanh()), 3)
    assert make_executor("auto", odd, cpu).name == "stacked" and odd.clients_form.usable is None  # not yet verified
    forced = fedmtl.Model.from_module(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), 3, prefer_loop_on_cpu=False)
    assert make_executor("auto", forced, cpu).name == "stacked"
    for model in (cnn, odd):
        assert make_executor("auto", model, gpu).name == "stacked"
    on_gpu = make_executor("auto", rec, gpu)  # all clients' recurrences as one, cuDNN's per client for the rest
    assert on_gpu.name == "stacked" and on_gpu.fallback.name == "loop"
    no_form = fedmtl.Model.from_module(nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(6, 3)), 3)
    assert no_form.clients_form is None and make_executor("auto", no_form, cpu).name == "vmap"
