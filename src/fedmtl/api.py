"""``fedmtl.run``: one experiment from Python, the same thing ``fedmtl run`` does on the command line."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

from .config import PYTHON_DATA, PYTHON_MODEL, ConfigError, apply_overrides, read_toml, validate
from .data.federated import DataError, FederatedData
from .models.base import Model
from .runs import execute
from .runs.driver import RunResult
from .runs.seeds import SeedsResult


def _overrides(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        table, sep, field = key.replace("__", ".").partition(".")
        if not sep or not field:
            raise ConfigError(f"override {key}={value!r}: name the table, as run__rounds=5 or **{{'run.rounds': 5}}")
        out.setdefault(table, {})[field] = value
    return out


def run(
    config_or_path: str | Path | dict[str, Any],
    data: FederatedData | None = None,
    model: Model | None = None,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    overwrite: bool = False,
    seeds: list[int] | tuple[int, ...] | None = None,
    **overrides: Any,
) -> RunResult | SeedsResult:
    """Run one experiment and return its ``RunResult`` (summary, history, per-client metrics, final state).

    ``config_or_path``: a TOML file, or a dict with the same tables, e.g.
    ``{"algorithm": {"name": "fedavg"}, "run": {"rounds": 2}}``.  ``data``: a ``FederatedData`` (then leave the
    ``[data]`` table out); ``model``: a ``Model`` (then leave ``[model]`` out).  ``out``: a run directory
    (``config.toml``, ``metrics.csv``, ``clients.csv``, ``summary.json``, checkpoints), or None to keep
    everything in memory; a directory that holds a run needs ``resume=True`` (continue it) or ``overwrite=True``
    (replace it).  ``overrides``: ``table__key=value`` (or ``**{"table.key": value}``), as
    ``--set table.key=value``; e.g. ``fedmtl.run("configs/synthetic/fedem.toml", run__rounds=5)``.
    ``seeds`` (or ``run.seeds`` in the config): run one independent replica per seed, batched together, and
    return a ``SeedsResult`` (``.runs``: one ``RunResult`` per seed; ``.final[metric]``: mean, std, 95% interval);
    with ``out``, each seed's run directory is ``out/seed-<S>``.  ``progress``: ``True`` prints progress (a bar
    on a terminal, lines elsewhere).
    """
    if data is not None and not isinstance(data, FederatedData):
        raise DataError(f"data must be a fedmtl.FederatedData (see FederatedData.from_arrays), "
                        f"got {type(data).__name__}")
    if model is not None and not isinstance(model, Model):
        raise ConfigError(f"model must be a fedmtl.Model (see Model.from_module), got {type(model).__name__}")
    if isinstance(config_or_path, dict):
        raw, source = copy.deepcopy(config_or_path), "<dict config>"
    else:
        raw, source = read_toml(config_or_path), str(config_or_path)
    raw = apply_overrides(raw, [])  # a copy with every table a fresh dict
    for table, values in _overrides(overrides).items():
        raw.setdefault(table, {})
        if not isinstance(raw[table], dict):
            raise ConfigError(f"{source}: '{table}' is not a table")
        raw[table].update(values)
    for table, given, marker in (("data", data, PYTHON_DATA), ("model", model, PYTHON_MODEL)):
        if given is not None and isinstance(raw.get(table), dict) and raw[table].get("name") == marker:
            raw.pop(table)  # a config.toml written by an earlier Python run
    if seeds is not None:
        raw.setdefault("run", {})["seeds"] = list(seeds)
    cfg = validate(raw, source, data_given=data is not None, model_given=model is not None)
    if data is not None:
        cfg.data["fingerprint"] = fingerprint(data)
        cfg.raw["data"] = dict(cfg.data)
    return execute(cfg, out, resume=resume, progress=progress, data=data, model=model, overwrite=overwrite)


def fingerprint(data: FederatedData) -> str:
    """A short digest of a federation's shape (clients, sizes, features, classes), recorded in the run's config
    so that resuming with other data is refused."""
    h = hashlib.sha256()
    h.update(repr((data.num_classes, data.feature_shape, str(data.seen.train.x.dtype))).encode())
    for group in (data.seen, data.unseen):
        if group is not None:
            for split in group.splits().values():
                h.update(split.counts.numpy().tobytes())
    return h.hexdigest()[:16]
