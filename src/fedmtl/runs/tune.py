"""Hyperparameter search on Optuna: ``fedmtl tune CONFIG --space SPACE.toml --trials N --seed S --out DIR``.

The search space is a TOML file over any config key: under each table, a key's range or choices::

    [optim]
    lr = { low = 0.01, high = 1.0, log = true }     # log-uniform
    [algorithm]
    lam = { low = 0.0, high = 1.0 }                 # uniform
    [run]
    local_epochs = { low = 1, high = 8, int = true } # integers (optionally step = k)
    [model]
    hidden = { choices = [32, 64, 128] }            # categorical

Every candidate is validated before a trial runs: the bounds (and every choice) are applied to the config exactly as
``--set`` applies a value and the config is built, so an unknown key, a wrong type or a value outside the key's
declared range is refused naming the space file and the key; so are an empty range (low >= high) and a log range
through zero.

Each trial is a run of the config with the trial's values (its seeds, ``run.seeds``, batched as ``fedmtl run
--seeds`` batches them: the objective is the mean over the seeds) in ``DIR/trials/NNNN/``.  The objective (default
``seen_val_acc_mean``, the seen clients' mean validation accuracy, averaged over the last ``last`` evaluated rounds;
a loss is minimized, an accuracy maximized) is measured on a validation split carved from every client's training
examples (``[run] val_fraction``, 0.2 unless the config or its data gives one); during tuning the test split and the
unseen clients are left out of the data altogether, so no trial ever reads them.  Sampling: TPE (Bergstra et al.,
NeurIPS 2011) seeded per trial from ``--seed`` and the trial's index, so a study's trials depend only on the seed
and the trials before them; pruning: the median rule (Golovin et al., KDD 2017, "median stopping rule"), fed the
objective at every evaluated round.

The study lives in ``DIR/study.db`` (SQLite, Optuna's RDB storage): ``--resume`` continues it after any interruption
(a trial whose process is gone is marked FAIL, ``interrupted``, and its values run again as a new trial, so it is
never counted twice), and several processes can work on one study at once.  At the end: ``best.toml`` (the config
with the best trial's values, runnable by ``fedmtl run``), ``trials.csv`` / ``trials.md``, ``tune.json`` and the
figures ``history.png`` / ``importance.png`` (and PDFs).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import ConfigError, ExperimentConfig, apply_overrides, dumps, read_toml, validate
from ..data.federated import ClientGroup, FederatedData, Split
from ..engine.evaluation import Statistic, metric
from ..engine.round import TrainingDiverged
from ..files import atomic, locked
from ..machine import torch_device
from ..schema import shown
from .report import run_figures, save_figure, write_json
from .rundir import alive

if TYPE_CHECKING:
    import optuna

    from .driver import Replica

#: the study's database in the output folder
STUDY_DB = "study.db"
#: the lock file beside it (held while a process creates or checks the database)
LOCK = ".study.lock"
#: the objective unless ``--objective`` names another validation metric
DEFAULT_OBJECTIVE = metric("seen", "val", "acc_mean")
#: the objective averages the metric over this many last evaluated rounds unless told otherwise
DEFAULT_LAST = 3
#: the validation fraction tuning carves when neither the config (``run.val_fraction``) nor its data has one
DEFAULT_VAL_FRACTION = 0.2
#: the keys of one entry of a space file
SPEC_KEYS = ("low", "high", "log", "int", "step", "choices")
#: a key of a space file's table: a config key's name
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the optimizer key trials trained together (``--batch-trials``) may differ in (a rate per replica; with the
#: algorithm's real-valued fields: ``batchable_keys``)
BATCHABLE = "optim.lr"


def batchable_keys(cfg: ExperimentConfig) -> list[str]:
    """The keys that trials trained together (``--batch-trials``) may differ in: ``optim.lr`` and the configured
    algorithm's real-valued fields (``engine.clients.train_together`` carries them per replica)."""
    from ..engine.clients import real_fields
    from ..registry import ALGORITHMS

    return [BATCHABLE, *(f"algorithm.{f}" for f in real_fields(ALGORITHMS[cfg.algorithm["name"]]))]
#: at most this many trials in one study
MAX_TRIALS = 100_000
_STATISTICS: tuple[Statistic, ...] = typing.get_args(Statistic)


