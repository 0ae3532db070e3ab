"""Config fuzzing through ``fedmtl run``: cases generated from the config schema itself (every numeric key of every
table, algorithm, dataset and model, at and beyond the ends of its declared range, ``fedmtl.schema``), so a new key
is fuzzed without anyone writing a case; and 200 seeded random mutations of a valid config.  Every case must end in
bounded time either with a clear one-line error naming the file and the key (exit 2), or with a sane result (exit 0:
finite metrics on a non-empty test set, at least one usable update per round).  Never a traceback, never a hang,
never nonsense reported as a result.  Also: a model whose updates are always NaN is stopped."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
import signal
import tomllib
import typing

import pytest
import torch
from torch import nn

from fedmtl.cli import main
from fedmtl.config import TABLES, dumps, load
from fedmtl.registry import ALGORITHMS, DATASETS, MODELS
from fedmtl.schema import MIN_MAGNITUDE, Range, range_of, strip, type_hints

BASE = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 5
n_test = 20
max_samples = 60
seed = 1

[model]
name = "linear"

[algorithm]
name = "fedem"
num_components = 2

[optim]
lr = 0.1
momentum = 0.5
weight_decay = 0.0001

[run]
rounds = 2
batch_size = 16
eval_every = 1
checkpoint_every = 1
seed = 3

[robust]
aggregator = "mean"

[attack]
kind = "none"
"""

VALUES = [float("nan"), float("inf"), float("-inf"), -1, 0, -1000, 1e30, -1e30, 1e300, 10**12, 2**63 - 1, "",
          "lstm", "text", [], [1, 2], {"x": 1}, True, False, 1.5, -0.5, 0.999, 3]


def _mutate(rng: random.Random, raw: dict) -> tuple[dict, str]:
    raw = json.loads(json.dumps(raw))
    table = rng.choice(sorted(raw))
    op = rng.random()
    if op < 0.8 and raw[table]:
        key = rng.choice(sorted(raw[table]))
        value = rng.choice(VALUES)
        raw[table][key] = value
        return raw, f"{table}.{key} = {value!r}"
    if op < 0.9:
        raw[table]["bogus_key"] = rng.choice(VALUES)
        return raw, f"{table}.bogus_key"
    if raw[table]:
        key = rng.choice(sorted(raw[table]))
        del raw[table][key]
        return raw, f"del {table}.{key}"
    return raw, "unchanged"


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _toml(raw: dict) -> str:
    try:
        return dumps(raw)
    except Exception:  # values dumps cannot write (dicts in tables): write them by hand
        lines = []
        for t, kv in raw.items():
            lines.append(f"[{t}]")
            for k, v in kv.items():
                lines.append(f"{k} = {json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else v}")
        return "\n".join(lines).replace("Infinity", "inf").replace("NaN", "nan")


@pytest.mark.slow
def test_200_config_mutations_end_cleanly(tmp_path, capsys):
    rng = random.Random(20261123)
    base = tomllib.loads(BASE)
    ok = refused = 0
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(200):
            raw, what = _mutate(rng, base)
            if rng.random() < 0.3:  # a second mutation
                raw, what2 = _mutate(rng, raw)
                what += "; " + what2
            code, _ = _run_case(tmp_path, capsys, case, raw, f"case {case} ({what})")
            ok += code == 0
            refused += code != 0
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ok >= 10 and refused >= 100, (ok, refused)  # the mutations exercise both outcomes


