"""Command-line fuzzing, generated rather than written: every ``--set TABLE.KEY=VALUE`` of the config schema (the fixed
tables, the fuzz config's algorithm, dataset, model and ``[model.adapters]``) with values of the wrong type, beyond its
range, NaN/Inf, 1e400, a 20,000-character string, a 5,000-item list and a 40-deep nesting; and every option and
positional argument of every sub-command, enumerated from ``fedmtl.cli.build_parser()`` (a new option is fuzzed
without anyone writing a case), with generic bad values plus the known hard ones of ``--seeds``, ``--device``,
``--clients`` and ``--interval``.  A ``--set`` refusal is checked on ``config.load`` (what the command line prints);
every other case is ``cli.main(argv)`` in this process, in its own folder, under a deadline and a memory bound
(``fuzz_harness``): a one-line refusal naming the file or option (exit 2), or a sane result.  Heavy work a value
could start (a Flower simulation, a sweep's runs, a reproduction, the main job, a worker) is replaced by a stand-in
that fails the case when nonsense reaches it."""

from __future__ import annotations

import argparse
import json
import math
import re
import typing
from pathlib import Path

import pytest

from fedmtl.cli import build_parser
from fedmtl.config import TABLES, _signature_types
from fedmtl.models.lora import AdapterConfig
from fedmtl.registry import ALGORITHMS, DATASETS, MODELS
from fedmtl.schema import choices_of, range_of, strip

from .fuzz_harness import TINY, Accepted, check_line, expect_error, expect_refused, make_fifo, make_huge, run_cli

HUGE_STR = "x" * 20_000
HUGE_LIST = "[" + ",".join(["1"] * 5_000) + "]"
DEEP = "[" * 40 + "]" * 40