class TuneError(ValueError):
    """A study that cannot run as asked (its output folder, its database); the message names the file."""

    #: the command line does not put the config's name in front (the file at fault is the study's)
    names_its_file = True


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("fedmtl tune needs Optuna: pip install 'fedmtl[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# ---------------------------------------------------------------------------------------------
# The search space


#: how close to an end of its range (a fraction of the range's width, in its own scale) a best value is reported
EDGE_FRACTION = 0.05


@dataclass(frozen=True)
class Param:
    """One searched key (``table.key``, or ``table.sub.key`` for a sub-table) and its range or choices."""

    key: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    #: integers (the space file's ``int = true``)
    is_int: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None

    def candidates(self) -> list[Any]:
        """The values that bound the search, of the type a trial draws: the range's ends (floats for a float range,
        so that a float range over an integer key is refused before any trial), or every choice."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        return [int(self.low), int(self.high)] if self.is_int else [float(self.low), float(self.high)]

    def edge(self, value: Any) -> str | None:
        """``"low"`` / ``"high"`` where ``value`` lies at an end of the range (within ``EDGE_FRACTION`` of its width,
        in the range's own scale: log or linear; an integer at a bound) or is the lowest / highest of numeric
        choices; else None.  A best value there says the optimum may lie outside the range searched."""
        if not _number(value):
            return None
        if self.choices is not None:
            nums = [c for c in self.choices if _number(c)]
            if len(nums) < 2 or len(nums) != len(self.choices):
                return None  # unordered (strings, booleans) or a single value: no edge
            return "low" if value <= min(nums) else "high" if value >= max(nums) else None
        assert self.low is not None and self.high is not None
        lo, hi, v = float(self.low), float(self.high), float(value)
        if hi <= lo:
            return None
        if self.is_int and (self.high - self.low) < 1 / EDGE_FRACTION:  # a short integer range: only its bounds
            return "low" if v <= lo else "high" if v >= hi else None
        f = (math.log(v / lo) / math.log(hi / lo)) if self.log else (v - lo) / (hi - lo)
        return "low" if f <= EDGE_FRACTION else "high" if f >= 1 - EDGE_FRACTION else None

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        assert self.low is not None and self.high is not None
        if self.is_int:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)


def edge_notes(params: list[Param], best: dict[str, Any]) -> dict[str, str]:
    """``{key: "low" | "high"}`` for the best trial's values that lie at an end of their searched range."""
    return {p.key: e for p in params if p.key in best and (e := p.edge(best[p.key])) is not None}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _param(key: str, spec: dict[str, Any], where: str) -> Param:
    """One entry of a space file, its shape checked (the config checks its values)."""
    bad = [k for k in spec if k not in SPEC_KEYS]
    if bad:
        raise ConfigError(f"{where}: unknown setting {shown(bad[0])} (a range {{low, high, log, int, step}} or "
                          "{choices = [...]})")
    if "choices" in spec:
        if set(spec) - {"choices"}:
            raise ConfigError(f"{where}: choices take no {sorted(set(spec) - {'choices'})}")
        ch = spec["choices"]
        if not isinstance(ch, list) or not ch:
            raise ConfigError(f"{where}: choices must be a non-empty list, got {shown(ch)}")
        if not all(v is None or isinstance(v, bool | int | float | str) for v in ch):
            raise ConfigError(f"{where}: choices must be numbers, strings or booleans, got {shown(ch)}")
        if len({json.dumps(v) for v in ch}) != len(ch):
            raise ConfigError(f"{where}: the choices {shown(ch)} repeat a value")
        return Param(key, choices=tuple(ch))
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: a range needs both low and high (or give choices = [...])")
    low, high, step = spec["low"], spec["high"], spec.get("step")
    for name, v in (("low", low), ("high", high), ("step", step)):
        if v is not None and not _number(v):
            raise ConfigError(f"{where}: {name} must be a number, got {shown(v)}")
    for name in ("log", "int"):
        if not isinstance(spec.get(name, False), bool):
            raise ConfigError(f"{where}: {name} must be true or false, got {shown(spec[name])}")
    is_int, log = bool(spec.get("int", False)), bool(spec.get("log", False))
    if is_int and not all(isinstance(v, int) for v in (low, high, step) if v is not None):
        raise ConfigError(f"{where}: an int range needs integer low, high and step, got {shown(spec)}")
    if low >= high:
        raise ConfigError(f"{where}: empty range: low = {low} >= high = {high}")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log range must lie above zero, got low = {low}")
    if step is not None:
        if step <= 0:
            raise ConfigError(f"{where}: step must be > 0, got {step}")
        if log:
            raise ConfigError(f"{where}: a log range takes no step")
        # Optuna would lower high to the last step below it: a range whose high is never drawn (and one step wider
        # than the range, a single value) is refused here, naming the reachable end
        n = (high - low) / step
        if n < 1 or abs(n - round(n)) > 1e-9 * max(1.0, n):
            last = low + math.floor(n + 1e-9) * step
            raise ConfigError(f"{where}: step = {step} does not divide high - low = {high - low}: the highest value "
                              f"drawn would be {last:g}, not {high} (set high = {last:g}, or another step)"
                              if n >= 1 else f"{where}: step = {step} is wider than the range [{low}, {high}]: every "
                              "trial would draw low")
    return Param(key, low, high, log, is_int, step)


def read_space(path: str | Path) -> list[Param]:
    """The searched keys of a space file (a path, or a bundled space's name: ``fedavg_lr``); their shapes checked."""
    p = resolve_space(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such space file (nor a bundled space: {', '.join(bundled_spaces())})")
    return space_params(read_toml(p), str(p))


def space_params(raw: dict[str, Any], where: str) -> list[Param]:
    """The searched keys of a space given as tables (a space file's contents; ``where`` names it in errors)."""
    params: list[Param] = []
    p = where

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, spec in table.items():
            name = f"{prefix}.{key}" if prefix else key
            if not _KEY.fullmatch(key):  # it becomes the --set override "name=value": no "=", spaces or dots in it
                raise ConfigError(f"{p}: {shown(name)}: not a config key (letters, digits and _)")
            if isinstance(spec, dict) and not spec:
                raise ConfigError(f"{p}: {name} = {{}}: empty: expected a range {{low = .., high = ..}} or "
                                  "{choices = [...]}" if prefix else f"{p}: [{name}] is empty")
            if not isinstance(spec, dict):
                raise ConfigError(f"{p}: {name} = {shown(spec)}: expected a range {{low = .., high = ..}} or "
                                  "{choices = [...]}" if prefix else f"{p}: {name}: expected a table [{name}]")
            if prefix and any(k in spec for k in SPEC_KEYS):
                params.append(_param(name, spec, f"{p}: {name}"))
            elif prefix.count(".") < 1:  # a table, or a sub-table ([model.adapters])
                walk(spec, name)
            else:
                raise ConfigError(f"{p}: {name}: expected a range {{low = .., high = ..}} or {{choices = [...]}}")

    walk(raw, "")
    if not params:
        raise ConfigError(f"{p}: no key to search (e.g. [optim] lr = {{ low = 0.01, high = 1.0, log = true }})")
    if any(q.key.split(".")[0] == "run" and q.key.split(".", 1)[1] in ("seeds", "seed") for q in params):
        raise ConfigError(f"{p}: run.seed / run.seeds are not hyperparameters (every trial runs the config's seeds)")
    return params


def spaces_root() -> Path:
    from importlib import resources

    return Path(str(resources.files("fedmtl") / "spaces"))


def bundled_spaces() -> list[str]:
    """The bundled space files' names (``fedmtl tune CONFIG --space NAME``)."""
    return sorted(p.stem for p in spaces_root().glob("*.toml"))


def resolve_space(path: str | Path) -> Path:
    """``path`` if it names a file; else the bundled space of that name (``fedavg_lr``, ``spaces/fedavg_lr.toml``)."""
    p = Path(path)
    if p.exists():
        return p
    name = str(path).replace("\\", "/").removeprefix("spaces/").removesuffix(".toml")
    bundled = spaces_root() / f"{name}.toml"
    return bundled if bundled.is_file() else p


def toml_value(v: Any) -> str:
    """``v`` as the TOML text of a ``--set`` value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def overrides(values: dict[str, Any]) -> list[str]:
    """A trial's values as ``--set`` overrides."""
    return [f"{k}={toml_value(v)}" for k, v in values.items()]


# ---------------------------------------------------------------------------------------------
# The study


@dataclass
class TuneSummary:
    """What ``fedmtl.tune`` returns (and ``DIR/tune.json`` holds)."""

    objective: str
    direction: str
    best_value: float | None
    best_params: dict[str, Any]
    best_trial: int | None
    complete: int
    pruned: int
    failed: int
    #: trials cut short by the end of their process (re-run as new trials, never counted)
    interrupted: int
    seconds: float
    seed: int
    out: Path
    trials: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the best trial's keys that lie at an end of their searched range: ``{key: "low" | "high"}`` (``Param.edge``)
    at_edge: dict[str, str] = field(default_factory=dict)


@dataclass
class _Study:
    """Everything a trial needs, resolved once."""

    raw: dict[str, Any]
    source: str
    sets: list[str]
    tuning_sets: list[str]
    params: list[Param]
    objective: str
    direction: str
    last: int
    seed: int
    out: Path
    prune: bool = True
    data: dict[str, FederatedData] = field(default_factory=dict)

    def build(self, values: dict[str, Any], tuning: bool = True) -> ExperimentConfig:
        sets = self.sets + (self.tuning_sets if tuning else []) + overrides(values)
        return validate(apply_overrides(self.raw, sets), self.source)


def _load_raw(config: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(config, dict):
        return copy.deepcopy(config), "<dict config>"
    return read_toml(config), str(config)


def check_objective(objective: str, direction: str | None) -> str:
    """The objective must be a validation metric of the seen clients; its direction (implied: a loss is
    minimized, anything else maximized)."""
    allowed = [metric("seen", "val", s) for s in _STATISTICS]
    if objective not in allowed:
        raise ConfigError(f"--objective {shown(objective)}: tuning measures a validation metric, one of {allowed} "
                          "(never the test split)")
    implied = "minimize" if objective.endswith("loss") else "maximize"
    if direction is None:
        return implied
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"--direction {shown(direction)}: minimize or maximize")
    return direction


def fingerprint(base: ExperimentConfig, params: list[Param], objective: str, direction: str, last: int,
                seed: int) -> str:
    """What makes two studies the same study: the resolved config, the space, the objective and the sampler seed."""
    what = {"config": base.raw, "space": [asdict(p) for p in params], "objective": objective,
            "direction": direction, "last": last, "seed": seed}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def tune(config: str | Path | dict[str, Any], space: str | Path, trials: int = 20, seed: int = 0,
         out: str | Path = "runs/tune", *, sets: list[str] | None = None, resume: bool = False,
         objective: str = DEFAULT_OBJECTIVE, direction: str | None = None, last: int = DEFAULT_LAST,
         batch_trials: int = 1, prune: bool = True, progress: bool | str = False) -> TuneSummary:
    """Search ``space`` for the values of ``config`` (a TOML file, a bundled config's name or a dict; ``sets``:
    ``--set`` overrides) that optimize ``objective`` over ``trials`` trials (TPE seeded by ``seed``, median pruning)
    into ``out`` (``study.db``, ``trials/NNNN/``, ``best.toml``, ``trials.csv``, ``trials.md``, ``tune.json``,
    figures).  ``resume``: continue the study ``out/study.db`` holds (required when it exists).  Returns the
    summary ``tune.json`` holds.  ``batch_trials``: trials trained together as one batched computation (a space
    over ``optim.lr`` and the algorithm's real-valued fields only: ``batchable_keys``); ``prune``: False runs every
    trial to the end."""
    t0 = time.perf_counter()
    raw, source = _load_raw(config)
    sets = list(sets or [])
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
        raise ConfigError(f"--trials {shown(trials)}: a whole number of trials in [1, {MAX_TRIALS}]")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"--seed {shown(seed)}: an integer in [0, 2^32 - 1]")
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= 10**7:
        raise ConfigError(f"--last {shown(last)}: a number of evaluated rounds in [1, 10^7]")
    if isinstance(batch_trials, bool) or not isinstance(batch_trials, int) or not 1 <= batch_trials <= 1000:
        raise ConfigError(f"--batch-trials {shown(batch_trials)}: a whole number in [1, 1000]")
    direction = check_objective(objective, direction)
    params = read_space(space)
    sp = resolve_space(space)
    given = {o.split("=", 1)[0].strip(): o for o in sets}
    for p in params:  # a trial's value would silently replace the --set one
        if p.key in given:
            raise ConfigError(f"--set {given[p.key]}: {p.key} is searched by the space {sp}; leave one of them out")
    base = validate(apply_overrides(raw, sets), source)  # the config itself first: its errors name it
    try:  # a device this machine lacks: refused here, not as every trial's failure
        torch_device(base.run.device)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if batch_trials > 1:
        allowed = batchable_keys(base)
        if any(p.key not in allowed for p in params):
            raise ConfigError(f"--batch-trials {batch_trials}: trials trained together can differ in "
                              f"{', '.join(allowed)} only (values carried per replica); the space searches "
                              f"{[p.key for p in params]}: leave --batch-trials out")
    tuning_sets: list[str] = []
    if base.run.val_fraction == 0 and not base.data.get("val_frac"):
        tuning_sets.append(f"run.val_fraction={DEFAULT_VAL_FRACTION}")
    study_cfg = _Study(raw, source, sets, tuning_sets, params, objective, direction, last, seed, Path(out), prune)
    for p in params:  # every candidate, applied exactly as --set applies it, before anything runs
        for v in p.candidates():
            try:
                torch_device(study_cfg.build({p.key: v}).run.device)  # a device searched over, too
            except ValueError as e:
                raise ConfigError(f"{sp}: {p.key} = {shown(v)}: {e}") from None
    optuna = _optuna()
    out = Path(out)
    db = out / STUDY_DB
    fp = fingerprint(base, params, objective, direction, last, seed)
    name = f"fedmtl-tune-{fp[:16]}"
    if db.exists() and not resume:
        raise TuneError(f"{db}: a study is there already; continue it with --resume, or give another --out")
    if not db.exists() and out.exists() and (not out.is_dir() or any(p.name != LOCK for p in out.iterdir())):
        raise TuneError(f"{out}: holds files but no {STUDY_DB}; give an empty or new --out")
    out.mkdir(parents=True, exist_ok=True)
    with _storage_errors(db, optuna):
        return _search(study_cfg, optuna, db, name, fp, trials, batch_trials, progress, t0,
                       {"objective": objective, "seed": seed, "source": source, "space": str(sp), "last": last})


@contextlib.contextmanager
def _storage_errors(db: Path, optuna: Any) -> typing.Iterator[None]:
    """A failure of the study's database (a full disk, a damaged or locked file) as one ``OSError`` naming it, not
    Optuna's and SQLAlchemy's traceback.  Nothing is lost: every finished trial is in the database, and a trial cut
    short is run again by ``--resume``."""
    import sqlalchemy.exc

    try:
        yield
    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError) as e:
        cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) and e.__cause__ else e
        text = str(getattr(cause, "orig", None) or cause).splitlines()[0] if str(cause) else type(cause).__name__
        full = "full" in text.lower() and "disk" in text.lower()
        raise OSError(errno.ENOSPC if full else errno.EIO, f"the study database failed ({text})", str(db)) from e


