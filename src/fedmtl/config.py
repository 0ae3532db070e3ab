"""Experiment configuration: TOML tables that map one-to-one onto constructors.

::

    [data]       name = "fedem_synthetic" + the dataset builder's keyword arguments
    [model]      name = "linear"          + the model builder's keyword arguments
    [algorithm]  name = "fedem"           + the algorithm dataclass's fields
    [optim]      fields of fedmtl.optim.SGD
    [run]        fields of fedmtl.engine.spec.RunConfig
    [systems]    fields of fedmtl.engine.systems.SystemsConfig (stragglers, drops, network for the time estimate)
    [robust]     fields of fedmtl.robust.RobustConfig (aggregator, trim, num_byzantine, multi_krum_m, clip_norm,
                 bucketing, cc_tau, cc_iterations)
    [attack]     fields of fedmtl.robust.AttackConfig (kind, fraction, strength): an attack harness (scale, signflip,
                 gaussian, labelflip, ipm, alie, minmax)
    [privacy]    fields of fedmtl.privacy.PrivacyConfig (user-level DP: clip_norm, noise_multiplier, accountant, ...)
    [log]        fields of fedmtl.runs.loggers.LogConfig (loggers = ["tensorboard", "mlflow"]: per-round metric logs)
    [server_opt] fields of fedmtl.engine.server_opt.ServerOptConfig (name = none | sgd | avgm | adam | yogi | adagrad,
                 lr, beta1, beta2, tau): the server's step on the global model (Reddi et al., ICLR 2021)
    [async]      fields of fedmtl.engine.async_config.AsyncConfig (mode = off | fedasync | fedbuff, concurrency,
                 buffer_size, staleness, ...): asynchronous training
    [flower]     fields of fedmtl.secure_aggregation.FlowerConfig (secure_aggregation = true: SecAgg+ over Flower;
                 num_shares, reconstruction_threshold, clipping_range, quantization_range)

The fixed tables (all but the first three) are registered in ``Tables``, one line each.
Unknown tables or keys, wrong value types, values outside a field's ``Literal[...]`` choices and numbers outside a
key's declared range (``fedmtl.schema``; ``fedmtl list --table NAME``) raise ``ConfigError`` naming the key and the
file, before any data is built or any work is done.
``--set table.key=value`` overrides use TOML syntax for the value (bare words are taken as strings).
A Python caller that passes its own data (``fedmtl.run(..., data=...)``) may leave ``[data]`` out, and one that
passes its own model may leave ``[model]`` out.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from . import algorithms as _algorithms  # noqa: F401  (registers the built-in algorithms)
from . import data as _data  # noqa: F401  (registers the built-in datasets)
from . import models as _models  # noqa: F401  (registers the built-in models)
from .engine.async_config import AsyncConfig
from .engine.server_opt import ServerOptConfig
from .engine.spec import RunConfig, RunSpec
from .engine.systems import SystemsConfig
from .machine import physical_memory
from .optim import SGD
from .privacy import PrivacyConfig
from .registry import ALGORITHMS, DATASETS, MODELS
from .robust.aggregators import RobustConfig
from .robust.attacks import AttackConfig
from .runs.loggers import LogConfig
from .schema import (
    MAX_ITEMS,
    Range,
    check_number,
    choices_hint,
    choices_of,
    describe_type,
    range_of,
    shown,
    strip,
    type_hints,
)
from .secure_aggregation import FlowerConfig, refusal

T = TypeVar("T")


class Table(Generic[T]):
    """One fixed config table: its keys are the fields of the frozen dataclass ``cls`` (``fedmtl list --table
    NAME``, the handbook's key reference), and ``ExperimentConfig`` holds the built dataclass under the attribute
    this ``Table`` is assigned to in ``Tables`` (``cfg.run``, ``cfg.asynchronous``).

    ``name``: the table's name in a config file where it is not the attribute's (``[async]``).
    ``when_given``: recorded in the resolved config only when the config gives it, so that configs (and
    checkpoints) of runs without it keep their resolved form.  ``defaults_left_out``: keys recorded only away from
    their default, for the same reason.  ``engine``: part of the engine's ``RunSpec`` (else read around the engine
    only: loggers, Flower)."""

    def __init__(self, cls: type[T], name: str = "", *, when_given: bool = False,
                 defaults_left_out: tuple[str, ...] = (), engine: bool = True) -> None:
        self.cls, self.name, self.when_given, self.engine = cls, name, when_given, engine
        self.defaults_left_out = defaults_left_out
        self.attr = name

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr
        self.name = self.name or attr

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Table[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Table[T] | T:
        if obj is None:
            return self
        value: T = obj.tables[self.name]
        return value

    def resolved(self, value: Any) -> dict[str, Any]:
        """``value`` as the resolved config records it: its fields, less those of ``defaults_left_out`` that are at
        their default."""
        out = dataclasses.asdict(value)
        default = self.cls()
        for key in self.defaults_left_out:
            if getattr(value, key) == getattr(default, key):
                out.pop(key)
        return out


class Tables:
    """The fixed config tables, one line each, in the order the resolved config records them.  A new table is a
    frozen dataclass (its fields are the table's keys, with ``Annotated`` ranges, ``fedmtl.schema``) and a line
    here; ``[data]``, ``[model]`` and ``[algorithm]`` are the named tables (``NAMED_TABLES``), built from a
    registry by the name they hold."""

    optim = Table(SGD, defaults_left_out=("lr_milestone_rounds",))
    run = Table(RunConfig, defaults_left_out=("drop_last", "data_on_device", "seeds", "val_fraction"))
    systems = Table(SystemsConfig)
    robust = Table(RobustConfig, when_given=True)
    attack = Table(AttackConfig, when_given=True)
    privacy = Table(PrivacyConfig, when_given=True, defaults_left_out=("reproducible_noise",))
    log = Table(LogConfig, when_given=True, engine=False)
    server_opt = Table(ServerOptConfig, when_given=True)
    asynchronous = Table(AsyncConfig, "async", when_given=True)
    flower = Table(FlowerConfig, when_given=True, engine=False)


#: every fixed table by its name in a config file
TABLES: dict[str, Table[Any]] = {t.name: t for t in vars(Tables).values() if isinstance(t, Table)}
#: the tables whose ``name`` picks a builder from a registry
NAMED_TABLES = ("data", "model", "algorithm")


class ConfigError(ValueError):
    """A configuration error; the message names the file and the key."""


# Every number a config holds is finite and bounded (NaN, Inf, 1e300 and 1e-320 are never a setting) and lies in
# its key's declared range (``fedmtl.schema``).  Sizes (clients, dimensions, examples) also have memory-based bounds
# (``check_data_table``).


def _coerce(value: Any, tp: Any, where: str, rng: Range | None = None) -> Any:
    """Check ``value`` against the annotation ``tp`` (and its declared ``Range``, ``fedmtl.schema``); returns the
    value converted where lossless.  Errors say what the key expects in words (``describe_type``) and echo the
    value cut short (``shown``)."""
    allowed = choices_of(tp)
    if allowed is not None:  # Literal[...] or a registry's names (OneOf)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise ConfigError(f"{where}: must be one of {list(allowed)}, got {shown(value)}{choices_hint(tp)}")
        return value
    rng = range_of(tp) or rng
    tp = strip(tp)
    origin = typing.get_origin(tp)

    def wrong(what: str) -> ConfigError:
        return ConfigError(f"{where}: expected {what}, got {_kind(value)} {shown(value)}")

    if origin in (typing.Union, types.UnionType):
        near: ConfigError | None = None  # the error of the first arm of the value's kind (a list for a list arm)
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, where, rng)
            except ConfigError as e:
                kind = typing.get_origin(strip(arg)) or strip(arg)
                if near is None and isinstance(kind, type) and isinstance(value, list | tuple if kind in (list, tuple)
                                                                          else kind):
                    near = e
        raise near or wrong(describe_type(tp))
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise wrong(describe_type(tp))
        if len(value) > MAX_ITEMS:  # before a single item is converted
            raise ConfigError(f"{where}: {len(value)} items; a config list holds at most {MAX_ITEMS}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        try:
            check_number(float(value), rng, where)
        except (ValueError, OverflowError) as e:
            raise ConfigError(str(e) if isinstance(e, ValueError) else f"{where}: {shown(value)} is not a float"
                              ) from None
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        try:
            check_number(value, rng, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    return value


def _kind(value: Any) -> str:
    """A TOML value's kind in words, for "got ..."."""
    for kind, word in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string"), (list, "list"),
                       (tuple, "list"), (dict, "table")):
        if isinstance(value, kind):
            return word
    return type(value).__name__


