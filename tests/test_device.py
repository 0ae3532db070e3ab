"""Every algorithm, model and command on a CUDA device, checked against the same run on the CPU.

Skipped on a machine without CUDA (CI).  ``FEDMTL_TEST_DEVICE`` names the device to check (default ``cuda`` where
one is available); ``FEDMTL_TEST_DEVICE=cpu`` runs the same checks CPU against CPU, which exercises the tests
themselves on any machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import ALGORITHMS, FedAvg, FedEM
from fedmtl.cli import main
from fedmtl.data.federated import ClientGroup, FederatedData, Split
from fedmtl.engine.evaluation import summarize
from fedmtl.models import build_model
from fedmtl.testing import all_client_states, run_rounds, simulator, toy_model, toy_opt

from .test_models import _image_data
from .test_rundir import TINY

DEVICE = os.environ.get("FEDMTL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(not DEVICE, reason="no CUDA device (FEDMTL_TEST_DEVICE names one to check)")

# float sums on the device run in another order than on the CPU; a few rounds of SGD keep the difference small
ATOL = 2e-4


def _on(tree, device: str) -> None:
    for leaf in T.leaves(tree):
        assert leaf.device.type == torch.device(device).type, f"a state tensor is on {leaf.device}, not {device}"


def _close(a, b, what: str, atol: float = ATOL) -> None:
    la, lb = T.leaves(a), T.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb, strict=True):
        x, y = x.detach().cpu(), y.detach().cpu()
        if x.dtype.is_floating_point:
            torch.testing.assert_close(y, x, atol=atol, rtol=1e-3, equal_nan=True, msg=lambda m, w=what: f"{w}: {m}")
        else:
            assert torch.equal(x, y), what


def _summaries_close(a: dict, b: dict, what: str, atol: float = ATOL) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if np.isnan(a[k]) and np.isnan(b[k]):
            continue
        assert abs(a[k] - b[k]) <= atol * max(1.0, abs(a[k])), f"{what}: {k} cpu {a[k]} vs {DEVICE} {b[k]}"


@pytest.mark.parametrize("runner", ["stacked", "vmap", "loop"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_on_the_device_equals_its_cpu_run(name, runner, small_data):
    if runner == "stacked" and not ALGORITHMS[name].clients_form():
        pytest.skip(f"{name} has no clients form (the stacked executor hands it to vmap)")
    out = {}
    for dev in ("cpu", DEVICE):
        cls = ALGORITHMS[name]
        eng = simulator(cls(**cls.toy.kwargs), small_data, toy_model(cls, small_data), toy_opt(cls),
                        runner=runner, sampling_rate=0.5, device=dev)
        st, rows = run_rounds(eng, 3)
        _on(st.server, dev)
        out[dev] = (st.server, all_client_states(eng), [r["train_loss"] for r in rows], summarize(eng.evaluate(st)))
    (sa, ca, la, ea), (sb, cb, lb, eb) = out["cpu"], out[DEVICE]
    _close(sa, sb, f"{name} server state")
    _close(ca, cb, f"{name} client states")
    np.testing.assert_allclose(lb, la, atol=ATOL, rtol=1e-3, err_msg=f"{name} training losses")
    _summaries_close(ea, eb, f"{name} evaluation")


def _text_data() -> FederatedData:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 80, (n, 10), dtype=torch.uint8, generator=g) for n in (9, 14, 5)]
    ys = [torch.randint(0, 80, (n,), generator=g) for n in (9, 14, 5)]
    return FederatedData(ClientGroup(Split.from_lists(xs, ys), Split.from_lists(xs, ys)), 80)


MODELS = {  # (data, model name, model options): the models of the benchmarks, small
    "mlp": (_image_data, "mlp", {}),
    "cnn_femnist": (_image_data, "cnn_femnist", {"hidden": 32}),
    "lstm": (_text_data, "lstm", {"hidden": 16, "embed": 4}),
}


@pytest.fixture
def no_tf32():
    """cuDNN convolutions in full fp32 (their default TF32 rounds inputs to 10 mantissa bits): the comparison with
    the CPU then checks the code path, not the precision setting."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("alg", ["fedavg", "fedem"])
