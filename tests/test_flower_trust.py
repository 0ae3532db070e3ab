"""Trust boundaries of the Flower deployment path: the ServerApp's run directory is locked for the whole run,
only public dataset metadata leaves a site (its export, its SuperNode's replies), and a local deployment ends
every process it started on every way out (a failed readiness here; a KeyboardInterrupt in the with block ends
tests/test_flower.py's deployment test).

The ServerApp tests drive ``server_main`` over ``LoopbackGrid``: a Grid that hands each message to the
ClientApp's handlers in this process (as a SuperNode would, with a ``Context`` per node), so the server's whole
path (discovery, rounds, evaluation, checkpoints, run directory) runs in seconds without a SuperLink."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedmtl import tree as T  # noqa: E402
from fedmtl.config import dumps, validate  # noqa: E402
from fedmtl.data.federated import DataError, FederatedData  # noqa: E402
from fedmtl.data.npz import export, load_dir  # noqa: E402
from fedmtl.flower import apps  # noqa: E402
from fedmtl.flower.apps import NodeCache, ServerOptions, federation_of, handle_query, server_main  # noqa: E402
from fedmtl.flower.records import from_record  # noqa: E402
from fedmtl.runs.driver import build_local  # noqa: E402
from fedmtl.runs.rundir import RunDirectory, RunDirError  # noqa: E402

from .test_flower import CONFIG as FLOWER_CONFIG  # noqa: E402

# the Flower tests' federation (5 clients), every client in every round
CONFIG = FLOWER_CONFIG.replace("clients_per_round = {k}\n", "")

PRIVATE = ("theta", "pi", "sizes", "latent", "seen_clients")  # what fedem_synthetic's generator knows of everyone


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity Flower gives a ServerApp process (a new message reads its run, node and task ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _text(alg: str = "fedavg", extra: str = "") -> str:
    return dumps(validate(tomllib.loads(CONFIG.format(alg=alg, extra=extra))).raw)


class LoopbackGrid:
    """A ServerApp ``Grid`` whose SuperNodes live in this process: ``nodes`` maps a node id to its node config
    (e.g. ``{"partition-ids": "0-2"}`` or ``{"data-dir": "/site"}``); a pushed message is answered at once by the
    ClientApp handler of its type (an exception becomes an error reply, as on a SuperNode)."""

    HANDLERS = {"query": apps.handle_query, "train": apps.handle_train, "evaluate": apps.handle_evaluate,
                "train.pull": apps.handle_pull, "train.mix": apps.handle_mix}

    def __init__(self, cfg_text: str, nodes: dict[int, dict[str, Any]]):
        self.cfg_text = cfg_text
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config=dict(nc), state=RecordDict(),
                                      run_config={}) for nid, nc in nodes.items()}
        self.caches = {nid: NodeCache() for nid in nodes}  # each SuperNode's ClientApp keeps its own warm nodes
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Any) -> list[str]:
        from flwr.app import Error

        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # what the SuperLink does
            self.pushed.append(msg)
            handler = self.HANDLERS[msg.metadata.message_type]
            try:
                nid = msg.metadata.dst_node_id
                rep = handler(msg, self.contexts[nid], self.cfg_text, self.caches[nid])
            except Exception as e:
                rep = Message(Error(1, f"{type(e).__name__}: {e}"), reply_to=msg)
            self.replies[msg.metadata.message_id] = rep
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def _grid(text: str) -> LoopbackGrid:
    return LoopbackGrid(text, {101: {"partition-ids": "0-2"}, 202: {"partition-ids": "3-4"}})


# ---------------------------------------------------------------------------------------------- run directory
def test_server_app_refuses_a_run_directory_another_run_holds_and_runs_once_it_is_released(tmp_path):
    """A second ServerApp writing the same directory is refused (one line naming the directory and the owner)
    before any node is contacted; released, the directory serves a run, which leaves no lock behind; a
    ServerApp finding its checkpoint resumes it (and only evaluates)."""
    text, out = _text(), tmp_path / "out"
    held = RunDirectory(out).__enter__()  # another run (this process) writes the directory
    grid = _grid(text)
    with pytest.raises(RunDirError) as err:
        server_main(grid, text, ServerOptions(out=str(out), num_nodes=2))
    msg = str(err.value)
    assert "\n" not in msg and str(out) in msg and f"process {os.getpid()} on {socket.gethostname()}" in msg, msg
    assert "fedmtl-out" in msg and "--out" not in msg, msg  # the ServerApp's own setting, not fedmtl run's
    assert grid.pushed == [] and sorted(p.name for p in out.iterdir()) == [".lock"]
    held.release()

    res = server_main(grid, text, ServerOptions(out=str(out), num_nodes=2))
    assert len(res.history) == 3 and (out / "summary.json").exists() and (out / "checkpoint.pt").exists()
    assert not (out / ".lock").exists()
    again = server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))  # resumes: nothing to train
    assert len(again.history) == 3 and not (out / ".lock").exists()
    for a, b in zip(T.leaves(again.server), T.leaves(res.server), strict=True):
        assert torch.equal(a, b)


def test_server_app_lock_is_held_for_the_whole_run_and_released_on_every_way_out(tmp_path, monkeypatch):
    """The lock (this process's host and pid) is in place while the rounds run, and gone after a round that
    raises or is interrupted; a lock left by a process that no longer runs is taken over."""
    from fedmtl.engine.round import Engine

    text, out = _text(), tmp_path / "out"
    seen: list[str] = []
    real = Engine.round

    def spying(self: Engine, state: Any) -> Any:
        seen.append((out / ".lock").read_text())
        if state.round == 1:
            raise KeyboardInterrupt("server killed")
        return real(self, state)

    monkeypatch.setattr(Engine, "round", spying)
    with pytest.raises(KeyboardInterrupt):
        server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))
    assert seen == [f"{socket.gethostname()} {os.getpid()}"] * 2 and not (out / ".lock").exists()

    monkeypatch.setattr(Engine, "round", real)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ".lock").write_text(f"{socket.gethostname()} {dead.pid}")  # a ServerApp that was killed
    (out / "metrics.csv").unlink(missing_ok=True)  # no checkpoint was written: start afresh
    res = server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))
    assert len(res.history) == 3 and not (out / ".lock").exists()


@pytest.mark.slow
def test_server_app_refuses_results_without_a_checkpoint_unless_told_to_overwrite(tmp_path):
    raw = CONFIG.format(alg="fedavg", extra="") + "checkpoint_every = 0\n"  # [run] is the last table
    text, out = dumps(validate(tomllib.loads(raw)).raw), tmp_path / "out"
    server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))
    assert (out / "summary.json").exists() and not (out / "checkpoint.pt").exists()
    with pytest.raises(RunDirError, match=re.escape(f"{out} already holds a run") + ".*fedmtl-overwrite"):
        server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))
    assert not (out / ".lock").exists()
    res = server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2, overwrite=True))
    assert len(res.history) == 3 and not (out / ".lock").exists()


@pytest.mark.slow
def test_server_app_does_not_continue_a_checkpoint_of_another_config(tmp_path):
    """A ServerApp started with another configuration on a directory that holds a checkpoint is refused (the keys
    that differ named, every file byte-identical) instead of continuing that run with the new settings; with
    fedmtl-overwrite it replaces it."""
    text, out = _text(), tmp_path / "out"
    server_main(_grid(text), text, ServerOptions(out=str(out), num_nodes=2))
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    other = _text().replace("lr = 0.1", "lr = 0.3")
    assert other != text
    with pytest.raises(ValueError, match=r"optim\.lr: 0\.1 -> 0\.3"):
        server_main(_grid(other), other, ServerOptions(out=str(out), num_nodes=2))
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    res = server_main(_grid(other), other, ServerOptions(out=str(out), num_nodes=2, overwrite=True))
    assert len(res.history) == 3 and not (out / ".lock").exists()


# ---------------------------------------------------------------------------------------------- metadata
def test_public_meta_keeps_what_a_model_needs_and_what_the_dataset_declares_public():
    from fedmtl.data.federated import public_meta

    meta = {"input": "image", "mean": np.array([0.5, 0.4]), "std": torch.tensor([0.2, 0.1]),
            "partition": "dirichlet", "group": [0, 1, 1], "secret": {"a": 1}, "public_keys": ["partition", "nope"]}
    assert public_meta(meta) == {"input": "image", "mean": [0.5, 0.4], "std": pytest.approx([0.2, 0.1]),
                                 "partition": "dirichlet", "public_keys": ["partition"]}
    assert public_meta({"theta": [[1.0]], "pi": [[1.0]]}) == {}
    json.dumps(public_meta(meta))  # JSON-able
    for bad in ("partition", [1], {"partition": True}):
        with pytest.raises(DataError, match=r"mnist: meta\['public_keys'\] must be a list of key names"):
            public_meta({"public_keys": bad}, "mnist")


def test_a_sites_export_holds_its_own_clients_and_no_private_metadata_and_still_trains(tmp_path):
    """``fedmtl data export`` of one site: its clients' files and a dataset.json without the generator's theta,
    the mixture weights, sizes or latent labels of any client; the directory loads and trains with the model
    the full federation gives."""
    cfg = validate(tomllib.loads(CONFIG.format(alg="fedavg", extra="")))
    data = cfg.build_data()
    assert all(k in data.meta for k in PRIVATE)  # the generator's knowledge, in process
    export(data, tmp_path / "site", [1, 3])
    assert sorted(p.name for p in (tmp_path / "site").iterdir()) == ["client_1.npz", "client_3.npz", "dataset.json"]
    text = (tmp_path / "site" / "dataset.json").read_text()
    info = json.loads(text)
    assert info == {"format": "fedmtl-npz/1", "name": data.name, "num_classes": 2, "meta": {}}, text
    for word in PRIVATE:
        assert word not in text
    for k in (1, 3):
        with np.load(tmp_path / "site" / f"client_{k}.npz", allow_pickle=False) as z:
            assert sorted(z.files) == ["x_test", "x_train", "y_test", "y_train"]
            assert np.array_equal(z["x_train"], data.seen.train.client(k)[0].numpy())
    ids, back = load_dir(tmp_path / "site")
    assert ids.tolist() == [1, 3] and back.meta == {}
    whole = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    site = cfg.build_model(back.feature_shape, back.num_classes, back.meta)
    for a, b in zip(T.leaves(whole.init(5)), T.leaves(site.init(5)), strict=True):
        assert torch.equal(a, b)
    eng = build_local(cfg, data=back, model=site)
    st = eng.init_state()
    eng.round(st)
    assert all(bool(torch.isfinite(x).all()) for x in T.leaves(st.server))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'site'} already holds client_1.npz")):
        export(data, tmp_path / "site", [0, 2])  # another site's share into this one's directory


def test_an_image_dataset_exports_its_normalization_and_declared_public_keys_only(tmp_path):
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 255, (4, 3, 2, 2)).astype(np.uint8), np.array([0, 1, 2, 1])) for _ in range(3)]
    meta = {"input": "image", "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.2, 0.2), "partition": "shards",
            "label_hist": [[4, 0], [0, 4], [2, 2]], "public_keys": ["partition"]}
    data = FederatedData.from_arrays(pairs, pairs, num_classes=3, name="imgs", meta=meta)
    export(data, tmp_path / "s", [2])
    _, back = load_dir(tmp_path / "s")
    assert back.meta == {"input": "image", "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2], "partition": "shards",
                         "public_keys": ["partition"]}
    from fedmtl.models import build_model

    x = torch.from_numpy(pairs[2][0])
    a = build_model("linear", data.feature_shape, 3, data.meta).input_transform(x)  # type: ignore[misc]
    b = build_model("linear", back.feature_shape, 3, back.meta).input_transform(x)  # type: ignore[misc]
    assert torch.equal(a, b)


def _query(text: str, node_config: dict[str, Any]) -> dict[str, Any]:
    msg = Message(RecordDict({}), dst_node_id=7, message_type="query")
    ctx = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    return from_record(handle_query(msg, ctx, text, NodeCache()).content["info"])  # type: ignore[arg-type]


def test_a_node_sends_the_server_only_public_metadata(tmp_path):
    """Whether a node rebuilds its share from the config (whose generator knows every client) or reads a data
    directory written before exports were filtered (its dataset.json holding everyone's theta and pi), its
    query reply carries public metadata only; and a server keeps only that of whatever a node sends."""
    text = _text()
    info = _query(text, {"partition-ids": "0-1"})
    assert json.loads(info["meta"]) == {}
    assert set(info) == {"client_ids", "train_counts", "config_sha", "source", "feature_shape", "feature_dtype",
                         "num_classes", "meta"}
    data = validate(tomllib.loads(text)).build_data()
    export(data, tmp_path / "old", [2, 3])
    old = json.loads((tmp_path / "old" / "dataset.json").read_text())
    old["meta"] = {"theta": data.meta["theta"].tolist(), "pi": data.meta["pi"].tolist(), "input": "tabular"}
    (tmp_path / "old" / "dataset.json").write_text(json.dumps(old))
    info = _query(text, {"data-dir": str(tmp_path / "old")})
    assert json.loads(info["meta"]) == {"input": "tabular"} and "theta" not in info["meta"]
    info["meta"] = json.dumps({"theta": [[0.1]], "input": "tabular"})  # a node that sends more
    fed, _, _ = federation_of({9: {**info, "client_ids": [0, 1], "train_counts": [3, 4]}}, text)
    assert fed.meta == {"input": "tabular"}


# ---------------------------------------------------------------------------------------------- processes
def _alive(pid: int) -> bool:
    """Process ``pid`` runs (exists and is not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _kill_leftovers(pids: list[int]) -> None:
    """Test hygiene after the assertions: end what a failing version left running (by pid, never by name)."""
    for pid in pids:
        if _alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.slow
def test_local_deployment_stops_its_processes_when_readiness_fails(tmp_path, monkeypatch):
    """Under load a ``flwr supernode ls`` may outlive its own timeout: that is "not ready yet", polled again
    until the overall deadline (here FEDMTL_DEPLOY_TIMEOUT = 0.5 s), then a one-line TimeoutError, and the
    SuperLink the deployment started no longer runs (``__enter__`` stops what it started)."""
    from fedmtl.flower.deploy import LocalDeployment

    monkeypatch.setenv("FEDMTL_DEPLOY_TIMEOUT", "0.5")
    dep = LocalDeployment(tmp_path / "dep", partitions=[[0]])
    dep.poll = 0.1
    calls: list[tuple[str, ...]] = []
    spawned: list[int] = []
    real_spawn = dep._spawn

    def spawn(name: str, args: list[str]) -> Any:
        proc = real_spawn(name, args)
        spawned.append(proc.pid)  # type: ignore[attr-defined]
        return proc

    def slow_cli(*args: str, timeout: float = 120) -> str:
        calls.append(args)
        raise TimeoutError(f"flwr {' '.join(args)} did not finish within {timeout:.0f} s")

    monkeypatch.setattr(dep, "_spawn", spawn)
    monkeypatch.setattr(dep, "_cli", slow_cli)
    monkeypatch.setattr(dep, "_port_open", lambda: True)  # the port answers, the flwr call does not
    try:
        with pytest.raises(TimeoutError, match=r"^the SuperLink not ready after 0.5 s \(logs in .*\); last error: "
                                               r"flwr supernode ls deployment did not finish within 1 s$"):
            with dep:
                pytest.fail("the deployment must not start")
        assert len(calls) >= 2 and len(spawned) == 1  # polled, with the SuperLink started
        assert not [pid for pid in spawned if _alive(pid)]
        assert dep.procs == []
    finally:
        _kill_leftovers(spawned)