def _signature_types(fn: Callable[..., Any]) -> dict[str, Any]:
    """Parameter name -> annotation for a function or dataclass (its init fields)."""
    if isinstance(fn, functools.partial):  # a builder with some arguments fixed
        return {k: v for k, v in _signature_types(fn.func).items() if k not in fn.keywords}
    if dataclasses.is_dataclass(fn):
        hints = type_hints(fn)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(fn) if f.init}
    hints = type_hints(fn)
    return {n: hints.get(n, Any) for n, p in inspect.signature(fn).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _check_table(
    table: dict[str, Any], target: Callable[..., Any], where: str, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    allowed = {k: v for k, v in _signature_types(target).items() if k not in skip}
    out = {}
    for key, value in table.items():
        if key not in allowed:
            near = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where}: unknown key {shown(key)}{hint}; allowed: {sorted(allowed)}")
        out[key] = _coerce(value, allowed[key], f"{where}.{key}")
    return out


@dataclass
class ExperimentConfig(Tables):
    """A validated experiment; ``raw`` is the resolved TOML content (what the run directory records).  Each fixed
    table is an attribute (``Tables``: ``cfg.run``, ``cfg.privacy``, ...)."""

    data: dict[str, Any]
    model: dict[str, Any]
    algorithm: dict[str, Any]
    #: every fixed table's dataclass by table name (``TABLES``)
    tables: dict[str, Any] = field(default_factory=lambda: {name: t.cls() for name, t in TABLES.items()})
    raw: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<config>"

    def with_seed(self, seed: int) -> ExperimentConfig:
        """This config as the single-seed run ``seed`` (``run.seed = seed``, no ``run.seeds``): one replica of
        a run with several seeds, exactly the config a separate run with that seed has."""
        raw = {t: dict(v) for t, v in self.raw.items()}
        raw["run"]["seed"] = seed
        raw["run"].pop("seeds", None)
        run = dataclasses.replace(self.run, seed=seed, seeds=())
        return dataclasses.replace(self, tables={**self.tables, "run": run}, raw=raw)

    def run_spec(self) -> RunSpec:
        """Everything the engine runs besides the algorithm, model, clients and federation (``RunSpec``: the
        tables marked ``engine``)."""
        return RunSpec(**{t.attr: self.tables[name] for name, t in TABLES.items() if t.engine})

    def build_algorithm(self) -> Any:
        params = {k: v for k, v in self.algorithm.items() if k != "name"}
        return ALGORITHMS[self.algorithm["name"]](**params)

    def build_data(self) -> Any:
        from .data.federated import FederatedData

        if self.data["name"] not in DATASETS:
            raise ConfigError(f"{self.source}: [data] comes from Python (fedmtl.run(..., data=...)); pass the data")
        params = {k: v for k, v in self.data.items() if k != "name"}
        data = DATASETS[self.data["name"]](**params)
        if not isinstance(data, FederatedData):
            raise ConfigError(f"dataset builder {self.data['name']!r} returned {type(data).__name__}, "
                              "not a fedmtl.FederatedData")
        if self.run.val_fraction > 0:  # run.val_fraction: a validation split carved from the training examples
            from .data.federated import carve_validation

            if data.seen.val is not None:
                raise ConfigError(f"{self.source}: [run] val_fraction = {self.run.val_fraction:g}, but the data "
                                  f"{self.data['name']!r} already has a validation split ([data] val_frac): give one")
            data = carve_validation(data, self.run.val_fraction)
        return data

    def build_model(self, input_shape: tuple[int, ...], num_classes: int, meta: dict[str, Any] | None = None) -> Any:
        from .models import build_model

        if self.model["name"] not in MODELS:
            raise ConfigError(f"{self.source}: [model] comes from Python (fedmtl.run(..., model=...)); pass the model")
        params = {k: v for k, v in self.model.items() if k not in ("name", "adapters", "weights")}
        model = build_model(self.model["name"], input_shape, num_classes, meta, **params)
        if self.model.get("weights"):  # [model] weights: every run starts from these (e.g. pretrained) weights
            import dataclasses as dc

            from .models.lora import load_base

            try:
                load_base(model.module, self.model["weights"], "model.weights")
            except ValueError as e:
                raise ConfigError(f"{self.source}: {e}") from None
            model = dc.replace(model, initial_params={k: v.detach().clone()
                                                      for k, v in model.module.named_parameters()})
        if "adapters" in self.model:  # [model.adapters]: the built model frozen, low-rank adapters trained
            from .models.base import Model, ModelError
            from .models.lora import seeded_base

            if not self.model["adapters"].get("base"):  # the same base wherever the config is built (Flower nodes)
                seeded_base(model.module, int(self.model["adapters"].get("base_seed", 0)))
            try:
                adapted = Model.from_module(model.module, num_classes,
                                            output="binary" if model.output == "binary" else "multiclass",
                                            input_transform=model.input_transform, name=f"{model.name}+lora",
                                            adapters=self.model["adapters"])
                object.__setattr__(adapted, "token_input", model.token_input)
                return adapted
            except ModelError as e:
                raise ConfigError(f"{self.source}: [model.adapters]: {e}") from None
        return model


def _named(table: dict[str, Any], registry: dict[str, Any], tname: str, src: str) -> tuple[str, Any]:
    name = table.get("name")
    if name is None:
        raise ConfigError(f"{src}: [{tname}] needs a 'name' (one of {sorted(registry)})")
    if not isinstance(name, str) or name not in registry:
        near = difflib.get_close_matches(name, list(registry), n=1) if isinstance(name, str) else []
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{src}: [{tname}].name = {shown(name)} is not one of {sorted(registry)}{hint}")
    return name, registry[name]


# names the built-in dataset builders use for sizes: clients, training and test examples per client, features
_CLIENTS, _TRAIN, _TEST, _DIM = ("num_clients", "m"), ("max_samples", "n_train", "max_train"), ("n_test",), ("dim", "d")


def check_data_table(fn: Callable[..., Any], values: dict[str, Any], where: str) -> None:
    """Sizes of a built-in dataset's ``[data]`` values before anything is built (each value already lies in its
    declared range, ``fedmtl.schema``): the data must fit in this machine's memory."""
    if not getattr(fn, "__module__", "").startswith("fedmtl."):
        return  # a plugin's builder validates its own arguments
    params = {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}
    full = {**params, **values}

    def first(keys: tuple[str, ...]) -> int | None:
        return next((int(full[k]) for k in keys if isinstance(full.get(k), int)), None)

    clients, train, test, dim = first(_CLIENTS), first(_TRAIN), first(_TEST) or 0, first(_DIM)
    if clients is not None and train is not None and dim is not None:
        need = clients * (train + test) * dim * 4 + clients * int(full.get("num_components") or 1) * 8  # x, and pi
        have = physical_memory()
        if need > 0.8 * have:
            raise ConfigError(f"{where}: {clients} clients x ({train} + {test}) examples x {dim} features need about "
                              f"{need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB of memory")


PYTHON_DATA = "<python data>"
PYTHON_MODEL = "<python model>"


def validate(raw: dict[str, Any], source: str = "<config>", data_given: bool = False,
             model_given: bool = False) -> ExperimentConfig:
    """Validate a parsed TOML document; raises ``ConfigError`` naming ``source`` and the key.

    ``data_given`` / ``model_given``: the caller supplies the data / model objects, so ``[data]`` / ``[model]``
    must be left out (they are recorded as coming from Python)."""
    names = [*NAMED_TABLES, *TABLES]
    for t in raw:
        if t not in names:
            raise ConfigError(f"{source}: unknown table [{shown(t, bare=True)}]; allowed: {names}")
        if not isinstance(raw[t], dict):
            raise ConfigError(f"{source}: {shown(t)} must be a table, got {_kind(raw[t])} {shown(raw[t])}")
    tables = {t: dict(raw.get(t, {})) for t in names}
    for t, given, marker in (("data", data_given, PYTHON_DATA), ("model", model_given, PYTHON_MODEL)):
        if given and tables[t] and tables[t] != {"name": marker}:
            raise ConfigError(f"{source}: [{t}] is given twice: as a table and as a Python object; leave the "
                              "table out")
    if data_given:
        data: dict[str, Any] = {"name": PYTHON_DATA}
    else:
        dname, dfn = _named(tables["data"], DATASETS, "data", source)
        data = {"name": dname, **_check_table({k: v for k, v in tables["data"].items() if k != "name"}, dfn,
                                             f"{source}: [data]")}
        check_data_table(dfn, {k: v for k, v in data.items() if k != "name"}, f"{source}: [data]")
    if model_given:
        model: dict[str, Any] = {"name": PYTHON_MODEL}
    else:
        mname, mfn = _named(tables["model"], MODELS, "model", source)
        model = {"name": mname, **_check_table({k: v for k, v in tables["model"].items()
                                                if k not in ("name", "adapters", "weights")}, mfn,
                                              f"{source}: [model]", skip=("input_shape", "num_classes", "meta"))}
        weights = tables["model"].get("weights", "")
        if not isinstance(weights, str):
            raise ConfigError(f"{source}: [model] weights must be the path of a safetensors file, got {shown(weights)}")
        if weights:  # a safetensors file of the module's state_dict, where every run starts (checked when built)
            _lookup_path(weights, f"{source}: [model] weights")
            model["weights"] = weights
        if "adapters" in tables["model"]:  # the [model.adapters] sub-table (fedmtl.models.lora.AdapterConfig)
            from .models.lora import AdapterConfig

            sub = tables["model"]["adapters"]
            if not isinstance(sub, dict):
                raise ConfigError(f"{source}: [model] adapters must be a table ([model.adapters]), got {shown(sub)}")
            try:
                ad = AdapterConfig(**_check_table(sub, AdapterConfig, f"{source}: [model.adapters]"))
            except ConfigError:
                raise
            except ValueError as e:
                raise ConfigError(f"{source}: [model.adapters]: {e}") from None
            if ad.base:
                _lookup_path(ad.base, f"{source}: [model.adapters] base")
            model["adapters"] = {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in dataclasses.asdict(ad).items()}
    aname, acls = _named(tables["algorithm"], ALGORITHMS, "algorithm", source)
    alg = {"name": aname, **_check_table({k: v for k, v in tables["algorithm"].items() if k != "name"}, acls,
                                        f"{source}: [algorithm]")}
    try:
        acls(**{k: v for k, v in alg.items() if k != "name"})
        built = {name: t.cls(**_check_table(tables[name], t.cls, f"{source}: [{name}]")) for name, t in TABLES.items()}
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source}: {e}") from e
    resolved = {"data": data, "model": model, "algorithm": alg}
    resolved.update({name: t.resolved(built[name]) for name, t in TABLES.items() if tables[name] or not t.when_given})
    flower = built["flower"]
    why = refusal(aname, built["robust"], built["attack"]) if flower.secure_aggregation else None
    if why is not None:  # refused before any data is built or any node contacted
        raise ConfigError(f"{source}: {why}")
    return ExperimentConfig(data, model, alg, built, resolved, source)


