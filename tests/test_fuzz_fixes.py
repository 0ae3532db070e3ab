"""Focused regression tests for what the generated fuzz cases (``tests/test_fuzz_*.py``) found: each is one small
input that used to end in a traceback, a hang, a wrong exit code or accepted nonsense."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl.cli import main

from .fuzz_harness import TINY


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Every case runs in its own folder: a relative path a case gives (--out 0, --results nan) lands there."""
    monkeypatch.chdir(tmp_path)

def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and len(err) < 400, err[:500]
    return err


def test_a_file_name_too_long_for_the_system_is_invalid_input(tmp_path, capsys):
    """A CONFIG or --out of 5,000 characters: exit 2 (invalid input) in one cut line, not 3 ("cannot write") nor a
    traceback from the resume hint."""
    assert main(["run", "x" * 5000, "-q"]) == 2
    assert "too long" in _one_line(capsys)
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    assert main(["run", str(cfg), "--out", "o" * 5000, "-q"]) == 2
    assert "too long" in _one_line(capsys)


@pytest.mark.parametrize("key", ["model.weights", "model.adapters.base"])
def test_a_weights_path_the_system_cannot_look_up_names_the_key(tmp_path, key):
    from fedmtl.config import ConfigError, load

    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    with pytest.raises(ConfigError, match=key.rpartition(".")[2]) as e:
        load(cfg, [f"{key}={'w' * 300}"])
    assert str(cfg) in str(e.value) and len(str(e.value)) < 300


def test_tables_without_its_results_directory_is_invalid_input(tmp_path, capsys):
    assert main(["tables", "--check", "--results", str(tmp_path / "nope")]) == 2
    assert "--results" in _one_line(capsys)


@pytest.mark.parametrize("flag,value", [("--cpus", "-1"), ("--cpus", "1000000"), ("--cpus-per-node", "nan"),
                                        ("--cpus-per-node", "0"), ("--gpus-per-node", "inf"),
                                        ("--gpus-per-node", "-0.5")])
def test_flower_simulate_resources_out_of_range_are_refused(tmp_path, capsys, monkeypatch, flag, value):
    """Refused by the parser, before a config is read or a Ray cluster started."""
    import fedmtl.flower.simulation as sim

    monkeypatch.setattr(sim, "simulate", lambda *a, **k: pytest.fail("the simulation started"))
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    with pytest.raises(SystemExit) as e:
        main(["flower", "simulate", str(cfg), flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("key,value", [("fedmtl-num-nodes", "x"), ("fedmtl-num-nodes", "1e400"),
                                       ("fedmtl-num-nodes", -1), ("fedmtl-overwrite", "maybe"),
                                       ("fedmtl-overwrite", 5)])
def test_server_run_config_keys_are_named_when_wrong(key, value):
    pytest.importorskip("flwr")
    from fedmtl.flower.apps import server_options

    with pytest.raises(ValueError, match=key):
        server_options({key: value})


def test_a_run_config_whose_experiment_is_not_toml_names_fedmtl_config():
    pytest.importorskip("flwr")
    from fedmtl.config import ConfigError
    from fedmtl.flower.apps import config_from_text

    with pytest.raises(ConfigError, match="fedmtl-config"):
        config_from_text("not toml [[[")


def _with_a_writer_after(path: Path, seconds: float) -> threading.Timer:
    """Unblock a reader or writer stuck on the FIFO ``path`` (so a failing test ends instead of hanging)."""
    def release() -> None:
        for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):  # a blocked reader, a blocked writer
            try:
                os.close(os.open(path, flags))
            except OSError:
                pass

    t = threading.Timer(seconds, release)
    t.start()
    return t


def test_a_lock_file_that_is_a_fifo_is_never_read(tmp_path):
    from fedmtl.runs.rundir import read_lock

    os.mkfifo(tmp_path / ".lock")
    t = _with_a_writer_after(tmp_path / ".lock", 5)
    try:
        assert read_lock(tmp_path / ".lock") is None
    finally:
        t.cancel()
    (tmp_path / "big").write_text(f"{os.uname().nodename} {'9' * 20}")
    assert read_lock(tmp_path / "big") is None  # a pid beyond any process id: os.kill would overflow


def _store(d: Path, journal: bool = True):
    from fedmtl.engine.store import ClientStore

    return ClientStore(4, lambda ids: {"w": torch.zeros(len(ids), 2)}, "mmap", d, journal=journal)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_undo_journal_that_is_no_file_is_refused(tmp_path, kind):
    from fedmtl.engine.store import StoreError

    d = tmp_path / "store"
    _store(d).close()
    (d / "undo.log").unlink()
    if kind == "fifo":
        os.mkfifo(d / "undo.log")
    else:
        (d / "undo.log").mkdir()
    t = _with_a_writer_after(d / "undo.log", 5) if kind == "fifo" else None
    try:
        with pytest.raises(StoreError, match="undo.log"):
            _resume_store(d)
    finally:
        if t is not None:
            t.cancel()


def _resume_store(d: Path):
    from fedmtl.engine.store import ClientStore

    return ClientStore(4, lambda ids: {"w": torch.zeros(len(ids), 2)}, "mmap", d, journal=True, resume=True)


def test_a_store_layout_nested_too_deep_is_a_store_error(tmp_path):
    from fedmtl.engine.store import StoreError

    d = tmp_path / "store"
    _store(d, journal=False).close()
    (d / "layout.json").write_text('{"a": ' * 10_000 + "1" + "}" * 10_000)
    with pytest.raises(StoreError, match="layout.json"):
        _resume_store(d)


@pytest.fixture()
def finished(tmp_path) -> Path:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "-q"]) == 0
    return tmp_path / "run"


