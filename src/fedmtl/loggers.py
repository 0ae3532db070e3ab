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
missing is refused when the config is read, naming the extra to install.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


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

    #: per-round logs: "tensorboard", "mlflow" or a registered logger (fedmtl.loggers.register_logger)
    loggers: tuple[str, ...] = ()
    #: the same as loggers = ["tensorboard"]
    tensorboard: bool = False
    #: mlflow: the tracking URI ("": $MLFLOW_TRACKING_URI, else a file store RUN_DIR/mlruns)
    mlflow_uri: str = ""
    #: mlflow: the experiment's name ("": the algorithm's name)
    mlflow_experiment: str = ""

    def __post_init__(self) -> None:
        import importlib.util

        for name in self.names:
            if name not in LOGGERS:
                import difflib

                near = difflib.get_close_matches(name, list(LOGGERS), n=1)
                raise ValueError(f"loggers: unknown logger {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + f"; known: {', '.join(sorted(LOGGERS))}")
            _, needs, extra = LOGGERS[name]
            if needs and importlib.util.find_spec(needs) is None:
                raise ValueError(f"loggers: {name!r} needs the {needs} package: pip install 'fedmtl[{extra}]'")

    @property
    def names(self) -> list[str]:
        """The loggers to open, each once (``tensorboard = true`` adds "tensorboard")."""
        return list(dict.fromkeys([*self.loggers, *(["tensorboard"] if self.tensorboard else [])]))


def open_loggers(run_dir: Path, cfg: Any, resume: bool) -> list[RunLogger]:
    """The loggers ``cfg.log`` names, opened for the run in ``run_dir``."""
    return [LOGGERS[name][0](run_dir, cfg, resume) for name in cfg.log.names]


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


class MlflowRun:
    """One fedmtl run as one MLflow run (through ``MlflowClient``: no process-wide active run, so the replicas of a
    run with several seeds log side by side)."""

    def __init__(self, run_dir: Path, cfg: Any, resume: bool):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # mlflow >= 3.13 refuses its file store unless asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.marker = uri, run_dir / "mlflow_run.json"
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
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["round"])
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "."), v, now, step)
                                                    for k, v in _scalars(row).items()])

    def close(self, summary: dict[str, Any] | None) -> None:
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

__all__ = ["LOGGERS", "Board", "LogConfig", "MlflowRun", "RunLogger", "open_loggers", "register_logger"]