@pytest.mark.parametrize("setting,named", [
    ("optim.weight_decay=nan", "weight_decay"), ("optim.weight_decay=inf", "weight_decay"),
    ("optim.weight_decay=1e30", "weight_decay"), ("optim.lr=1e300", "lr"), ("optim.lr_gamma=5.0", "lr_gamma"),
    ("data.n_test=0", "n_test"), ("data.n_test=-1000", "n_test"), ("data.n_test=1000000000", "[data]"),
    ("data.dim=100000000", "[data]"), ("data.noise=inf", "noise"), ("run.eval_chunk_elems=-1000", "eval_chunk_elems"),
    ("algorithm.unseen_tol=inf", "unseen_tol"), ("algorithm.unseen_tol=-inf", "unseen_tol"),
    ("algorithm.num_components=1000000", "num_components"), ("model.name=lstm", "token ids"),
    # the second review's findings: values accepted that meant nothing
    ("optim.lr=1e-320", "lr = 1e-320"), ("run.sampling_rate=1e-320", "sampling_rate"),
    ("optim.lr_gamma=1e-320", "lr_gamma"),
    ("optim.lr_milestones=[0.75, 0.5]", "strictly increasing"), ("algorithm.unseen_tol=-1.0", "unseen_tol"),
    ("data.min_samples=0", "min_samples"), ("data.num_components=1000000", "num_components"),
])
def test_the_reported_nonsense_is_refused_in_one_line(tmp_path, capsys, setting, named):
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    try:
        code = main(["run", str(cfg), "--set", setting, "--out", str(tmp_path / "o"), "-q"])
    except _Timeout:
        pytest.fail(f"{setting} ran past 120 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err and str(cfg) in err, err


def test_toml_nested_5000_deep_is_refused(tmp_path, capsys):
    cfg = tmp_path / "deep.toml"
    cfg.write_text(BASE + "\n[systems]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "nested 5000 deep" in capsys.readouterr().err


class _NaNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) * float("nan")


def test_a_run_whose_every_update_is_nan_stops_instead_of_reporting(tmp_path):
    import numpy as np

    import fedmtl
    from fedmtl.engine.round import TrainingDiverged

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(4)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)
    model = fedmtl.Model.from_module(_NaNModel(), 3)
    with pytest.raises(TrainingDiverged, match="every client update was NaN/Inf"):
        fedmtl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 10}}, data=data, model=model)
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------ the schema's cases
# the models an algorithm's in-range runs need: those of its contract-suite toy settings (Algorithm.toy.model)
BODY_HEAD = {name for name, cls in ALGORITHMS.items() if cls.toy.model == "mlp"}
SKIP_PARAMS = ("input_shape", "num_classes", "meta")