# ------------------------------------------------------------------------------------------------ --set values
SKIP = ("input_shape", "num_classes", "meta")



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Every case runs in its own folder: a relative path a case gives (--out 0, --results nan) lands there."""
    monkeypatch.chdir(tmp_path)

def _keys() -> list[tuple[str, str, object]]:
    """(table, key, annotation) of every key ``--set`` can reach on the TINY config."""
    out = []
    for table, t in TABLES.items():
        out += [(table, k, tp) for k, tp in _signature_types(t.cls).items()]
    for table, target in (("algorithm", ALGORITHMS["fedem"]), ("data", DATASETS["fedem_synthetic"]),
                          ("model", MODELS["linear"])):
        out += [(table, k, tp) for k, tp in _signature_types(target).items() if k not in SKIP]
    out += [("model", f"adapters.{k}", tp) for k, tp in _signature_types(AdapterConfig).items()]
    return [*out, ("model", "weights", str)]


def _outside(kind: type, rng: object) -> list[str]:
    vals = []
    if rng is None:
        return vals
    lo, hi = rng.lo, rng.hi  # type: ignore[attr-defined]
    if lo is not None:
        vals.append(repr(lo if rng.lo_open else (lo - 1 if kind is int else lo - max(1.0, abs(lo)))))  # type: ignore
    if hi is not None:
        vals.append(repr(hi if rng.hi_open else (hi + 1 if kind is int else hi + max(1.0, abs(hi)))))  # type: ignore
    return [v.replace("inf", "1e400") for v in vals]


def set_values(tp: object) -> list[tuple[str, bool]]:
    """(--set value text, must be refused) for a key of annotation ``tp``."""
    rng, base = range_of(tp), strip(tp)
    if typing.get_origin(base) in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(base) if a is not type(None)]
        rng, base = rng or range_of(args[0]), strip(args[0])
    origin = typing.get_origin(base)
    common = [(HUGE_LIST, True), (DEEP, True)]
    if choices_of(tp) is not None:  # Literal[...] or a registry's names
        return [('"bogus"', True), ("1", True), (HUGE_STR, True), ("[1]", True), ("nan", True), *common]
    if base in (int, float):
        vals = [("nan", True), ("inf", True), ("-inf", True), ("1e400", True), ('"7"', True), ("true", True),
                (HUGE_STR, True), *common] + [(v, True) for v in _outside(base, rng)]
        if base is int:
            vals += [("1.5", True), ("9" * 40, True)]
        return vals
    if origin in (tuple, list):
        item = typing.get_args(base)[0] if typing.get_args(base) else object
        vals = [("5", True), ("[[1]]", True), (HUGE_STR, True), (DEEP, True)]
        if strip(item) in (int, float):
            vals += [('["x"]', True), ("[nan]", True), ("[1e400]", True), ("[" + ",".join(["1e400"] * 1000) + "]",
                                                                          True)]
            vals += [(f"[{v}]", True) for v in _outside(strip(item), range_of(item))]
        else:
            vals += [("[1]", True), ('["' + "y" * 20_000 + '"]', False)]
        return vals
    if base is bool:
        return [("2", True), ('"yes"', True), ("nan", True), (HUGE_STR, True), ("[true]", True), *common]
    if origin is typing.Literal:
        return [('"bogus"', True), ("1", True), (HUGE_STR, True), ("[1]", True), ("nan", True), *common]
    if base is str:
        return [("1", True), ("[1]", True), ("true", True), ("nan", True), (HUGE_STR, False), *common]
    return []


def set_cases() -> list:
    cases = []
    for table, key, tp in _keys():
        for value, refuse in set_values(tp):
            short = value if len(value) <= 24 else f"{value[:12]}...({len(value)})"
            cases.append(pytest.param(table, key, value, refuse, id=f"{table}.{key}={short}",
                                      marks=[] if refuse else [pytest.mark.slow]))  # accepted: a run
    return cases


def _sane_run(out: Path, what: str) -> None:
    """A run that was accepted: its summary holds a finite accuracy."""
    s = json.loads((out / "summary.json").read_text())
    acc = s["final"].get("seen_test_acc_mean")
    acc = acc["mean"] if isinstance(acc, dict) else acc
    assert acc is not None and math.isfinite(acc) and 0 <= acc <= 1, (what, s["final"])


@pytest.fixture()
def cfg(tmp_path: Path) -> Path:
    f = tmp_path / "tiny.toml"
    f.write_text(TINY)
    return f


@pytest.fixture(scope="module")
def shared_cfg(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("set") / "tiny.toml"
    f.write_text(TINY)
    return f


@pytest.mark.parametrize("table,key,value,refuse", set_cases())
def test_set_value(shared_cfg, tmp_path, capsys, table, key, value, refuse):
    """``--set table.key=VALUE`` on ``fedmtl run CONFIG``: nonsense is one line naming the file (or the --set) and
    the key, when the config is read (``config.load``, what the command line reports with exit 2); a value it
    accepts runs to a sane result."""
    from fedmtl.config import ConfigError, load

    setting = f"{table}.{key}={value}"
    leaf = key.rpartition(".")[2]
    if refuse:  # named: the key, and the file (or the --set it came from)
        line = expect_error(lambda: load(shared_cfg, [setting]), leaf, what=f"--set {setting[:80]}", seconds=10,
                            errors=(ConfigError,))
        assert str(shared_cfg) in line or f"--set {table}.{key}" in line, line[:300]
        return
    argv = ["run", str(shared_cfg), "--set", setting, "--out", str(tmp_path / "o"), "-q"]
    code, _, err = run_cli(argv, capsys)
    if code == 0:
        _sane_run(tmp_path / "o", setting[:80])
    else:
        assert code == 2, (setting[:80], code, err[:300])
        check_line(err, (str(shared_cfg), leaf), setting[:80])


def test_set_cases_cover_the_schema():
    """Every key --set can reach is fuzzed (a key of a type the generator does not know would be skipped)."""
    missing = [f"{t}.{k}" for t, k, tp in _keys() if not set_values(tp)]
    assert not missing, missing
    assert len(set_cases()) >= 500


# ------------------------------------------------------------------------------------------------ options
GENERIC = ["", "-1", "0", "nan", "inf", "-inf", "1e400", "1e-320", "9" * 20, "x" * 10_000, "9-999999999"]
NUMERIC = {"-1", "nan", "inf", "-inf", "1e400", "9" * 20, "x" * 10_000, "9-999999999", ""}  # nonsense for numbers
#: the known hard values of particular options (dest -> [(value, must be refused)])
SPECIAL: dict[str, list[tuple[str, bool]]] = {
    "seeds": [("1-999999999", True), ("0-" + "9" * 20, True), ("5-1", True), ("1,,2", False), ("-", True),
              ("1-2-3", True), ("x", True), ("1e3", True), (",".join(["1"] * 3), False), ("-5", True),
              (",".join(str(i) for i in range(20_000)), True)],
    "device": [("cuda:-1", True), ("cuda:1e3", True), ("cuda:" + "9" * 20, True), ("cuda:x", True), ("tpu", True),
               ("cuda:", True), ("CPU", True), ("cuda:0 ", True)],
    "clients": [("0-999999999", True), ("9-" + "9" * 20, True), ("3-1", True), ("a-b", True), ("0-1", False),
                ("-1", True), ("0,0,1", False), ("1e3", True)],
    "interval": [("1e-320", True), ("1e9", True), ("0.001", False)],
    "nodes": [("1000000", True)],
    "cpus": [("1000000", True)],
    "cpus_per_node": [("0", True), ("1e9", True)],
    "gpus_per_node": [("-0.5", True), ("1e9", True)],
    "dist_timeout": [("0.5", True), ("1e9", True)],
    "imports": [("no_such_module_xyz", True), ("/nonexistent/plugin.py", True), ("os.path.nope", True)],
}
#: options whose values are numbers (whatever argparse's type): every value of NUMERIC is nonsense for them
NUMBER_DESTS = {"interval", "nodes", "cpus", "cpus_per_node", "gpus_per_node", "dist_timeout", "seeds"}
#: options only one sub-command's action reads; the base command they are fuzzed in
FLOWER_ONLY = {"socket": "worker", "cpus": "simulate", "cpus_per_node": "simulate", "gpus_per_node": "simulate",
               "ray_address": "simulate"}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def options() -> list[tuple[str, argparse.Action]]:
    """(sub-command, action) of every option taking a value and every positional, from the parser itself."""
    out = []
    for name, sp in _subparsers(build_parser()).items():
        if name == "bench":
            continue  # its sub-commands are the benchmarks, each with its own flags (see test_fuzz_bench_names)
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction) or a.nargs == 0:
                continue
            out.append((name, a))
    return out


def option_values(cmd: str, a: argparse.Action) -> list[tuple[str, bool]]:
    numeric = a.dest in NUMBER_DESTS or a.type in (int, float)
    vals = [(v, numeric and v in NUMERIC) for v in GENERIC]
    if a.choices is not None:
        vals = [(v, v not in a.choices) for v in GENERIC[:3] + ["x" * 10_000]]
    vals += SPECIAL.get(a.dest, [])
    if a.dest == "device":  # a device that is not there is refused too, naming it
        vals = [(v, True) for v, _ in vals]
    return vals


def option_cases() -> list:
    cases = []
    for cmd, a in options():
        flag = a.option_strings[-1] if a.option_strings else a.dest
        for value, refuse in option_values(cmd, a):
            short = value if len(value) <= 24 else f"{value[:12]}...({len(value)})"
            runs = not refuse and cmd in ("run", "data", "compare")  # an accepted value runs the command
            cases.append(pytest.param(cmd, a.dest, flag, value, refuse, id=f"{cmd} {flag} {short!r}",
                                      marks=[pytest.mark.slow] if runs else []))
    return cases


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run directory (compare, watch)."""
    from fedmtl.cli import main

    d = tmp_path_factory.mktemp("finished")
    (d / "tiny.toml").write_text(TINY)
    assert main(["run", str(d / "tiny.toml"), "--out", str(d / "run"), "-q"]) == 0
    return d / "run"