def _lookup_path(path: str, where: str) -> None:
    """Refuse a path the system cannot even look up (a name too long, a loop of links, a file used as a folder)
    when the config is read, naming the key; whether it is a usable file is checked where it is read."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        shown = path if len(path) <= 80 else f"{path[:77]}..."
        raise ConfigError(f"{where} = {shown!r}: {getattr(e, 'strerror', None) or e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"table.key=value"`` -> (table, key, value); value in TOML syntax, bare words are strings."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {shown(text)}: expected table.key=value")
    lhs, value = text.split("=", 1)
    table, key = lhs.strip().split(".", 1)  # key: "name", or "sub.name" for a sub-table ([model.adapters])
    if max_nesting(value) > MAX_NESTING:
        raise ConfigError(f"--set {shown(lhs.strip(), bare=True)}: value nested deeper than {MAX_NESTING}")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return table, key, parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = {t: dict(v) if isinstance(v, dict) else v for t, v in raw.items()}
    for text in overrides:
        table, key, value = parse_override(text)
        out.setdefault(table, {})
        if not isinstance(out[table], dict):
            raise ConfigError(f"--set {shown(text)}: '{shown(table)}' is not a table")
        sub, _, leaf = key.rpartition(".")
        if sub:  # model.adapters.rank=8: a key of the sub-table [model.adapters]
            inner = out[table].get(sub, {})
            if not isinstance(inner, dict):
                raise ConfigError(f"--set {shown(text)}: {shown(table + '.' + sub)} is not a table")
            out[table] = {**out[table], sub: {**inner, leaf: value}}
        else:
            out[table][key] = value
    return out


def load(path: str | Path, overrides: list[str] | None = None, data_given: bool = False,
         model_given: bool = False) -> ExperimentConfig:
    raw = read_toml(path)
    try:
        return validate(apply_overrides(raw, overrides or []), str(path), data_given, model_given)
    except ConfigError as e:
        raise ConfigError(f"{e}{_renamed_hint(str(e), raw, overrides or [], str(path))}") from None


def _renamed_hint(message: str, raw: dict[str, Any], overrides: list[str], path: str) -> str:
    """Where an unknown key comes from the file's table whose name a --set replaced: say so."""
    for text in overrides:
        table, key, value = parse_override(text)
        old = raw.get(table, {}).get("name") if isinstance(raw.get(table), dict) else None
        if key != "name" or old is None or old == value or f"[{table}]: unknown key" not in message:
            continue
        kept = sorted(k for k in raw[table] if k != "name")
        return (f" (the key comes from {path}'s [{table}] table, written for {shown(old)}: --set "
                f"{shown(table, bare=True)}.name={shown(value)} keeps its other keys {kept}; start from a config "
                f"written for {shown(value)})")
    return ""


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML config file (a path, or the name of a bundled config: ``synthetic/fedem``); a missing
    or malformed file is a ConfigError naming it."""
    from .files import read_text
    from .resources import resolve_config

    path = resolve_config(path)
    try:  # kind and size checked before a byte is read: a FIFO or /dev/zero is refused, not read
        text = read_text(path, MAX_CONFIG_BYTES, "config", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (nor a bundled config of that name: fedmtl list)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    depth = max_nesting(text)
    if depth > MAX_NESTING:
        raise ConfigError(f"{path}: arrays or inline tables nested {depth} deep (at most {MAX_NESTING})")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None


MAX_CONFIG_BYTES = 1 << 20
MAX_NESTING = 32


def max_nesting(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings and comments (before parsing: tomllib recurses)."""
    depth = best = 0
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
            continue
        elif c in "[{":
            depth += 1
            best = max(best, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
        i += 1
    return best


def dumps(raw: dict[str, dict[str, Any]]) -> str:
    """Write a resolved config back as TOML (flat tables of scalars and lists)."""

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if v is None:
            raise ConfigError("None cannot be written to TOML")
        return repr(v)

    lines = []
    for t, table in raw.items():
        lines.append(f"[{t}]")
        lines += [f"{k} = {val(v)}" for k, v in table.items() if v is not None and not isinstance(v, dict)]
        lines.append("")
        for k, v in table.items():  # sub-tables ([model.adapters]) after the table's own keys
            if isinstance(v, dict):
                lines.append(f"[{t}.{k}]")
                lines += [f"{k2} = {val(v2)}" for k2, v2 in v.items() if v2 is not None]
                lines.append("")
    return "\n".join(lines)
