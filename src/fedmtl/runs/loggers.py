"""Per-round logs beside the run directory's files (the ``[log]`` table): one interface, ``RunLogger``, and the
loggers it names in ``loggers``.

* ``"tensorboard"`` (extra ``fedmtl[tensorboard]``): event files in the run directory's ``tensorboard/`` folder
  through ``torch.utils.tensorboard.SummaryWriter`` -- every round's scalars of ``metrics.csv`` (``train/loss``,
  ``train/lr``, ``train/clients``, ..., ``privacy/epsilon``), at every evaluation the evaluation metrics
  (``eval/seen_test_acc_mean``, ...) and the histogram of per-client test accuracy (``clients/seen_test_acc``,
  ``clients/unseen_test_acc``).  View with ``tensorboard --logdir RUN_DIR``.  (``tensorboard = true`` is the same.)
* ``"mlflow"`` (extra ``fedmtl[mlflow]``, mlflow-skinny): one MLflow run per fedmtl run, in the experiment
  ``mlflow_experiment`` (default: the algorithm's name) of the tracking store ``mlflow_uri`` (default: the
  ``MLFLOW_TRACKING_URI`` environment variable, else a file store ``RUN_DIR/mlruns``, viewed with
  ``mlflow ui --backend-store-uri RUN_DIR/mlruns``): the resolved config as parameters (``algorithm.name``, ...),
  the same metrics as TensorBoard's with the round as the step, the final summary, and the tags
  ``fedmtl.run_dir`` and ``fedmtl.seed``.  A resumed run logs into the MLflow run it started
  (``RUN_DIR/mlflow_run.json``).
* Any other name: a logger registered with ``register_logger(name, factory)``, where ``factory(run_dir, cfg,
  resume)`` returns an object with ``round(row, per_client)`` and ``close(summary)``.

Loggers log runs that have a run directory (``--out``, ``fedmtl.run(..., out=...)``); a logger whose package is
missing, or an ``mlflow_uri`` whose scheme MLflow has no tracking store for, is refused when the config is read.  A
logger that fails when it starts (an unwritable folder, an unreachable tracking server) or later is dropped with one
warning line naming it, and the run goes on without it.  MLflow's requests are bounded for this logger (10 s, one
retry, unless ``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` are set): a server that does not
answer costs seconds, not minutes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..schema import brief, shown

log = logging.getLogger("fedmtl")


class RunLogger(Protocol):
    """What a logger does for one run: every round's row of ``metrics.csv`` (``per_client``: the evaluation's
    per-client metrics on evaluated rounds, else None), then the run's ``summary.json`` (None when the run stopped
    before its end: interrupted, or an error)."""

    def round(self, row: dict[str, Any], per_client: dict[str, Any] | None) -> None: ...

    def close(self, summary: dict[str, Any] | None) -> None: ...


#: name -> (factory(run_dir, cfg, resume), the package it needs or "", the pip extra that installs it)
LOGGERS: dict[str, tuple[Callable[[Path, Any, bool], RunLogger], str, str]] = {}


def register_logger(name: str, factory: Callable[[Path, Any, bool], RunLogger], needs: str = "",
                    extra: str = "") -> None:
    """Make ``[log] loggers = [name]`` open ``factory(run_dir, cfg, resume)`` for every run; ``needs``: a package
    it imports (checked when a config names it), ``extra``: what to pip install for it."""
    LOGGERS[name] = (factory, needs, extra)


@dataclass(frozen=True)
class LogConfig:
    """The ``[log]`` table."""

    #: per-round logs: "tensorboard", "mlflow" or a registered logger (fedmtl.runs.loggers.register_logger)
    loggers: tuple[str, ...] = ()
    #: the same as loggers = ["tensorboard"]
    tensorboard: bool = False
    #: mlflow: the tracking URI, or a plain path for a local file store ("": $MLFLOW_TRACKING_URI, else a file store
    #: RUN_DIR/mlruns); a scheme MLflow has no store for is refused
    mlflow_uri: str = ""
    #: mlflow: the experiment's name ("": the algorithm's name)
    mlflow_experiment: str = ""

    def __post_init__(self) -> None:
        import importlib.util

        for name in self.names:
            if name not in LOGGERS:
                import difflib

                near = difflib.get_close_matches(name, list(LOGGERS), n=1)
                raise ValueError(f"loggers: unknown logger {shown(name)}"
                                 + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + f"; known: {', '.join(sorted(LOGGERS))}")
            _, needs, extra = LOGGERS[name]
            if needs and importlib.util.find_spec(needs) is None:
                raise ValueError(f"loggers: {name!r} needs the {needs} package: pip install 'fedmtl[{extra}]'")
        if self.mlflow_uri:
            tracking_uri(self.mlflow_uri, "[log] mlflow_uri")

    @property
    def names(self) -> list[str]:
        """The loggers to open, each once (``tensorboard = true`` adds "tensorboard")."""
        return list(dict.fromkeys([*self.loggers, *(["tensorboard"] if self.tensorboard else [])]))


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {brief(str(e), 160)}"


def open_loggers(run_dir: Path, cfg: Any, resume: bool, label: str = "") -> list[RunLogger]:
    """The loggers ``cfg.log`` names, opened for the run in ``run_dir``; one that fails to open is left out with a
    warning line naming it (``label``: the run's name in that line)."""
    out = []
    for name in cfg.log.names:
        try:
            out.append(LOGGERS[name][0](run_dir, cfg, resume))
        except Exception as e:  # noqa: BLE001 (a logger's failure must not cost the run)
            log.warning("%slogger %r failed to start (%s); the run goes on without it", f"{label}: " if label else "",
                        name, _failure(e))
    return out


def log_all(loggers: list[RunLogger], what: str, label: str, *args: Any) -> None:
    """Call ``what`` ("round" or "close") on each of ``loggers``; one that fails is removed from the list with a
    warning line naming it."""
    for lg in list(loggers):
        try:
            getattr(lg, what)(*args)
        except Exception as e:  # noqa: BLE001 (a logger's failure must not cost the run)
            log.warning("%s: logger %s failed (%s); the run goes on without it", label, type(lg).__name__, _failure(e))
            loggers.remove(lg)


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's finite numbers under their log names (``train/loss``, ``eval/seen_test_acc_mean``, ...)."""
    out = {}
    for key, value in row.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[_TRAIN_KEYS.get(key, f"eval/{key}")] = float(value)
    return out


_TRAIN_KEYS = {"train_loss": "train/loss", "lr": "train/lr", "clients": "train/clients", "dropped": "train/dropped",
               "excluded": "train/excluded", "est_time_s": "train/est_time_s", "epsilon": "privacy/epsilon"}


class Board:
    """One run's TensorBoard writer."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def round(self, row: dict[str, Any], per_client: dict[str, Any] | None) -> None:
        step = int(row["round"])
        for tag, value in _scalars(row).items():
            self.writer.add_scalar(tag, value, step)
        if per_client is not None:
            for group, splits in per_client.items():
                test = splits.get("test")
                if test is not None and len(test["acc"]):
                    self.writer.add_histogram(f"clients/{group}_test_acc", np.asarray(test["acc"], dtype=np.float64),
                                              step)
        self.writer.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.writer.close()


def _flat(raw: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


#: the tracking-store schemes of MLflow 3 (databases also as ``dialect+driver``); plugins add theirs through the
#: ``mlflow.tracking_store`` entry points
_MLFLOW_SCHEMES = frozenset({"file", "http", "https", "databricks", "databricks-uc", "uc"})
_MLFLOW_DATABASES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})
#: MLflow's request bounds for this logger, unless the environment sets them (MLflow's defaults: 120 s, 7 retries)
_MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def tracking_uri(raw: str, where: str) -> str:
    """The MLflow tracking URI ``raw`` names: a plain path becomes a ``file:`` URI (resolved against the current
    folder), a URI must have a scheme MLflow has a tracking store for; ValueError naming ``where`` otherwise."""
    from urllib.parse import urlsplit

    if raw in ("databricks", "databricks-uc", "uc"):  # profile-less Databricks URIs
        return raw
    scheme = urlsplit(raw).scheme if "://" in raw or raw.startswith("file:") else ""
    if not scheme:
        return Path(raw).expanduser().resolve().as_uri()
    if scheme in _MLFLOW_SCHEMES or scheme.split("+")[0] in _MLFLOW_DATABASES:
        return raw
    from importlib.metadata import entry_points

    if scheme in {ep.name for ep in entry_points(group="mlflow.tracking_store")}:
        return raw
    raise ValueError(f"{where} {brief(raw)!r}: MLflow has no tracking store for the scheme {brief(scheme, 20)!r} "
                     f"(a path, file:, http(s):, sqlite:, postgresql:, mysql:, mssql: or databricks)")


def _check_sqlite(uri: str) -> None:
    """Open an ``sqlite:`` store's database once, here: MLflow retries a database it cannot open for minutes."""
    from urllib.parse import urlsplit

    if urlsplit(uri).scheme.split("+")[0] != "sqlite":
        return
    path = uri.split(":", 1)[1].split("?")[0].removeprefix("///")  # sqlite:///rel.db, sqlite:////abs.db
    if path in ("", ":memory:"):
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(path, timeout=5).close()
    except (OSError, sqlite3.Error) as e:
        raise OSError(f"{uri}: cannot open the database ({_failure(e)})") from None


@contextmanager
def _bounded(uri: str) -> Iterator[None]:
    """MLflow's request bounds (``_MLFLOW_BOUNDS``) and, for a ``file:`` store, its permission
    (``MLFLOW_ALLOW_FILE_STORE``, which MLflow >= 3.13 asks for) set while this logger's calls run, where the
    environment leaves them unset; MLflow's and urllib3's retry warnings held back (a failure is one warning line,
    the caller's)."""
    extra = dict(_MLFLOW_BOUNDS)
    if uri.startswith("file:"):
        extra["MLFLOW_ALLOW_FILE_STORE"] = "true"
    added = [k for k in extra if k not in os.environ]
    for k in added:
        os.environ[k] = extra[k]
    quiet = [logging.getLogger(name) for name in ("mlflow", "urllib3")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)


class MlflowRun:
    """One fedmtl run as one MLflow run (through ``MlflowClient``: no process-wide active run, so the replicas of a
    run with several seeds log side by side)."""

    def __init__(self, run_dir: Path, cfg: Any, resume: bool):
        if cfg.log.mlflow_uri:
            uri = tracking_uri(cfg.log.mlflow_uri, "[log] mlflow_uri")
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            uri = tracking_uri(os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI")
        else:
            uri = (run_dir / "mlruns").resolve().as_uri()
        _check_sqlite(uri)
        self.uri, self.marker = uri, run_dir / "mlflow_run.json"
        with _bounded(uri):
            self._start(run_dir, cfg, resume)

    def _start(self, run_dir: Path, cfg: Any, resume: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.uri
        self.client = MlflowClient(tracking_uri=uri)
        saved = _read_marker(self.marker) if resume else None
        if saved is not None and saved.get("uri") == uri:
            self.run_id = str(saved["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = cfg.log.mlflow_experiment or str(cfg.algorithm["name"])
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=run_dir.name, tags={
            "fedmtl.run_dir": str(run_dir.resolve()), "fedmtl.seed": str(cfg.run.seed)})
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in _flat(cfg.raw).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        from .report import write_json

        write_json(self.marker, {"uri": uri, "run_id": self.run_id})

    def round(self, row: dict[str, Any], per_client: dict[str, Any] | None) -> None:
        with _bounded(self.uri):
            self._round(row)

    def _round(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["round"])
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "."), v, now, step)
                                                    for k, v in _scalars(row).items()])

    def close(self, summary: dict[str, Any] | None) -> None:
        with _bounded(self.uri):
            self._close(summary)

    def _close(self, summary: dict[str, Any] | None) -> None:
        from mlflow.entities import Metric

        if summary is not None:
            now = int(time.time() * 1000)
            final = [Metric(f"final.{k}", float(v), now, int(summary.get("rounds", 0)))
                     for k, v in summary.get("final", {}).items() if isinstance(v, int | float) and math.isfinite(v)]
            if final:
                self.client.log_batch(self.run_id, metrics=final)
        self.client.set_terminated(self.run_id, status="FINISHED" if summary is not None else "KILLED")


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("run_id"), str) else None


register_logger("tensorboard", lambda run_dir, cfg, resume: Board(run_dir / "tensorboard"), "tensorboard",
                "tensorboard")
register_logger("mlflow", MlflowRun, "mlflow", "mlflow")

__all__ = ["LOGGERS", "Board", "LogConfig", "MlflowRun", "RunLogger", "log_all", "open_loggers", "register_logger",
           "tracking_uri"]