@pytest.mark.parametrize("what", ["summary fifo", "summary inf", "runs not names", "clients.csv columns",
                                  "metrics directory"])
def test_compare_refuses_unusable_run_files_by_name(finished, tmp_path, capsys, what):
    f = {"summary fifo": "summary.json", "summary inf": "summary.json", "runs not names": "summary.json",
         "clients.csv columns": "clients.csv", "metrics directory": "metrics.csv"}[what]
    p = finished / f
    t = None
    if what == "summary fifo":
        p.unlink()
        os.mkfifo(p)
        t = _with_a_writer_after(p, 5)
    elif what == "summary inf":
        p.write_text('{"final": {"seen_test_acc_mean": Infinity}}')
    elif what == "runs not names":
        p.write_text(json.dumps({"final": {}, "seeds": [1], "runs": [5]}))
    elif what == "clients.csv columns":
        p.write_text("a,b\n1,2\n")
    else:
        p.unlink()
        p.mkdir()
    t0 = time.monotonic()
    try:
        assert main(["compare", str(finished), "--out", str(tmp_path / "cmp")]) == 2
    finally:
        if t is not None:
            t.cancel()
    assert f in _one_line(capsys)
    assert time.monotonic() - t0 < 4, "blocked on the FIFO until a writer came"


@pytest.mark.parametrize("change", ["bool labels", "num_classes 10^12"])
def test_npz_bool_labels_and_absurd_class_counts_are_refused(tmp_path, change):
    from fedmtl.data.federated import DataError
    from fedmtl.data.npz import load_dir

    (tmp_path / "dataset.json").write_text(json.dumps({"format": "fedmtl-npz/1", "num_classes":
                                                       10**12 if change == "num_classes 10^12" else 2}))
    y = np.array([True, False]) if change == "bool labels" else np.array([0, 1])
    np.savez(tmp_path / "client_0.npz", x_train=np.ones((2, 3), np.float32), y_train=y,
             x_test=np.ones((1, 3), np.float32), y_test=np.array([1]))
    with pytest.raises(DataError, match="y_train|num_classes"):
        load_dir(tmp_path)


def test_a_data_dir_name_too_long_is_a_data_error():
    from fedmtl.data.federated import DataError
    from fedmtl.data.npz import load_dir

    with pytest.raises(DataError, match="data-dir"):
        load_dir("d" * 300)