@pytest.fixture()
def heavy_replaced(monkeypatch):
    """Stand-ins for the work a command starts once its input is accepted."""
    import fedmtl.experiments as ex
    import fedmtl.flower.simulation as sim
    import fedmtl.flower.worker as worker

    def simulate(*a, **k):
        raise Accepted("the Flower simulation")

    def serve(self, *a, **k):
        raise Accepted("the worker's socket")

    def reproduction(name):
        def go(*a, **k):
            raise Accepted(f"reproduction {name}")
        return go

    def main_job(*a, **k):
        raise Accepted("the main job")

    def runs(*a, **k):
        raise Accepted("the runs (a sweep's, or several seeds')")

    import fedmtl.runs.seeds as seeds
    import fedmtl.runs.sweep as sweep

    monkeypatch.setattr(sweep, "run_experiment", runs)  # a sweep's configs are all read and checked first
    monkeypatch.setattr(seeds, "run_seeds", runs)
    monkeypatch.setattr(sim, "simulate", simulate)
    monkeypatch.setattr(worker.Worker, "serve", serve)
    monkeypatch.setattr(ex, "reproduction", reproduction)
    import fedmtl.experiments.fedem as fe

    monkeypatch.setattr(fe, "main_job", main_job)


def _argv(cmd: str, dest: str, flag: str, value: str, cfg: Path, out: Path, run: Path) -> list[str]:
    """The cheapest command line of ``cmd`` that reads ``flag`` (a positional when ``flag`` is its dest)."""
    opt = [flag, value] if flag.startswith("-") else []
    pos = {"config": str(cfg), "what": str(cfg), "runs": str(run), "run_dir": str(run), "name": "fedem_synthetic",
           "action": "simulate"}
    if not opt:
        pos[dest] = value
    if cmd == "run":
        return ["run", pos["config"], *(["--out", str(out)] if dest != "out" else []), "-q", *opt]
    if cmd == "sweep":
        return ["sweep", pos["config"], "--set", "optim.lr=0.1,0.05", *(["--out", str(out)] if dest != "out" else []),
                "-q", *opt]
    if cmd == "tune":  # a one-key space beside the config; the trial's runs are a stand-in (heavy_replaced)
        space = cfg.parent / "space.toml"
        space.write_text("[optim]\nlr = { low = 0.01, high = 1.0, log = true }\n")
        fixed = {"--space": str(space), "--trials": "1", "--out": str(out)}
        return ["tune", pos["config"], *[x for k, v in fixed.items() if k != flag for x in (k, v)], "-q", *opt]
    if cmd == "data":
        if dest in ("out", "clients"):
            return ["data", "export", str(cfg), *(["--out", str(out)] if dest != "out" else []), *opt]
        return ["data", pos["what"], *opt]
    if cmd == "compare":
        return ["compare", pos["runs"], *(["--out", str(out)] if dest != "out" else []), *opt]
    if cmd == "watch":  # a missing directory is waited for 60 s unless --once
        return ["watch", pos["run_dir"], *opt, *(["--once"] if dest == "run_dir" else [])]
    if cmd == "list":
        return ["list", *opt]
    if cmd == "tables":
        return ["tables", "--check", *opt]
    if cmd == "main":
        return ["main", "--quick", *(["--out", str(out)] if dest != "out" else []), *opt]
    if cmd == "reproduce":  # the options of one reproduction fuzzed on it (the others refuse them by name)
        name = "tuned" if dest in ("trials", "methods", "federations", "device") else pos["name"]
        return ["reproduce", name, "--quick", *(["--out", str(out)] if dest != "out" else []), *opt]
    if cmd == "flower":
        action = FLOWER_ONLY.get(dest, pos["action"] if dest == "action" else "simulate")
        if dest == "action":
            return ["flower", value, str(cfg)]
        if action == "worker":
            return ["flower", "worker", *opt]
        return ["flower", action, pos["config"], *opt]
    raise AssertionError(cmd)