def _search(st: _Study, optuna: Any, db: Path, name: str, fp: str, trials: int, batch_trials: int,
            progress: bool | str, t0: float, attrs: dict[str, Any]) -> TuneSummary:
    """The study's trials, asked, run and told until it holds ``trials``; then its outputs."""
    out = st.out
    with locked(out / LOCK):  # one process at a time creates or checks the database
        study = _open_study(optuna, db, name, fp, st.direction, st.prune, attrs)
    seed = st.seed
    while True:
        with locked(out / LOCK):  # one process at a time recovers, counts and asks: each index asked once
            _recover_stale(study, optuna)
            index = _index(study)
            if index >= trials:
                break
            asked = []
            for i in range(index, index + min(batch_trials, trials - index)):
                study.sampler = optuna.samplers.TPESampler(seed=_trial_seed(seed, i),
                                                           n_startup_trials=max(2, min(10, trials // 3)))
                asked.append(study.ask())
                asked[-1].set_user_attr("pid", os.getpid())  # whose it is: recovered once that process is gone
                asked[-1].set_user_attr("host", socket.gethostname())
        _run_trials(st, study, asked, optuna, progress)
    return write_outputs(st, study, optuna, time.perf_counter() - t0)


def _open_study(optuna: Any, db: Path, name: str, fp: str, direction: str, prune: bool,
                attrs: dict[str, Any]) -> optuna.Study:
    """The study ``name`` in ``db``, created there if the database holds none; a database holding another study (or
    that is not a study database) is refused, naming it."""
    url = f"sqlite:///{db.resolve()}"
    if db.exists():
        foreign = _foreign_tables(db)
        if foreign:
            raise TuneError(f"{db}: another program's database (tables {', '.join(foreign[:5])}), not a study: give "
                            "another --out")
        try:
            names = optuna.get_all_study_names(url)
        except Exception as e:  # noqa: BLE001 (not a database, or another program's)
            raise TuneError(f"{db}: not a study database ({type(e).__name__})") from None
        if names and name not in names:
            raise TuneError(f"{db}: holds the study {shown(names[0])}, not {name}: the config, --set, space, "
                            "objective or seed differ; give another --out")
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    study = optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True,
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0) if prune
                                else optuna.pruners.NopPruner())
    if "fingerprint" not in study.user_attrs:
        for k, v in {"fingerprint": fp, **attrs}.items():
            study.set_user_attr(k, v)
    elif study.user_attrs["fingerprint"] != fp:
        raise TuneError(f"{db}: the study {name} was started from another config or space; give another --out")
    return study


#: tables an Optuna RDB storage creates (its schema's, and its migrations' record)
_OPTUNA_TABLES = {"studies", "version_info", "alembic_version", "study_directions", "study_user_attributes",
                  "study_system_attributes", "trials", "trial_user_attributes", "trial_system_attributes",
                  "trial_params", "trial_values", "trial_intermediate_values", "trial_heartbeats"}


def _foreign_tables(db: Path) -> list[str]:
    """The tables of the SQLite file ``db`` that Optuna does not create (read only: a file that is not SQLite, or an
    empty one, gives none here and is judged by Optuna)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        finally:
            con.close()
    except sqlite3.Error:
        return []
    return sorted(n for n in names if n not in _OPTUNA_TABLES and not n.startswith("sqlite_"))


def _trial_seed(seed: int, index: int) -> int:
    """The sampler's seed for the study's ``index``-th trial: a function of the study's seed and the index only."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _counted(t: optuna.trial.FrozenTrial) -> bool:
    return "interrupted" not in t.user_attrs


def _index(study: optuna.Study) -> int:
    """Trials so far, those interrupted (re-run under a new number) left out, and so are the re-runs still waiting
    to be asked for: the next ``ask`` takes a waiting re-run first, under the interrupted trial's index (counted
    before it ran, the re-run of a study's last trial never ran: a one-trial study ended with no trial)."""
    return sum(_counted(t) and t.state.name != "WAITING" for t in study.get_trials(deepcopy=False))


def _recover_stale(study: optuna.Study, optuna: Any) -> None:
    """Trials left RUNNING by a process of this machine that is gone (kill -9, a power cut): marked FAIL with
    ``interrupted`` and their values enqueued, so the next trial runs them again (and the sampler's sequence is the
    uninterrupted one's).  A RUNNING trial of another machine, or of a live process, is left alone."""
    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid, where = t.user_attrs.get("pid"), t.user_attrs.get("host")
        if where != host or not isinstance(pid, int) or alive(pid):
            continue
        study._storage.set_trial_user_attr(t._trial_id, "interrupted", f"process {pid} ended mid-trial; re-run")
        study._storage.set_trial_user_attr(t._trial_id, "fail_reason", "interrupted (its process ended)")
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        if t.params:
            study.enqueue_trial(t.params, user_attrs={"rerun_of": t.number})


class _NonFinite(ValueError):
    """The objective came out NaN or infinite (the run diverged)."""


def tuning_data(data: FederatedData) -> FederatedData:
    """``data`` as a trial sees it: the seen clients' training and validation splits, an empty test split and no
    unseen clients, so that nothing a trial computes can read the test data."""
    if data.seen.val is None:
        raise ConfigError(f"{data.name}: no validation split to tune on (set run.val_fraction)")
    tr = data.seen.train
    empty = Split(tr.x[:0].clone(), tr.y[:0].clone(), torch.zeros_like(tr.offsets))
    return FederatedData(ClientGroup(tr, empty, data.seen.val), data.num_classes, None, data.name, data.meta)


def _data_for(st: _Study, cfg: ExperimentConfig) -> FederatedData:
    """The trial's data, built once per distinct ``[data]`` table and validation fraction."""
    key = json.dumps([cfg.raw["data"], cfg.run.val_fraction], sort_keys=True, default=str)
    if key not in st.data:
        st.data.clear()  # one dataset kept at a time
        st.data[key] = tuning_data(cfg.build_data())
    return st.data[key]


def _objective_of(history: list[dict[str, Any]], name: str, last: int) -> float:
    vals = [float(r[name]) for r in history if isinstance(r.get(name), int | float)]
    if not vals:
        raise _NonFinite(f"no evaluated round reported {name}")
    return float(np.mean(vals[-last:]))


class _Trial:
    """One trial while it runs: its values, config, folder, the pruner's verdict and its outcome."""

    def __init__(self, st: _Study, trial: optuna.Trial) -> None:
        self.trial, self.t0 = trial, time.perf_counter()
        self.dir = st.out / "trials" / f"{trial.number:04d}"
        trial.set_user_attr("dir", str(self.dir.relative_to(st.out)))
        self.values = {p.key: p.suggest(trial) for p in st.params}
        self.cfg: ExperimentConfig | None = None
        self.pruned = False
        self.reason = ""
        self.value: float | None = None

    def report(self, st: _Study, group: list[Replica], optuna: Any) -> None:
        """An evaluated round of this trial's replicas (all at the same round): the objective so far (mean over
        the seeds), to the pruner; ``pruned`` once it says so."""
        rows = [rep.state.history[-1] for rep in group if rep.state is not None and rep.state.history]
        if self.pruned or self.reason or len(rows) != len(group) or \
                not all(isinstance(r.get(st.objective), int | float) for r in rows):
            return
        v = float(np.mean([r[st.objective] for r in rows]))
        if not math.isfinite(v):
            raise _NonFinite(f"{st.objective} = {v} at round {rows[0]['round']}")
        self.trial.report(v, int(rows[0]["round"]))
        self.pruned = self.trial.should_prune()

    def finish(self, st: _Study, histories: list[list[dict[str, Any]]]) -> None:
        value = float(np.mean([_objective_of(h, st.objective, st.last) for h in histories]))
        if not math.isfinite(value):
            raise _NonFinite(f"{st.objective} = {value}")
        self.value = value

    def tell(self, study: optuna.Study, optuna: Any, progress: bool | str) -> None:
        states = optuna.trial.TrialState
        state = states.PRUNED if self.pruned else states.FAIL if self.reason or self.value is None else \
            states.COMPLETE
        if self.reason:
            self.trial.set_user_attr("fail_reason", self.reason[:2000])
        self.trial.set_user_attr("seconds", time.perf_counter() - self.t0)
        study.tell(self.trial, self.value if state == states.COMPLETE else None, state=state, skip_if_finished=True)
        if progress:
            what = f"{self.value:.4f}" if state == states.COMPLETE else state.name
            print(f"trial {self.trial.number}: {self.values} -> {what}" + (f" ({self.reason})" if self.reason else ""),
                  flush=True)


#: what fails a trial (and only the trial: the study goes on, the reason recorded): its config refused (ConfigError),
#: its run diverged (TrainingDiverged, _NonFinite), or a combination of values the engine refuses as it builds the run
#: (a ValueError, as ``fedmtl run`` would report it: e.g. a robust aggregator that needs more updates than a round has)
_TRIAL_ERRORS = (ConfigError, TrainingDiverged, _NonFinite, ValueError)


def _run_trials(st: _Study, study: optuna.Study, asked: list[optuna.Trial], optuna: Any,
                progress: bool | str) -> None:
    """Run the trials ``asked`` (one, or ``--batch-trials`` of them, trained together) and tell the study."""
    trials = [_Trial(st, t) for t in asked]
    try:
        for t in trials:
            try:
                t.cfg = st.build(t.values)
            except ConfigError as e:
                t.reason = f"ConfigError: {e}"
        live = [t for t in trials if t.cfg is not None]
        if len(live) > 1:
            try:
                _run_together(st, live, optuna, progress)
                live = []
            except _TRIAL_ERRORS:  # one of them diverged: each on its own, to say which
                for t in live:
                    shutil.rmtree(t.dir, ignore_errors=True)
                    t.pruned = False
        for t in live:
            _run_alone(st, t, optuna, progress)
    except BaseException as e:  # the process stops (Ctrl-C, SIGTERM, a bug): its trials fail with the reason
        for t in trials:
            t.reason = t.reason or f"{type(e).__name__}: {e}"
            stopped = not isinstance(e, Exception) and not t.reason.startswith("ConfigError")
            if stopped:  # interrupted, as after kill -9: not counted, its values run again on --resume
                t.trial.set_user_attr("interrupted", f"stopped by {type(e).__name__}; re-run")
            t.tell(study, optuna, False)
            if stopped:
                study.enqueue_trial(t.values, user_attrs={"rerun_of": t.trial.number})
        raise
    for t in trials:
        t.tell(study, optuna, progress)


def _run_alone(st: _Study, t: _Trial, optuna: Any, progress: bool | str) -> None:
    from .seeds import run_seeds

    assert t.cfg is not None

    def report(group: list[Replica]) -> None:
        t.report(st, group, optuna)
        if t.pruned:
            raise optuna.TrialPruned()

    try:
        seeds = list(t.cfg.run.seeds) or [t.cfg.run.seed]
        with run_figures(False):  # a trial's runs draw no figures of their own
            res = run_seeds(t.cfg, seeds=seeds, out=t.dir, progress=progress, data=_data_for(st, t.cfg),
                            on_round=report, overwrite=t.dir.exists())
        t.finish(st, [r.history for r in res.runs])
    except optuna.TrialPruned:
        pass
    except _TRIAL_ERRORS as e:
        t.reason = f"{type(e).__name__}: {e}"


def _run_together(st: _Study, trials: list[_Trial], optuna: Any, progress: bool | str) -> None:
    """Trials that differ only in ``optim.lr`` and the algorithm's real-valued fields trained as one batched
    computation: every seed of every trial a replica (``driver.drive_many``), their clients in the same executor
    calls, each with its own rate and field values (``engine.clients.train_together``).  A pruned trial's replicas
    run on with the batch (their result unused)."""

    from .driver import Replica, build_local, drive_many
    from .rundir import RunDirectory
    from .seeds import SeedsResult, seed_dir, summarize_seeds, write_seeds

    owner: dict[int, _Trial] = {}
    with contextlib.ExitStack() as stack, run_figures(False):
        replicas = []
        for t in trials:
            assert t.cfg is not None
            data = _data_for(st, t.cfg)  # the same object for all: only optim.lr and algorithm fields differ
            t.dir.mkdir(parents=True, exist_ok=True)
            with atomic(t.dir / "config.toml") as f:
                f.write(dumps(t.cfg.raw))
            for s in list(t.cfg.run.seeds) or [t.cfg.run.seed]:
                d = seed_dir(t.dir, s)
                stack.enter_context(RunDirectory(d))
                c = t.cfg.with_seed(s)
                rep = Replica(build_local(c, data, None, d), c, d, f"trial {t.trial.number} seed {s}")
                owner[id(rep)] = t
                replicas.append(rep)
        replicas[0].engine.check_memory(len(replicas))

        def report(group: list[Replica]) -> None:
            for t in trials:
                mine = [rep for rep in group if owner[id(rep)] is t]
                if mine:
                    t.report(st, mine, optuna)

        runs = drive_many(replicas, False, progress, on_round=report)
    for t in trials:
        mine = [r for rep, r in zip(replicas, runs, strict=True) if owner[id(rep)] is t]
        assert t.cfg is not None
        seeds = list(t.cfg.run.seeds) or [t.cfg.run.seed]
        write_seeds(t.dir, SeedsResult(mine, summarize_seeds(t.cfg, seeds, mine), t.dir), f"trial {t.trial.number}")
        if not t.pruned:
            t.finish(st, [r.history for r in mine])


# ---------------------------------------------------------------------------------------------
# What a study leaves


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({"number": t.number, "state": t.state.name, "params": dict(t.params), "value": t.value,
                     "seconds": t.user_attrs.get("seconds"), "reason": t.user_attrs.get("fail_reason", ""),
                     "dir": t.user_attrs.get("dir", "")})
    return rows


def write_outputs(st: _Study, study: optuna.Study, optuna: Any, seconds: float) -> TuneSummary:
    """``trials.csv``, ``trials.md``, ``tune.json``, ``best.toml`` and the figures of ``study``; its summary."""
    out = st.out
    rows = trial_rows(study)
    states = optuna.trial.TrialState
    counted = [t for t in study.get_trials(deepcopy=False) if _counted(t)]
    complete = [t for t in counted if t.state == states.COMPLETE]
    best = None
    if complete:
        best = (max if st.direction == "maximize" else min)(complete, key=lambda t: (t.value, -t.number))
    notes: list[str] = []
    keys = [p.key for p in st.params]
    with atomic(out / "trials.csv") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", *keys, "value", "seconds", "reason"])
        for r in rows:
            w.writerow([r["number"], r["state"], *[r["params"].get(k, "") for k in keys],
                        "" if r["value"] is None else r["value"],
                        "" if r["seconds"] is None else f"{r['seconds']:.2f}", r["reason"]])
    md = [f"| number | state | {' | '.join(keys)} | {st.objective} | seconds | reason |",
          "|" + "---|" * (len(keys) + 5)]
    for r in rows:
        val = "" if r["value"] is None else f"{r['value']:.4f}"
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        ps = " | ".join(_fmt(r["params"].get(k, "")) for k in keys)
        md.append(f"| {r['number']} | {r['state']} | {ps} | {val} | {secs} | {r['reason'].replace('|', '/')} |")
    with atomic(out / "trials.md") as f:
        f.write("\n".join(md) + "\n")
    if best is not None:
        cfg = st.build(dict(best.params), tuning=False)  # the user's config with the best values (no tuning split)
        with atomic(out / "best.toml") as f:
            f.write(f"# fedmtl tune: trial {best.number} of {out}, {st.objective} = {best.value:.6g} "
                    f"({st.direction})\n" + dumps(cfg.raw))
    else:
        notes.append("no trial completed: no best.toml")
    best_params = {} if best is None else dict(best.params)
    at_edge = edge_notes(st.params, best_params)
    for p in st.params:
        if p.key in at_edge:
            bounds = f"choices {list(p.choices)}" if p.choices is not None else f"range [{p.low}, {p.high}]"
            notes.append(f"best {p.key} = {_fmt(best_params[p.key])} lies at the {at_edge[p.key]} end of its "
                         f"{bounds}: the optimum may lie outside it (widen the range)")
    notes += _figures(out, study, optuna, st, len(complete))
    summary = TuneSummary(
        objective=st.objective, direction=st.direction, best_value=None if best is None else best.value,
        best_params=best_params, best_trial=None if best is None else best.number,
        complete=len(complete), pruned=sum(t.state == states.PRUNED for t in counted),
        failed=sum(t.state == states.FAIL for t in counted),
        interrupted=sum(not _counted(t) for t in study.get_trials(deepcopy=False)), seconds=seconds,
        seed=st.seed, out=out, trials=rows, notes=notes, at_edge=at_edge)
    write_json(out / "tune.json", {
        "objective": st.objective, "direction": st.direction, "last_evaluations": st.last,
        "best_value": summary.best_value, "best_params": summary.best_params, "best_trial": summary.best_trial,
        "best_at_edge": at_edge,
        "n_trials": {"complete": summary.complete, "pruned": summary.pruned, "failed": summary.failed,
                     "interrupted": summary.interrupted},
        "total_seconds": seconds, "trial_seconds": float(sum(r["seconds"] or 0.0 for r in rows)),
        "sampler": {"name": "TPESampler", "seed": st.seed}, "pruner": "MedianPruner" if st.prune else None,
        "validation": st.tuning_sets or "the config's own", "study": study.study_name, "notes": notes,
        "trials": rows})
    return summary


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _figures(out: Path, study: optuna.Study, optuna: Any, st: _Study, n_complete: int) -> list[str]:
    """Optimization history and parameter importances, PNG and PDF; the notes of what was skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's matplotlib backend is marked experimental
        if n_complete:
            ax = ovm.plot_optimization_history(study, target_name=st.objective)
            ax.set_title(f"optimization history ({st.direction} {st.objective})", fontsize=10)
            save_figure(ax.figure, out / "history.png", vector=True)
        else:
            notes.append("no trial completed: no history figure")
        if len(st.params) >= 2 and n_complete >= 2:
            ax = ovm.plot_param_importances(study, target_name=st.objective)
            save_figure(ax.figure, out / "importance.png", vector=True)
        else:
            notes.append("parameter importances need at least 2 searched keys and 2 completed trials: skipped")
    plt.close("all")
    return notes


__all__ = ["DEFAULT_OBJECTIVE", "Param", "TuneError", "TuneSummary", "bundled_spaces", "read_space",
           "resolve_space", "tune", "tuning_data"]