@pytest.mark.parametrize("runner", ["vmap", "loop"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_models_on_the_device_equal_their_cpu_runs(model, runner, alg, no_tf32):
    make_data, mname, kw = MODELS[model]
    data = make_data()

    def engine(dev: str):
        m = build_model(mname, data.feature_shape, data.num_classes, data.meta, **kw)
        return simulator(FedAvg() if alg == "fedavg" else FedEM(num_components=2), data, m, runner=runner,
                         batch_size=4, device=dev)

    _device_equals_cpu(engine, model)


def _device_equals_cpu(engine, what: str) -> None:
    """Two rounds of ``engine(dev)`` on the CPU and on the device: the same server state, losses and evaluation."""
    out = {}
    for dev in ("cpu", DEVICE):
        eng = engine(dev)
        st, rows = run_rounds(eng, 2)
        _on(st.server, dev)
        out[dev] = (st.server, [r["train_loss"] for r in rows], summarize(eng.evaluate(st)))
    _close(out["cpu"][0], out[DEVICE][0], f"{what} server state")
    np.testing.assert_allclose(out[DEVICE][1], out["cpu"][1], atol=ATOL, rtol=1e-3)
    _summaries_close(out["cpu"][2], out[DEVICE][2], f"{what} evaluation")


def test_run_command_on_the_device_equals_the_cpu_run_and_resumes(tmp_path: Path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(rounds=4, every=2))
    finals = {}
    for i, dev in enumerate(("cpu", DEVICE)):
        out = tmp_path / f"run-{i}"
        assert main(["run", str(cfg), "--out", str(out), "-q", "--device", dev, "--seeds", "1,2"]) == 0
        finals[i] = json.loads((out / "summary.json").read_text())
    a, b = finals[0]["final"], finals[1]["final"]
    for k, v in a.items():
        assert abs(v["mean"] - b[k]["mean"]) <= ATOL * max(1.0, abs(v["mean"])), k
    # the checkpoint written on the device loads back onto it: --resume of the finished run reports it again
    seed1 = json.loads((tmp_path / "run-1" / "seed-1" / "summary.json").read_text())["final"]
    assert main(["run", str(cfg), "--out", str(tmp_path / "run-1"), "-q", "--device", DEVICE, "--seeds", "1,2",
                 "--resume"]) == 0
    assert json.loads((tmp_path / "run-1" / "seed-1" / "summary.json").read_text())["final"] == seed1


def test_tuned_reproduction_on_the_device_equals_the_cpu_one(tmp_path: Path):
    """``fedmtl reproduce tuned --device``: the studies and reruns run there, their rows record it, and the table
    equals the CPU's (the same trials: TPE's first draws do not depend on the results)."""
    pytest.importorskip("optuna")
    rows = {}
    for i, dev in enumerate(("cpu", DEVICE)):
        out = tmp_path / f"run-{i}"
        assert main(["reproduce", "tuned", "--out", str(out), "--quick", "--trials", "2", "--methods", "fedavg,fedem",
                     "--federations", "synthetic_mixture", "--device", dev, "-q"]) == 0
        rows[i] = json.loads((out / "summary.json").read_text())["federations"]["synthetic_mixture"]["methods"]
    for m, r in rows[0].items():
        d = rows[1][m]
        assert d["device"] == DEVICE and r["device"] == "cpu"
        assert d["best_params"] == r["best_params"], m
        np.testing.assert_allclose(d["avg_values"], r["avg_values"], atol=0.5, err_msg=m)  # %: a client's example


@pytest.mark.parametrize("alg", ["fedavg", "fedem", "fedsa_lora"])
@pytest.mark.parametrize("runner", ["stacked", "vmap", "loop"])
def test_adapters_on_the_device_equal_their_cpu_runs(runner, alg):
    """The adapters workload's model (a character transformer, LoRA on its attention and MLP projections, the base
    frozen and shared) trains on the device as on the CPU with every executor."""
    from fedmtl.algorithms import FedSALoRA
    from fedmtl.models.base import Model
    from fedmtl.models.lora import seeded_base

    if runner == "stacked" and not ALGORITHMS[alg].clients_form():
        pytest.skip(f"{alg} has no clients form (the stacked executor hands it to vmap: the vmap case)")
    data = _text_data()

    def engine(dev: str):
        base = build_model("char_transformer", (10,), 80, d_model=16, layers=1, heads=2).module
        seeded_base(base, 0)
        m = Model.from_module(base, 80, adapters={"rank": 2, "target": ["attn.q", "attn.v", "mlp.fc1"]})
        object.__setattr__(m, "token_input", True)
        a = {"fedavg": FedAvg(), "fedem": FedEM(num_components=2), "fedsa_lora": FedSALoRA()}[alg]
        return simulator(a, data, m, runner=runner, batch_size=4, device=dev)

    _device_equals_cpu(engine, f"{alg} adapters")


@pytest.mark.parametrize("runner", ["stacked", "vmap", "loop"])
@pytest.mark.parametrize("alg", ["fedavg", "fedem"])
def test_a_federation_resident_on_the_device_equals_one_on_the_host(alg, runner):
    """``run.data_on_device``: the examples held on the device (moved once, in their stored dtype) and held on the host
    (each call's batches copied over) give the same run; the resident copy keeps the uint8 images and the host
    offsets.  On a CPU both settings hold the data where it is."""
    data = _image_data()
    out = {}
    for resident in (True, False):
        m = build_model("mlp", data.feature_shape, data.num_classes, data.meta)
        eng = simulator(FedAvg() if alg == "fedavg" else FedEM(num_components=2), data, m, runner=runner,
                        batch_size=4, device=DEVICE, data_on_device=resident)
        held = eng.clients.data.seen.train
        assert held.x.dtype == torch.uint8 and held.offsets.device.type == "cpu"
        assert held.x.device.type == (torch.device(DEVICE).type if resident else "cpu")
        st, rows = run_rounds(eng, 2)
        out[resident] = (st.server, [r["train_loss"] for r in rows], summarize(eng.evaluate(st)))
    _close(out[False][0], out[True][0], f"{alg} {runner} server state", atol=1e-6)
    np.testing.assert_allclose(out[True][1], out[False][1], atol=1e-6, rtol=1e-6)
    _summaries_close(out[False][2], out[True][2], f"{alg} {runner} evaluation", atol=1e-6)


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("runner", ["stacked", "vmap", "loop"])
@pytest.mark.parametrize("alg", ["fedavg", "fedem"])
def test_a_round_makes_no_undocumented_host_sync(alg, runner, resident):
    """A round on a GPU never waits for the device except at the waits ``fedmtl.hostsync`` documents (the round's
    screen, client states to the host store): every executor's round, FedEM's too, under
    ``torch.cuda.set_sync_debug_mode("warn")``, with the federation on the device and on the host.  All waits found
    are listed, each at the line of fedmtl that asked for it.  On a CPU there is nothing to wait for."""
    from fedmtl.hostsync import host_waits

    if torch.device(DEVICE).type != "cuda":
        pytest.skip("host synchronisation is a GPU matter")
    data = _image_data()
    m = build_model("mlp", data.feature_shape, data.num_classes, data.meta)
    eng = simulator(FedAvg() if alg == "fedavg" else FedEM(num_components=2), data, m, runner=runner,
                    batch_size=4, device=DEVICE, data_on_device=resident)
    st = eng.init_state()
    for _ in range(2):  # the first rounds build what later rounds reuse (the clients form's check, the steps
        eng.round(st)  # recorded as CUDA graphs in the second: ``models.replay``)
    torch.cuda.synchronize()
    row, found = host_waits(lambda: eng.round(st))
    assert np.isfinite(row["train_loss"])
    assert not found, f"{alg} {runner}: undocumented host synchronisations in a round:\n" + "\n".join(found)


def test_host_tables_reach_the_device_whatever_their_layout():
    """``fedmtl.hostsync.to_device``: index tables built on the host (expanded views among them: their entries share
    memory and cannot be pinned as they are) arrive on the device equal, dense or not."""
    from fedmtl.hostsync import to_device

    for x in (torch.arange(6), torch.arange(3).view(1, 3).expand(4, 3), torch.arange(12).view(3, 4).T,
              torch.arange(10)[2:8:2]):
        y = to_device(x, DEVICE)
        assert y.device.type == torch.device(DEVICE).type and torch.equal(y.cpu(), x)


def _uneven_images(sizes=(21, 9, 30, 14, 17), seed=1) -> FederatedData:
    """Clients of several sizes: the steps of a round have several numbers of live clients (several recordings)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    split = Split.from_lists(xs, ys)
    return FederatedData(ClientGroup(split, split), 10, meta={"input": "image", "mean": 0.3, "std": 0.3})


@pytest.mark.parametrize("model", ["mlp", "cnn_femnist", "lstm"])
@pytest.mark.parametrize("alg", ["fedavg", "fedem", "ditto"])
def test_replayed_steps_equal_the_eager_rounds_on_the_device(alg, model, monkeypatch, caplog):
    """``run.compile = "auto"`` (the default) on a GPU: the stacked executor's steps recorded as CUDA graphs and
    replayed (``fedmtl.models.replay``) give the eager rounds' numbers, and they are recorded (no fallback)."""
    from fedmtl.algorithms import Ditto
    from fedmtl.models import replay

    if torch.device(DEVICE).type != "cuda":
        pytest.skip("CUDA graphs are a GPU matter (tests/test_replay.py runs the bookkeeping on the CPU)")
    if model == "lstm":
        data, kw = _text_data(), {"hidden": 16, "embed": 4}
    else:
        data, kw = _uneven_images(), ({"hidden": 16} if model == "cnn_femnist" else {})
    replayed: list = []
    original = replay._Graph.replay

    def counted(self, args):
        replayed.append(self)
        original(self, args)

    monkeypatch.setattr(replay._Graph, "replay", counted)
    out = {}
    for setting in (False, "auto"):
        torch.manual_seed(0)
        m = build_model(model, data.feature_shape, data.num_classes, data.meta, **kw)
        a = {"fedavg": FedAvg(), "fedem": FedEM(num_components=2), "ditto": Ditto(lam=0.1)}[alg]
        with caplog.at_level("WARNING", logger="fedmtl"):
            eng = simulator(a, data, m, runner="stacked", batch_size=4, device=DEVICE, compile=setting)
            st, hist = run_rounds(eng, 4)
        out[setting] = (st.server, all_client_states(eng), hist)
    assert "CUDA graph failed" not in caplog.text, caplog.text
    assert len(replayed) >= 5, "the steps were not replayed"
    _close(out[False][0], out["auto"][0], f"{alg} {model} server", atol=1e-6)
    _close(out[False][1], out["auto"][1], f"{alg} {model} client states", atol=1e-6)
    for h0, h1 in zip(out[False][2], out["auto"][2], strict=True):
        assert abs(h0["train_loss"] - h1["train_loss"]) <= 1e-6 * max(1.0, abs(h0["train_loss"]))
