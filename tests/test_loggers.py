"""The [log] loggers' failures: a tracking URI MLflow has no store for is a config error, a logger that cannot start
(an unwritable folder, a database it cannot open, a server that does not answer) is dropped with one warning line
and the run goes on with the same numbers, a plain path is a local file store."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmtl.cli import main
from fedmtl.config import ConfigError, load
from fedmtl.runs.driver import run_experiment

SMALL = ["data.num_clients=12", "run.rounds=3", "run.eval_every=3", "run.checkpoint_every=3", "run.threads=1"]


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for k in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(k, raising=False)


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true"}


def _refused_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("fedmtl")]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [
    "log.mlflow_uri=/dev/null/x",  # a plain path under a file
    "log.mlflow_uri=sqlite:////proc/fedmtl-test.db",  # a database MLflow would retry for minutes
    "log.mlflow_uri=http://127.0.0.1:{port}",  # a server that refuses connections
    "log.tensorboard=true",  # RUN_DIR/tensorboard is a file
])
def test_a_logger_that_fails_to_start_is_dropped_with_one_warning(tmp_path, caplog, setting):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    setting = setting.replace("{port}", str(_refused_port()))
    loggers = ['log.loggers=["mlflow"]'] if "mlflow" in setting else []
    out = tmp_path / "r"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fedmtl"):
        res = run_experiment(load("synthetic/fedavg", [*SMALL, *loggers, setting]), out, progress=False)
    assert time.monotonic() - t0 < 60
    plain = run_experiment(load("synthetic/fedavg", SMALL), tmp_path / "p", progress=False)
    assert res.final == plain.final and (out / "summary.json").exists()
    warned = [w for w in _warnings(caplog) if "logger" in w]
    name = "tensorboard" if "tensorboard" in setting else "mlflow"
    assert len(warned) == 1 and f"logger {name!r} failed to start" in warned[0], warned
    assert "the run goes on without it" in warned[0] and "\n" not in warned[0] and len(warned[0]) < 400


def test_a_logger_that_fails_later_or_at_close_is_dropped(tmp_path, caplog):
    """A registered logger that raises at close (after its rounds) is dropped with a warning; the run finishes."""
    from fedmtl.runs.loggers import LOGGERS, register_logger

    class Flaky:
        def __init__(self, run_dir, cfg, resume):
            pass

        def round(self, row, per_client):
            pass

        def close(self, summary):
            raise OSError("disk full\n" + "x" * 5000)

    register_logger("flaky-test", Flaky)
    try:
        with caplog.at_level(logging.WARNING, logger="fedmtl"):
            run_experiment(load("synthetic/fedavg", [*SMALL, 'log.loggers=["flaky-test"]']), tmp_path / "r",
                           progress=False)
    finally:
        LOGGERS.pop("flaky-test")
    warned = [w for w in _warnings(caplog) if "logger" in w]
    assert len(warned) == 1 and "logger Flaky failed (OSError: disk full xxx" in warned[0]
    assert "..." in warned[0] and len(warned[0]) < 400 and (tmp_path / "r" / "summary.json").exists()


@pytest.mark.slow
def test_a_plain_path_is_a_local_file_store(tmp_path, monkeypatch):
    """log.mlflow_uri = "store" (no scheme): a file store in ./store, readable through its file: URI."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    run_experiment(load("synthetic/fedavg", [*SMALL, 'log.loggers=["mlflow"]', "log.mlflow_uri=store",
                                             "log.mlflow_experiment=plain"]), tmp_path / "r", progress=False)
    marker = json.loads((tmp_path / "r" / "mlflow_run.json").read_text())
    assert marker["uri"] == (tmp_path / "store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = MlflowClient(tracking_uri=marker["uri"]).get_run(marker["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["final.seen_test_acc_mean"] > 0
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ or os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"


@pytest.mark.parametrize("uri,ok", [
    ("foo://bar", False), ("s3://bucket/x", False), ("x" * 300 + "://y", False),
    ("http://h:5000", True), ("https://h", True), ("sqlite:///m.db", True), ("postgresql+psycopg2://u@h/db", True),
    ("databricks", True), ("databricks://profile", True), ("file:///tmp/m", True), ("runs/mlruns", True),
])
def test_the_tracking_uri_scheme_is_checked_when_the_config_is_read(uri, ok):
    sets = ['log.loggers=["mlflow"]', f"log.mlflow_uri={json.dumps(uri)}"]
    if ok:
        assert load("synthetic/fedavg", sets).log.mlflow_uri == uri
        return
    with pytest.raises(ConfigError, match=r"\[log\] mlflow_uri .*MLflow has no tracking store for the scheme") as e:
        load("synthetic/fedavg", sets)
    assert len(str(e.value)) < 400


@pytest.mark.slow
def test_cli_refuses_an_unknown_scheme_in_one_line_and_an_env_uri_is_a_warning(tmp_path, monkeypatch, capsys):
    """`fedmtl run` with log.mlflow_uri = "foo://bar": one line, exit 2, nothing trained (refused when the config is
    read: in this process); the same URI in $MLFLOW_TRACKING_URI (not the config's): one warning line, the run
    finishes (exit 0)."""
    pytest.importorskip("mlflow")
    cmd = [sys.executable, "-m", "fedmtl", "run", "synthetic/fedavg", "--no-progress", "--out", str(tmp_path / "r"),
           *[a for s in [*SMALL, 'log.loggers=["mlflow"]'] for a in ("--set", s)]]
    monkeypatch.chdir(tmp_path)
    assert main([*cmd[3:], "--set", "log.mlflow_uri=foo://bar"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "[log] mlflow_uri 'foo://bar'" in err and "synthetic/fedavg" in err
    assert not (tmp_path / "r" / "metrics.csv").exists()
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "MLFLOW_TRACKING_URI": "foo://bar"},
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    warned = [x for x in p.stderr.splitlines() if "logger" in x]
    assert len(warned) == 1 and "$MLFLOW_TRACKING_URI 'foo://bar'" in warned[0], p.stderr
    assert "Traceback" not in p.stderr and (tmp_path / "r" / "summary.json").exists()
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_an_unreachable_tracking_server_costs_seconds_and_one_line(tmp_path):
    """A tracking server that refuses connections: one warning line on stderr (no retry chatter), the run finishes
    (exit 0), well within MLflow's default of 7 retries with backoff (minutes)."""
    pytest.importorskip("mlflow")
    cmd = [sys.executable, "-m", "fedmtl", "run", "synthetic/fedavg", "--no-progress", "--out", str(tmp_path / "r"),
           *[a for s in [*SMALL, 'log.loggers=["mlflow"]', f"log.mlflow_uri=http://127.0.0.1:{_refused_port()}"]
             for a in ("--set", s)]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    warned = [x for x in p.stderr.splitlines() if "WARNING" in x]
    assert len(warned) == 1 and "logger 'mlflow' failed to start" in warned[0], p.stderr
    assert took < 90 and (tmp_path / "r" / "summary.json").exists()


def test_a_logger_whose_package_is_missing_is_refused_when_the_config_is_read():
    """The guide's promise: a logger whose package is not installed is a config error naming the extra to install."""
    from fedmtl.runs.loggers import LOGGERS, register_logger

    register_logger("absent-test", lambda run_dir, cfg, resume: None, needs="fedmtl_no_such_package",  # type: ignore
                    extra="absent")
    try:
        with pytest.raises(ConfigError, match=r"'absent-test' needs the fedmtl_no_such_package package: pip install "
                                              r"'fedmtl\[absent\]'"):
            load("synthetic/fedavg", ['log.loggers=["absent-test"]'])
    finally:
        LOGGERS.pop("absent-test")


def test_mlflow_request_bounds_are_set_only_around_its_calls_and_yield_to_the_environment(monkeypatch):
    """MLflow's request timeout and retries are bounded (10 s, one retry) while the logger's calls run, the user's own
    settings win, and nothing is left in the environment afterwards."""
    from fedmtl.runs.loggers import _bounded

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    with _bounded("http://h:5000"):
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
        assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
        assert logging.getLogger("urllib3").getEffectiveLevel() >= logging.ERROR
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
    with _bounded("file:///tmp/x"):
        assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
