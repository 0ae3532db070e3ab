"""The stacked executor's local steps replayed as recorded graphs (``fedmtl.models.replay``, ``run.compile = "auto"``
on a GPU): a run whose steps are run eagerly once, recorded, then replayed equals the eager run to the bit.

On the CPU the bookkeeping runs as on a GPU (held tensors refilled at each call, each step's batch copied into the
recorded step's own buffers, one recording per step shape and hyper-parameters), with the recorded step executed
again on its buffers instead of a CUDA graph's replay (``replay.EMULATE``); ``tests/test_device.py`` replays real
CUDA graphs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import tree as T
from fedmtl.models import replay
from fedmtl.models.base import Model
from fedmtl.models.stacking import compiled

from .test_clientstack import _image_data


def _data() -> fedmtl.FederatedData:
    return _image_data(sizes=(23, 9, 31, 14, 17))  # clients of several sizes: steps of several widths


def _run(cfg: dict[str, Any], model: str | None) -> fedmtl.RunResult:
    torch.manual_seed(0)
    run = {"rounds": 4, "batch_size": 8, "runner": "stacked", "eval_every": 4, **cfg.pop("run", {})}
    full = {"optim": {"lr": 0.1, "momentum": 0.5, "weight_decay": 1e-3}, **cfg, "run": run}
    if model == "tanh":  # a module's clients form: gradients by autograd through it, the update by ``_update``
        net = nn.Sequential(nn.Flatten(), nn.Linear(81, 8), nn.Tanh(), nn.Linear(8, 3))
        return fedmtl.run(full, data=_data(), model=Model.from_module(net, 3, init="module"))
    if model == "bn":
        net = nn.Sequential(nn.Flatten(), nn.Linear(81, 8), fedmtl.BatchNorm(8), nn.ReLU(), nn.Linear(8, 3))
        return fedmtl.run(full, data=_data(), model=Model.from_module(net, 3, init="module"))
    full["model"] = {"name": "mlp", "hidden": [8]}  # the closed form: the fused step
    return fedmtl.run(full, data=_data())


CASES = {
    "fedavg": ({"algorithm": {"name": "fedavg"}}, None),
    "fedavg-sampled-decayed": ({"algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1, "lr_milestones": [0.5]},
                                "run": {"clients_per_round": 3}}, None),
    "ditto": ({"algorithm": {"name": "ditto", "lam": 0.2}}, None),
    "fedprox-clients-form": ({"algorithm": {"name": "fedprox", "mu": 0.1}}, "tanh"),
    "fedem": ({"algorithm": {"name": "fedem", "num_components": 2}}, None),
    "fedbn": ({"algorithm": {"name": "fedbn"}}, "bn"),
    "mrmtl": ({"algorithm": {"name": "mrmtl", "lam": 0.5}}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_steps_equal_the_eager_run(case, monkeypatch):
    cfg, model = CASES[case]
    eager = _run({k: dict(v) for k, v in cfg.items()}, model)
    monkeypatch.setattr(replay, "EMULATE", True)
    replays = []
    original = replay._Graph.replay

    def counted(self: Any, args: Any) -> None:
        replays.append(self)
        original(self, args)

    monkeypatch.setattr(replay._Graph, "replay", counted)
    replayed = _run({k: dict(v) for k, v in cfg.items()}, model)
    assert len({id(g) for g in replays}) >= 2 and len(replays) >= 5, "the steps were not recorded and replayed"
    if case == "fedavg":  # one call signature: its steps of every width read one shared batch buffer
        assert len({g.inputs[0].untyped_storage().data_ptr() for g in replays}) == 1
    for a, b in zip(T.leaves(eager.server), T.leaves(replayed.server), strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    assert eager.history[-1]["seen_test_acc"] == replayed.history[-1]["seen_test_acc"]
    assert [h["train_loss"] for h in eager.history] == [h["train_loss"] for h in replayed.history]


def test_a_failed_recording_runs_the_steps_eagerly_with_one_warning(monkeypatch, caplog):
    def refuse(self: Any, body: Any, inputs: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    cfg, model = CASES["fedavg"]
    eager = _run({k: dict(v) for k, v in cfg.items()}, model)
    monkeypatch.setattr(replay, "EMULATE", True)
    monkeypatch.setattr(replay.StepGraphs, "_capture", refuse)
    with caplog.at_level(logging.WARNING, logger="fedmtl"):
        res = _run({k: dict(v) for k, v in cfg.items()}, model)
    warned = [r for r in caplog.records if "recording the stacked step as a CUDA graph failed" in r.getMessage()]
    assert len(warned) == 1 and "operation not permitted" in warned[0].getMessage()
    for a, b in zip(T.leaves(eager.server), T.leaves(res.server), strict=True):
        assert torch.equal(a, b)


def test_run_compile_auto_replays_on_a_gpu_only():
    m = fedmtl.models.build_model("mlp", (1, 9, 9), 3, {}, hidden=(8,))
    assert not compiled(m, "auto", "cpu").replay_steps and not compiled(m, "auto", "cpu").compile_clients
    on = compiled(m, "auto", "cuda")
    assert on.replay_steps and not on.compile_clients and on is not m and not on.cache
    assert compiled(m, True, "cuda").compile_clients and not compiled(m, True, "cuda").replay_steps
    assert compiled(m, False, "cuda") is m


def test_held_tensors_keep_their_storage_and_a_new_shape_drops_the_recordings():
    g = replay.StepGraphs(torch.device("cpu"))
    a = g.hold("p", torch.ones(3))
    g.graphs["k"] = replay._Graph(None, (), lambda: None)
    b = g.hold("p", torch.full((3,), 2.0))
    assert a is b and torch.equal(a, torch.full((3,), 2.0)) and "k" in g.graphs
    c = g.hold("p", torch.zeros(4), zero=True)
    assert c is not a and not g.graphs and torch.equal(c, torch.zeros(4))