@pytest.mark.parametrize("cmd,dest,flag,value,refuse", option_cases())
def test_option_value(cfg, tmp_path, capsys, heavy_replaced, finished_run, cmd, dest, flag, value, refuse):
    """Every option and positional of every sub-command: nonsense is refused in one line naming the option or the
    file (exit 2); anything accepted ends cleanly."""
    argv = _argv(cmd, dest, flag, value, cfg, tmp_path / "out", finished_run)
    what = f"fedmtl {cmd} {flag} {value[:40]!r}"
    if refuse:  # named: the option (its flag, or the config key it sets), or the value of a positional
        line = expect_refused(argv, capsys)
        if flag.startswith("-"):
            assert any(n in line for n in (flag, dest, dest.replace("_", "-"))), (what, line[:300])
        elif value.strip():
            assert value[:30] in line, (what, line[:300])
        return
    try:
        code, out, err = run_cli(argv, capsys)
    except Accepted:
        return  # a plausible value reached the work it starts
    assert code in (0, 1, 2), (what, code, err[:300])
    if code == 2:
        check_line(err, (), what)
    elif cmd == "watch":  # a sane line: no nan or inf, a finite round
        assert not re.search(r"\b(nan|inf)\b", out.lower()), (what, out)


def test_every_option_is_fuzzed():
    """Each value-taking option and positional of every sub-command has cases, so a new one is fuzzed too."""
    cases = option_cases()
    seen = {(c.values[0], c.values[1]) for c in cases}
    assert {(cmd, a.dest) for cmd, a in options()} <= seen
    assert len(cases) >= 150, len(cases)