def _numeric_keys(target) -> list[tuple[str, type, Range | None, object]]:
    """(key, int or float, declared range, default) of every numeric key of a config dataclass or builder (list
    and tuple keys: their items)."""
    hints = type_hints(target)
    if dataclasses.is_dataclass(target):
        defaults = {f.name: f.default for f in dataclasses.fields(target) if f.init}
    else:
        defaults = {n: p.default for n, p in inspect.signature(target).parameters.items()
                    if n not in SKIP_PARAMS and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    out = []
    for key, default in defaults.items():
        tp = hints.get(key)
        rng, base = range_of(tp), strip(tp)
        if typing.get_origin(base) in (typing.Union, __import__("types").UnionType):
            args = [a for a in typing.get_args(base) if a is not type(None)]
            base = args[0]
            rng, base = rng or range_of(base), strip(base)
        if typing.get_origin(base) in (tuple, list) and typing.get_args(base):
            item = typing.get_args(base)[0]
            if strip(item) in (int, float):
                out.append((key, list, range_of(item), default))
            continue
        if base in (int, float):
            out.append((key, base, rng, default))
    return out


def _targets():
    """(table, fixed keys, constructor): every table of the schema."""
    out = [(name, {}, t.cls) for name, t in TABLES.items()]
    out += [("algorithm", {"name": n}, c) for n, c in sorted(ALGORITHMS.items())]
    out += [("data", {"name": n}, f) for n, f in sorted(DATASETS.items())]
    out += [("model", {"name": n}, f) for n, f in sorted(MODELS.items())]
    return out


def _outside(kind, rng: Range | None) -> list:
    """Values every key of this kind and range must refuse."""
    vals: list = ["x", True]
    if kind is float:
        vals += [float("nan"), float("inf"), float("-inf"), 1e-320, 1e300]
    if kind is list:
        vals += [["x"], 5]
    if rng is not None and kind is not list:
        if rng.lo is not None:
            vals.append(rng.lo if rng.lo_open else (rng.lo - 1 if kind is int else rng.lo - max(1.0, abs(rng.lo))))
        if rng.hi is not None:
            vals.append(rng.hi if rng.hi_open else (rng.hi + 1 if kind is int else rng.hi + max(1.0, abs(rng.hi))))
    if kind is list and rng is not None and rng.lo is not None:
        vals.append([rng.lo if rng.lo_open else rng.lo - 1])
    return vals


def _inside(kind, rng: Range | None, default) -> list:
    """Values at the cheap end of the range (the upper end of a count can be a run of 10^7 rounds: only its
    refusal beyond is fuzzed) and the default."""
    vals = [default] if kind is not list else []
    if rng is not None and rng.lo is not None:
        lo = rng.lo
        if rng.lo_open:
            lo = lo + 1 if isinstance(lo, int) and not rng.hi_open else (
                lo + MIN_MAGNITUDE if lo == 0 else lo + 1e-6 * max(1.0, abs(lo)))
        vals.append([lo] if kind is list else kind(lo))
    return [v for i, v in enumerate(vals) if v not in vals[:i] and v is not None]


def schema_cases() -> list[tuple[str, dict, str, object, bool]]:
    """(table, the table's fixed keys, key, value, must be refused) for every numeric key of the schema."""
    cases = []
    for table, fixed, target in _targets():
        for key, kind, rng, default in _numeric_keys(target):
            for v in _outside(kind, rng):
                cases.append((table, fixed, key, v, True))
            for v in _inside(kind, rng, default):
                cases.append((table, fixed, key, v, False))
    return cases


def test_every_numeric_key_declares_its_range():
    """The schema is complete: a built-in key without a declared range is never fuzzed, so none may exist."""
    missing = [f"{table}{'.' + fixed['name'] if fixed else ''}.{key}" for table, fixed, target in _targets()
               for key, _, rng, _ in _numeric_keys(target) if rng is None and key != "strength"]
    assert not missing, missing


def _case_config(table: str, fixed: dict, key: str, value) -> dict:
    raw = tomllib.loads(BASE)
    raw["run"]["rounds"] = 1
    raw["run"]["checkpoint_every"] = 0
    if table == "algorithm" and fixed:
        raw["algorithm"] = dict(fixed)
        name = fixed["name"]
        if name in BODY_HEAD:
            raw["model"] = {"name": "mlp", "hidden": [4]}
        elif name == "fedbn":
            raw["model"] = {"name": "mlp", "hidden": [4], "batch_norm": True}
        elif name == "mocha":
            raw["model"] = {"name": "linear", "bias": False}
    elif table in ("data", "model") and fixed:
        base = raw[table]["name"]
        if fixed["name"] != base:  # another dataset or model: its own keys alone
            raw[table] = dict(fixed)
    raw.setdefault(table, {})[key] = value
    return raw


def _run_case(tmp_path, capsys, i: int, raw: dict, what: str) -> tuple[int, str]:
    """``fedmtl run`` on ``raw`` under a 60 s alarm: exit 0 with a sane result, or exit 2 with one line naming the
    config file; never a traceback or a hang.  Returns (exit code, stderr)."""
    cfg = tmp_path / f"s{i}.toml"
    cfg.write_text(_toml(raw))
    signal.alarm(60)
    try:
        code = main(["run", str(cfg), "--out", str(tmp_path / f"so{i}"), "-q"])
    except _Timeout:
        pytest.fail(f"{what} ran past 60 s")
    except BaseException as e:  # a traceback: a bug
        pytest.fail(f"{what} raised {type(e).__name__}: {e}")
    finally:
        signal.alarm(0)
    err = capsys.readouterr().err.strip()
    if code == 0:  # a sane result: finite accuracy, some usable update
        s = json.loads((tmp_path / f"so{i}" / "summary.json").read_text())
        acc = s["final"].get("seen_test_acc_mean")
        acc = acc["mean"] if isinstance(acc, dict) else acc  # run.seeds: the statistics over seeds
        assert acc is not None and math.isfinite(acc), (what, s["final"])
        if "excluded_updates" in s:
            assert s["excluded_updates"] < s["rounds"] * 6, (what, s["excluded_updates"])
    else:
        assert code == 2, (what, code, err)
        assert len(err.splitlines()) == 1 and str(cfg) in err, (what, err)
    return code, err


@pytest.mark.slow
def test_schema_fuzz_refuses_every_value_outside_a_declared_range(tmp_path, capsys):
    """Every numeric key, beyond each end of its range, NaN, +-Inf, 1e-320, 1e300, a string and a bool: one line
    naming the file and the key, exit 2, before any work (a case is one config through ``fedmtl run``)."""
    cases = [c for c in schema_cases() if c[4]]
    assert len(cases) >= 400, len(cases)
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i, (table, fixed, key, value, _) in enumerate(cases):
            what = f"[{table}]{' ' + fixed['name'] if fixed else ''} {key} = {value!r}"
            code, err = _run_case(tmp_path, capsys, i, _case_config(table, fixed, key, value), what)
            assert code == 2, f"{what} was accepted"
            assert key in err, (what, err)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _run_key(cfg) -> str:
    """Everything ``fedmtl run`` builds a validated config's run from, as one string: every fixed table's dataclass
    (all its fields, defaults included) and the ``[data]``, ``[model]`` and ``[algorithm]`` tables with their
    builder's defaults filled in (the builder is called with the given keys alone: a key left out and the same key
    given at its default build the same object).  Two configs with the same key are the same run; their recorded
    configs (``cfg.raw``) may still differ by naming keys at their defaults, which changes what the run directory
    records, not the run."""

    def filled(target, given: dict) -> dict:
        if dataclasses.is_dataclass(target):
            defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                        for f in dataclasses.fields(target) if f.init and (
                            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}
        else:
            defaults = {n: p.default for n, p in inspect.signature(target).parameters.items()
                        if p.default is not p.empty and n not in SKIP_PARAMS}
        return {**defaults, **given}

    return json.dumps({"data": filled(DATASETS[cfg.data["name"]], cfg.data),
                       "model": filled(MODELS[cfg.model["name"]], cfg.model),
                       "algorithm": filled(ALGORITHMS[cfg.algorithm["name"]], cfg.algorithm),
                       "tables": {name: dataclasses.asdict(t) for name, t in cfg.tables.items()}},
                      sort_keys=True, default=repr)


@pytest.mark.slow
def test_schema_fuzz_runs_the_cheap_end_and_default_of_every_range(tmp_path, capsys):
    """Every numeric key at the low end of its range and at its default (on the fuzz config; other datasets' keys
    need their data and are only refused beyond their ranges): a sane result or a clean one-line refusal.  Every
    case's config is validated as ``fedmtl run`` validates it; a case whose validated config (``_run_key``) is that
    of a case already run (a key at its default, a value that is the fuzz config's own) is the same run: it has
    that run's exit code, and ``fedmtl run`` runs once per distinct config (a config refused by validation runs
    each time: its one-line refusal names its own file)."""
    cases = [c for c in schema_cases() if not c[4] and not (c[0] == "data" and c[1].get("name") != "fedem_synthetic")
             and not (c[0] == "model" and c[1].get("name") not in ("linear", "mlp"))]
    assert len(cases) >= 150, len(cases)
    previous = signal.signal(signal.SIGALRM, _alarm)
    ran = 0
    codes: dict[str, int] = {}  # exit code by _run_key of the configs run
    try:
        for i, (table, fixed, key, value, _) in enumerate(cases):
            what = f"[{table}]{' ' + fixed['name'] if fixed else ''} {key} = {value!r}"
            raw = _case_config(table, fixed, key, value)
            cfg = tmp_path / f"s{i}.toml"
            cfg.write_text(_toml(raw))
            try:
                validated = load(cfg)
            except Exception:  # refused before any work (ConfigError): fedmtl run must say so in one line naming
                same = None  # this file (anything else: fedmtl run shows what it does with it)
            else:
                same = _run_key(validated)
            if same is None or same not in codes:
                code, _ = _run_case(tmp_path, capsys, i, raw, what)
                if same is not None:
                    codes[same] = code
            else:
                code = codes[same]
            ran += code == 0
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ran >= 0.8 * len(cases), (ran, len(cases))  # the ranges' own values are settings that run
