"""Weights and other tensors read from files a user or a node could have written are checked for kind (before the
file is opened), size, dtype, shape and values *after* conversion to the dtype they are used in: ``[model] weights``
and ``[model.adapters] base`` (``load_base``), checkpoints' server state, features given as arrays, adjacency files,
run summaries read by ``fedmtl compare`` and a memory-mapped store's undo journal.  A refusal is one line naming the
file and the key, exit code 2; a FIFO never blocks the reader."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fedmtl.cli import EXIT_INPUT, main
from fedmtl.models.lora import load_base

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 4
dim = 5
n_test = 20
max_samples = 40
seed = 1

[model]
name = "linear"
weights = "{weights}"

[algorithm]
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = 2
batch_size = 16
"""


def _returns(fn: Callable[[], Any], fifo: Path, seconds: float = 20) -> Any:
    """``fn()``'s result or raised exception; fails (after unblocking it) if it waits on the FIFO ``fifo``."""
    got: list[Any] = []

    def call() -> None:
        try:
            got.append(fn())
        except BaseException as e:  # noqa: BLE001 (returned to the caller)
            got.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if fifo.exists() else None
        if fd is not None:
            os.close(fd)
        pytest.fail(f"blocked reading the FIFO {fifo}")
    return got[0]


def _linear_state(**over: torch.Tensor) -> dict[str, torch.Tensor]:
    from fedmtl.models import build_model

    state = {k: v.detach().clone().contiguous() for k, v in build_model("linear", (5,), 2).module.state_dict().items()}
    return {**state, **over}


WEIGHTS = {  # a weights file given as [model] weights: how it is damaged, words of the refusal
    "overflow": (lambda s: {k: torch.full(v.shape, 1e299, dtype=torch.float64) for k, v in s.items()},
                 "beyond the range of torch.float32"),
    "int": (lambda s: {k: torch.ones(v.shape, dtype=torch.int64) for k, v in s.items()}, "dtype torch.int64"),
    "bool": (lambda s: {k: torch.ones(v.shape, dtype=torch.bool) for k, v in s.items()}, "dtype torch.bool"),
    "nan": (lambda s: {k: torch.full_like(v, float("nan")) for k, v in s.items()}, "NaN or Inf"),
    "shape": (lambda s: {k: v[..., :1] for k, v in s.items()}, "shape"),
}


@pytest.mark.parametrize("kind", [*WEIGHTS, "fifo", "garbage"])
def test_model_weights_that_do_not_fit_are_refused_in_one_line(tmp_path, capsys, kind):
    """Finding: float64 weights of 1e299 passed the finite check and became Inf in float32 (the run then blamed
    optim.lr); int64 and bool weights were cast silently."""
    w = tmp_path / "w.safetensors"
    if kind == "fifo":
        os.mkfifo(w)
    elif kind == "garbage":
        w.write_bytes(os.urandom(100))
    else:
        save_file(WEIGHTS[kind][0](_linear_state()), str(w))
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(weights=w))
    code = _returns(lambda: main(["run", str(cfg), "--out", str(tmp_path / "o"), "-q"]), w)
    err = capsys.readouterr().err.strip()
    assert code == EXIT_INPUT, err
    assert len(err.splitlines()) == 1 and "model.weights" in err and str(w) in err and "Traceback" not in err, err
    words = {"fifo": "FIFO", "garbage": "not a readable safetensors file"}.get(kind) or WEIGHTS[kind][1]
    assert words in err, err
    if kind not in ("fifo", "garbage"):
        assert "'weight'" in err or "'bias'" in err, err  # the tensor is named


def test_load_base_keeps_integer_buffers_and_converts_floats_within_range(tmp_path):
    """BatchNorm's num_batches_tracked is integer by design: an integer tensor there is fine, a float one is not;
    float64 weights within float32's range are converted to the module's dtype."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    state = {k: (v.to(torch.int32) + 7 if k.endswith("num_batches_tracked") else v.double() + 0.5)
             for k, v in state.items()}
    path = tmp_path / "b.safetensors"
    save_file(state, str(path))
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    load_base(fresh, path, "model.weights")
    got = fresh.state_dict()
    assert got["1.num_batches_tracked"].dtype == torch.int64 and int(got["1.num_batches_tracked"]) == 7
    assert got["0.weight"].dtype == torch.float32 and torch.allclose(got["0.weight"].double(), state["0.weight"])
    save_file({**state, "1.num_batches_tracked": torch.tensor(7.0)}, str(path))
    with pytest.raises(ValueError, match=r"'1.num_batches_tracked': dtype torch.float32, expected integer"):
        load_base(fresh, path, "model.weights")


def test_features_beyond_float32_are_refused_after_conversion():
    import fedmtl
    from fedmtl.data.federated import DataError

    x = np.ones((4, 3))
    x[2, 1] = 1e299  # finite in float64, Inf in float32
    with pytest.raises(DataError, match="client 1: features beyond the range of torch.float32"):
        fedmtl.FederatedData.from_arrays(train=[(np.ones((4, 3)), np.zeros(4, int)), (x, np.zeros(4, int))],
                                         test=[(np.ones((2, 3)), np.zeros(2, int))] * 2, num_classes=2)


@pytest.mark.parametrize("kind", ["fifo", "nan", "negative", "complex"])
def test_an_adjacency_file_is_checked_before_and_after_reading(tmp_path, kind):
    from fedmtl import graph as G

    path = tmp_path / ("a.npy" if kind != "fifo" else "a.txt")
    a = G.ring(4).adjacency().toarray()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        a = a.astype(np.complex128) if kind == "complex" else a
        a[0, 1] = a[1, 0] = {"nan": np.nan, "negative": -1.0, "complex": 1j}[kind]
        np.save(path, a)
    got = _returns(lambda: G.from_file(path, 4), path)
    assert isinstance(got, G.GraphError), got
    assert str(path) in str(got) and {"fifo": "FIFO", "nan": "finite", "negative": ">= 0",
                                      "complex": "real numbers"}[kind] in str(got), got


def test_compare_refuses_a_summary_that_is_a_fifo(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    os.mkfifo(run / "summary.json")
    assert _returns(lambda: main(["compare", str(run), "--out", str(tmp_path / "c")]), run / "summary.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FIFO" in err and "summary.json" in err, err


def test_a_store_journal_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    from fedmtl.engine.store import ClientStore, StoreError

    d = tmp_path / "store"

    def init(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(len(ids), 3)}

    ClientStore(5, init, "mmap", d, journal=True).close()
    (d / "undo.log").unlink()
    os.mkfifo(d / "undo.log")
    got = _returns(lambda: ClientStore(5, init, "mmap", d, journal=True, resume=True), d / "undo.log")
    assert isinstance(got, StoreError) and "undo.log" in str(got) and "FIFO" in str(got), got