# ------------------------------------------------------------------------------------------------ files as arguments
def _file_kinds(tmp: Path) -> dict[str, Path]:
    (tmp / "dir").mkdir()
    (tmp / "garbage.toml").write_bytes(b"\x00\xff\xfe garbage \x80" * 50)
    (tmp / "empty.toml").write_text("")
    return {"fifo": make_fifo(tmp / "fifo.toml"), "directory": tmp / "dir", "huge": make_huge(tmp / "huge.toml"),
            "devzero": Path("/dev/zero"), "binary": tmp / "garbage.toml", "empty": tmp / "empty.toml",
            "missing": tmp / "nope.toml"}


FILE_KINDS = ["fifo", "directory", "huge", "devzero", "binary", "empty", "missing"]


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("cmd", ["run", "sweep", "data", "data export", "flower simulate", "flower app"])
def test_config_argument_of_every_kind(tmp_path, capsys, heavy_replaced, cmd, kind):
    """A FIFO, a directory, a 1 TB sparse file, /dev/zero, binary garbage, an empty or missing file given as the
    CONFIG: one line naming it (exit 2), at once."""
    f = _file_kinds(tmp_path)[kind]
    argv = [*cmd.split(), str(f), "--out", str(tmp_path / "o"), *(["--set", "optim.lr=0.1,0.2"] if cmd == "sweep"
                                                                    else [])]
    expect_refused(argv, capsys, str(f), fifo_roots=[tmp_path], seconds=10)


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("cmd", ["compare", "watch", "run --resume --out"])
def test_run_directory_argument_of_every_kind(tmp_path, capsys, cmd, kind):
    """A run directory that is a FIFO, a file, /dev/zero or missing: one line naming it (exit 2), never a hang."""
    f = _file_kinds(tmp_path)[kind]
    argv = {"compare": ["compare", str(f), "--out", str(tmp_path / "o")], "watch": ["watch", str(f), "--once"],
            "run --resume --out": ["run", "--resume", "--out", str(f), "-q"]}[cmd]
    expect_refused(argv, capsys, str(f), fifo_roots=[tmp_path], seconds=10)
