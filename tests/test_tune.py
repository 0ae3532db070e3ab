"""``fedmtl tune``: an Optuna study over a TOML space, on a validation split, resumable after kill -9."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("optuna")

import fedmtl  # noqa: E402
from fedmtl.cli import EXIT_INPUT, main  # noqa: E402
from fedmtl.runs.tune import Param, TuneSummary, edge_notes, read_space, tune  # noqa: E402

from .conftest import built_once  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TINY = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 8
n_test = 20
min_samples = 30
max_samples = 60

[model]
name = "linear"

[algorithm]
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = 3
batch_size = 16
eval_every = 1
checkpoint_every = 0
seeds = [1, 2]
"""

SPACE = """
[optim]
lr = { low = 0.001, high = 1.0, log = true }
momentum = { low = 0.0, high = 0.9 }
"""


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """``tiny.toml`` and ``space.toml``, written once per test run (``built_once``): shared, no test writes there."""

    def write(d: Path) -> str:
        (d / "tiny.toml").write_text(TINY)
        (d / "space.toml").write_text(SPACE)
        return str(d)

    return Path(built_once(tmp_path_factory, "tune-files", write))


@pytest.fixture(scope="session")
def study(tmp_path_factory, files):
    """The uninterrupted reference study: 6 trials, TPE seed 3.  Built once per test run (``built_once``): its
    folder is shared, no test writes there."""

    def whole(d: Path) -> dict[str, Any]:
        res = tune(files / "tiny.toml", files / "space.toml", trials=6, seed=3, out=d / "whole")
        return {**dataclasses.asdict(res), "out": str(res.out)}

    got = built_once(tmp_path_factory, "tune-study", whole)
    return TuneSummary(**{**got, "out": Path(got["out"])}), Path(got["out"])


def _optuna_study(out: Path):
    import optuna

    storage = f"sqlite:///{out / 'study.db'}"
    return optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)


@pytest.mark.slow
def test_resume_after_kill_9_gives_the_uninterrupted_study(files, study, tmp_path):
    """The done-when check: kill -9 the command mid-study, --resume: the same best trial as the uninterrupted
    study with the same sampler seed, the interrupted trial re-run with its values and never counted twice."""
    whole, _ = study
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fedmtl", "tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"),
           "--trials", "6", "--seed", "3", "--out", str(out), "-q"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "trials" / "0002").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    resumed = tune(files / "tiny.toml", files / "space.toml", trials=6, seed=3, out=out, resume=True)
    assert resumed.interrupted == 1
    assert resumed.complete + resumed.pruned + resumed.failed == 6 == whole.complete + whole.pruned + whole.failed
    assert resumed.best_params == whole.best_params and resumed.best_value == whole.best_value
    rows = {r["number"]: r for r in resumed.trials}
    stale = next(r for r in resumed.trials if r["reason"].startswith("interrupted"))
    assert rows[stale["number"] + 1]["params"] == stale["params"]  # re-run with the same values
    # the counted trials are the uninterrupted study's trials, in order
    counted = [r for r in resumed.trials if r is not stale]
    assert [(r["params"], r["state"], r["value"]) for r in counted] == \
        [(r["params"], r["state"], r["value"]) for r in whole.trials]
    with pytest.raises(ValueError, match="study.db: a study is there already"):  # without --resume: refused
        tune(files / "tiny.toml", files / "space.toml", trials=6, seed=3, out=out)


def test_a_study_stopped_in_its_last_trial_runs_it_again_on_resume(files, study, tmp_path, monkeypatch):
    """Ctrl-C in a one-trial study's only trial (as in every edge probe): --resume runs its values again and the
    study ends with that trial complete, the value the uninterrupted study's first trial got.  (The re-run waiting
    to be asked for was once counted as a trial: the resumed study stopped at once with no trial.)"""
    import fedmtl.runs.seeds as seeds

    whole, _ = study
    run_seeds, calls = seeds.run_seeds, []

    def stopped_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return run_seeds(*a, **k)

    monkeypatch.setattr(seeds, "run_seeds", stopped_once)
    out = tmp_path / "one"
    with pytest.raises(KeyboardInterrupt):
        tune(files / "tiny.toml", files / "space.toml", trials=1, seed=3, out=out)
    resumed = tune(files / "tiny.toml", files / "space.toml", trials=1, seed=3, out=out, resume=True)
    assert (resumed.complete + resumed.pruned, resumed.interrupted, len(calls)) == (1, 1, 2)
    assert resumed.best_params == whole.trials[0]["params"] and resumed.best_value == whole.trials[0]["value"]


def test_a_best_value_at_an_end_of_its_range_is_named():
    """Within 5% of the range's width of an end, in the range's own scale (log: 0.005 to 0.5 is two decades, so
    0.0063 is 5% of the way up), an integer at a bound, the lowest or highest numeric choice; never unordered
    choices."""
    lr = Param("optim.lr", 0.005, 0.5, log=True)
    assert [lr.edge(v) for v in (0.005, 0.006, 0.0064, 0.05, 0.39, 0.4, 0.5)] == \
        ["low", "low", None, None, None, "high", "high"]
    lin = Param("optim.momentum", 0.0, 0.9)
    assert [lin.edge(v) for v in (0.0, 0.045, 0.05, 0.85, 0.86)] == ["low", "low", None, None, "high"]
    short = Param("algorithm.finetune_epochs", 1, 10, is_int=True)
    assert [short.edge(v) for v in (1, 2, 9, 10)] == ["low", None, None, "high"]
    long = Param("algorithm.head_epochs", 0, 100, is_int=True)
    assert [long.edge(v) for v in (5, 6, 94, 95)] == ["low", None, None, "high"]
    mu = Param("algorithm.mu", choices=(0.001, 0.01, 0.1, 1.0))
    assert [mu.edge(v) for v in (0.001, 0.01, 0.1, 1.0)] == ["low", None, None, "high"]
    assert Param("model.name", choices=("mlp", "cnn")).edge("mlp") is None
    assert Param("run.pin", choices=(True, False)).edge(True) is None
    assert edge_notes([lr, mu, lin], {"optim.lr": 0.45, "algorithm.mu": 0.01}) == {"optim.lr": "high"}


@pytest.mark.slow  # runs a study
def test_reports_every_evaluated_round_and_prunes_the_worse(study, files):
    whole, out = study
    import optuna

    trials = _optuna_study(out).get_trials()
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert done and pruned
    for t in done:  # one report per evaluated round (eval_every = 1, 3 rounds); the objective their last-3 mean
        assert sorted(t.intermediate_values) == [1, 2, 3]
        assert t.value == pytest.approx(np.mean(list(t.intermediate_values.values())), abs=1e-12)
    for t in pruned:  # stopped at a round where it fell below the median of the completed trials
        step = max(t.intermediate_values)
        assert step < 3
        earlier = [d for d in done if d.number < t.number]
        assert t.intermediate_values[step] < np.median([d.intermediate_values[step] for d in earlier])
    meta = json.loads((out / "tune.json").read_text())
    assert meta["n_trials"] == {"complete": len(done), "pruned": len(pruned), "failed": 0, "interrupted": 0}
    assert meta["best_params"] == whole.best_params and meta["sampler"] == {"name": "TPESampler", "seed": 3}
    assert meta["best_at_edge"] == whole.at_edge == edge_notes(read_space(files / "space.toml"), whole.best_params)
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [int(r["number"]) for r in rows] == list(range(6)) and "optim.lr" in rows[0]
    assert (out / "history.png").exists() and (out / "importance.pdf").exists()


def test_objective_on_validation_only(study, files):
    """No trial reads the test split: the runs record validation metrics and no test metric."""
    _, out = study
    header = (out / "trials" / "0000" / "seed-1" / "metrics.csv").read_text().splitlines()[0]
    assert "seen_val_acc_mean" in header and "test" not in header and "unseen" not in header


@pytest.mark.slow  # runs a study
def test_test_split_poisoned_objective_unchanged(tmp_path):
    """The same study over data whose test labels are all flipped gives the same objective values."""

    @fedmtl.register_dataset("tune_poison", replace=True)
    def poison(flip: bool = False):
        rng = np.random.default_rng(0)
        w = rng.normal(size=(5, 2))

        def client(n):
            x = rng.normal(size=(n, 5))
            return x, np.argmax(x @ w, 1)

        train = [client(30) for _ in range(4)]
        test = [client(10) for _ in range(4)]
        if flip:
            test = [(x, 1 - y) for x, y in test]
        return fedmtl.FederatedData.from_arrays(train, test, num_classes=2)

    cfg = {"data": {"name": "tune_poison"}, "model": {"name": "linear"}, "algorithm": {"name": "fedavg"},
           "run": {"rounds": 2, "eval_every": 1, "batch_size": 8, "checkpoint_every": 0}}
    space = tmp_path / "s.toml"
    space.write_text("[optim]\nlr = { low = 0.01, high = 1.0, log = true }\n")
    a = tune(cfg, space, trials=2, seed=1, out=tmp_path / "a")
    b = tune({**cfg, "data": {"name": "tune_poison", "flip": True}}, space, trials=2, seed=1, out=tmp_path / "b")
    assert [r["value"] for r in a.trials] == [r["value"] for r in b.trials]
    assert all(r["value"] is not None for r in a.trials)


def test_best_toml_runs(study, tmp_path):
    whole, out = study
    best = (out / "best.toml").read_text()
    assert "val_fraction" not in best  # the tuning split is the search's own: the final run trains on all
    run = fedmtl.run(out / "best.toml", out=None, run__rounds=1, run__seeds=[1])
    assert "seen_test_acc_mean" in run.final


def _refused(capsys, args, *needles):
    capsys.readouterr()
    assert main(args) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("entry, what", [
    ("[optim]\nlrr = { low = 0.1, high = 1.0 }", "unknown key"),
    ("[optim]\nlr = { low = 1.0, high = 0.5 }", "empty range"),
    ("[optim]\nlr = { low = 0.0, high = 1.0, log = true }", "log range"),
    ("[optim]\nlr = { low = 0.0, high = 1.0 }", "optim.lr = 0"),  # lr lies in (0, 1000]: 0 is outside
    ("[run]\nsampling_rate = { low = 0.5, high = 2.0 }", "run.sampling_rate = 2"),
    ("[run]\nlocal_epochs = { low = 1.0, high = 4.0 }", "integer"),  # a float range for an int key
    ("[run]\nlocal_epochs = { low = 1, high = 3 }", "integer"),  # the same with integer ends: trials draw floats
    ("[optim]\nlr = 0.5", "expected a range"),
    ("[optim]\nlr = { low = 0.01, high = 0.5, step = 10.0 }", "wider than the range"),  # one value
    ("[optim]\nlr = { low = 0.01, high = 0.5, step = 0.3 }", "high = 0.31"),  # high never drawn
    ("[run]\nlocal_epochs = { low = 1, high = 3, int = true, step = 5 }", "wider than the range"),
    ("[optim]\nlr = { low = 0.01, high = 0.5 }\nmomentum = {}", "optim.momentum = {}: empty"),
    ('[optim]\n"lr=0.5 #" = { choices = [0.01, 0.02] }', "not a config key"),  # it would become --set lr=0.5
])
def test_bad_space_refused_before_anything_runs(files, tmp_path, capsys, entry, what):
    space = tmp_path / "bad.toml"
    space.write_text(entry + "\n")
    out = tmp_path / "out"
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(space), "--out", str(out)], "bad.toml", what)
    assert not out.exists()


@pytest.mark.parametrize("device, what", [("gpu", "run.device must be"), ("cuda", "no CUDA device")])
def test_a_device_refused_before_anything_runs(files, tmp_path, capsys, device, what):
    """``--device``: its name, and that this machine has it, checked before the study exists (not as every trial's
    failure)."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "out"
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--out", str(out),
                      "--device", device], "tiny.toml", what)
    assert not out.exists()


def test_a_searched_device_and_a_key_also_set_are_refused_before_anything_runs(files, tmp_path, capsys):
    """Every device a space searches is checked like ``--device`` (not as its trials' failures, the first of which
    stopped the study); a key both searched and given by ``--set`` is refused (the trial's value replaced the
    ``--set`` one without a word)."""
    out = tmp_path / "out"
    if not torch.cuda.is_available():
        space = tmp_path / "dev.toml"
        space.write_text('[run]\ndevice = { choices = ["cpu", "cuda:7"] }\n')
        _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(space), "--out", str(out)],
                 "dev.toml", "run.device = 'cuda:7'", "no CUDA device")
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--out", str(out),
                      "--set", "optim.lr=0.3"], "--set optim.lr=0.3", "searched by the space")
    assert not out.exists()


def test_another_programs_database_is_refused_and_left_as_it_was(files, tmp_path, capsys):
    """A ``study.db`` that is an SQLite database of another program (tables of its own): refused by name, not given
    Optuna's tables."""
    import sqlite3

    out = tmp_path / "o"
    out.mkdir()
    con = sqlite3.connect(out / "study.db")
    con.execute("CREATE TABLE mydata (x)")
    con.execute("INSERT INTO mydata VALUES (1)")
    con.commit()
    con.close()
    before = (out / "study.db").read_bytes()
    err = _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--out", str(out),
                            "--resume"], "study.db: another program's database (tables mydata)")
    assert not err.startswith("fedmtl: error: ") or "tiny.toml" not in err  # the file at fault is the database
    assert (out / "study.db").read_bytes() == before


@pytest.mark.slow  # runs a study, twice
def test_a_full_disk_under_the_study_is_one_line_and_resume_continues(files, tmp_path, capsys, monkeypatch):
    """The database's write failing as on a full disk (SQLite's "database or disk is full", raised by Optuna as it
    tells a trial): one line naming study.db and --resume, exit 3 (a write the system refused); --resume then runs
    the study to its end, the trial cut short run again and not counted twice."""
    import sqlite3

    import optuna
    import sqlalchemy.exc

    from fedmtl.cli import EXIT_OS

    real = optuna.study.Study.tell
    calls = []

    def tell(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second trial's result
            try:
                full = sqlite3.OperationalError("database or disk is full")
                raise sqlalchemy.exc.OperationalError("INSERT", {}, full)
            except sqlalchemy.exc.OperationalError as e:
                raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from e
        return real(self, *a, **k)

    monkeypatch.setattr(optuna.study.Study, "tell", tell)
    out = tmp_path / "o"
    args = ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--trials", "3", "--out", str(out),
            "-q"]
    capsys.readouterr()
    assert main(args) == EXIT_OS
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out of disk space" in err and "study.db" in err and "--resume" in err, err
    monkeypatch.setattr(optuna.study.Study, "tell", real)
    # the command has ended: its process is gone (the trial it left RUNNING is recovered as after kill -9)
    monkeypatch.setattr("fedmtl.runs.tune.alive", lambda pid: pid != os.getpid())
    s = tune(files / "tiny.toml", files / "space.toml", trials=3, out=out, resume=True)
    assert s.complete + s.pruned + s.failed == 3 and s.interrupted == 1


def test_values_the_engine_refuses_fail_their_trial_and_the_study_goes_on(files, tmp_path):
    """A combination the schema accepts but the engine refuses as it builds the run (Bulyan with f Byzantine clients
    needs 4f + 3 updates a round; the 6 clients give 6): that trial fails with the engine's reason, the others run
    (it stopped the whole study, exit 2, at its first such trial)."""
    space = tmp_path / "s.toml"
    space.write_text("[robust]\nnum_byzantine = { choices = [0, 2] }\n")
    s = tune(files / "tiny.toml", space, trials=4, seed=0, out=tmp_path / "o", sets=['robust.aggregator="bulyan"'])
    assert len(s.trials) == 4
    assert {r["params"]["robust.num_byzantine"] for r in s.trials} == {0, 2}
    for r in s.trials:
        if r["params"]["robust.num_byzantine"] == 2:
            assert r["state"] == "FAIL" and "needs at least 11 updates per round" in r["reason"], r
        else:
            assert r["state"] == "COMPLETE", r


@pytest.mark.slow  # runs a study
def test_other_study_and_existing_folder_refused(study, files, tmp_path, capsys):
    _, out = study
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    other = tmp_path / "other.toml"
    other.write_text("[optim]\nlr = { low = 0.01, high = 0.5, log = true }\n")
    base = ["tune", str(files / "tiny.toml"), "--trials", "6", "--seed", "3", "--out", str(out)]
    _refused(capsys, base + ["--space", str(files / "space.toml")], "study.db", "--resume")
    _refused(capsys, base + ["--space", str(other), "--resume"], "study.db", "fedmtl-tune-")
    _refused(capsys, base + ["--space", str(files / "space.toml"), "--resume", "--seed", "4"], "study.db")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("mine")
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--out",
                      str(tmp_path / "full")], "holds files")
    _refused(capsys, base + ["--space", str(files / "space.toml"), "--resume", "--objective", "seen_test_acc_mean"],
             "validation metric")


@pytest.mark.slow
def test_failing_trial_recorded_and_study_goes_on(files, tmp_path):
    """A combination the config refuses (drop_last needs one local epoch) fails its trial with the reason; the
    other trials run."""
    space = tmp_path / "s.toml"
    space.write_text("[run]\nlocal_epochs = { choices = [1, 2] }\ndrop_last = { choices = [true] }\n")
    s = tune(files / "tiny.toml", space, trials=4, seed=0, out=tmp_path / "o")
    failed = [r for r in s.trials if r["state"] == "FAIL"]
    ok = [r for r in s.trials if r["state"] != "FAIL"]
    assert failed and ok and len(s.trials) == 4
    assert all(r["params"]["run.local_epochs"] == 2 and "drop_last" in r["reason"] for r in failed)
    assert all(r["params"]["run.local_epochs"] == 1 for r in ok)


@pytest.mark.slow  # runs a one-trial study
def test_the_command_names_a_best_value_at_an_end_of_its_range(files, tmp_path, capsys):
    space = tmp_path / "two.toml"
    space.write_text("[optim]\nlr = { choices = [0.05, 0.1] }\n")  # either choice is an end
    out = tmp_path / "o"
    assert main(["tune", str(files / "tiny.toml"), "--space", str(space), "--trials", "1", "--out", str(out),
                 "-q"]) == 0
    meta = json.loads((out / "tune.json").read_text())
    end = "low" if meta["best_params"]["optim.lr"] == 0.05 else "high"
    assert meta["best_at_edge"] == {"optim.lr": end}
    assert f"note: the best optim.lr lies at the {end} end of the range searched" in capsys.readouterr().out
    assert any(f"at the {end} end of its choices [0.05, 0.1]" in n for n in meta["notes"])


def test_bundled_space_reads():
    assert [p.key for p in read_space("fedavg_lr")] == ["optim.lr", "optim.momentum"]


@pytest.mark.slow  # runs a study
def test_batched_trials_match_trials_run_alone(files, tmp_path, capsys, monkeypatch):
    """--batch-trials: trials differing in optim.lr trained together give each the value it gets alone (vmap
    executor, a rate per replica); a space over other keys is refused."""
    from fedmtl.engine.executors import VmapExecutor

    rates = []  # distinct rates in each training call: 3 where the trials' replicas train together, else 0
    train = VmapExecutor.train

    def counted(self, fn, payload, states, batches, lr, payload_rows=False, clients=None):
        rates.append(len(torch.unique(lr)) if payload_rows and isinstance(lr, torch.Tensor) else 0)
        return train(self, fn, payload, states, batches, lr, payload_rows, clients)

    monkeypatch.setattr(VmapExecutor, "train", counted)
    space = tmp_path / "lr.toml"
    space.write_text("[optim]\nlr = { low = 0.001, high = 1.0, log = true }\n")
    sets = ["run.runner=vmap"]
    batched = tune(files / "tiny.toml", space, trials=3, seed=5, out=tmp_path / "b", sets=sets, batch_trials=3)
    # every round was one call over the 3 trials (a batch that falls back to trials alone would compare alike)
    assert rates and set(rates) == {3}, rates
    assert [r["state"] for r in batched.trials] == ["COMPLETE"] * 3
    assert len({r["params"]["optim.lr"] for r in batched.trials}) == 3
    r = batched.trials[1]
    one = tmp_path / "one.toml"
    one.write_text(f"[optim]\nlr = {{ choices = [{r['params']['optim.lr']!r}] }}\n")
    alone = tune(files / "tiny.toml", one, trials=1, seed=0, out=tmp_path / "a", sets=sets)
    assert alone.best_value == pytest.approx(r["value"], abs=1e-9)
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--batch-trials", "2",
                      "--out", str(tmp_path / "c")], "optim.lr only")


MU_SPACE = """
[optim]
lr = { low = 0.01, high = 1.0, log = true }
[algorithm]
mu = { low = 0.001, high = 10.0, log = true }
"""


def _one(tmp_path: Path, name: str, params: dict) -> Path:
    """A space that fixes ``params``: the trial run alone."""
    text = "".join(f"[{k.split('.')[0]}]\n{k.split('.')[1]} = {{ choices = [{v!r}] }}\n" for k, v in params.items())
    (tmp_path / name).write_text(text)
    return tmp_path / name


@pytest.mark.slow  # runs four studies
def test_batched_trials_over_an_algorithm_field_match_trials_run_alone(files, tmp_path, caplog, monkeypatch):
    """--batch-trials over optim.lr and FedProx's mu: each replica carries its own mu (engine.clients.with_fields);
    on the loop executor each trial gets exactly what it gets alone, under vmap the same to rounding."""
    from fedmtl.engine.clients import LocalClients

    carried = []  # calls of the client update that carries each replica's fields (trained together)
    update = LocalClients._update_fields
    monkeypatch.setattr(LocalClients, "_update_fields", lambda self, *a: carried.append(1) or update(self, *a))
    space = tmp_path / "mu.toml"
    space.write_text(MU_SPACE)
    for runner, tol in (("loop", 0.0), ("vmap", 1e-7)):
        sets = ["algorithm.name=fedprox", f"run.runner={runner}"]
        kw = {"sets": sets, "objective": "seen_val_loss", "prune": False}
        carried.clear()
        with caplog.at_level("WARNING", logger="fedmtl"):
            batched = tune(files / "tiny.toml", space, trials=3, seed=5, out=tmp_path / f"b-{runner}",
                           batch_trials=3, **kw)
        assert "cannot be carried batched" not in caplog.text
        assert carried, "the trials did not train together"  # (trials run apart would compare alike)
        assert [r["state"] for r in batched.trials] == ["COMPLETE"] * 3
        assert len({r["params"]["algorithm.mu"] for r in batched.trials}) == 3
        for r in batched.trials[1:]:
            alone = tune(files / "tiny.toml", _one(tmp_path, f"one-{runner}-{r['number']}.toml", r["params"]),
                         trials=1, seed=0, out=tmp_path / f"a-{runner}-{r['number']}", **kw)
            assert alone.best_value == pytest.approx(r["value"], abs=tol, rel=0)


@pytest.mark.slow  # runs three studies
def test_a_field_in_python_control_flow_trains_the_trials_apart(files, tmp_path, caplog, monkeypatch):
    """An update that branches in Python on the field cannot take it batched: one warning, then the trials train one
    after the other, each exactly as alone."""
    from fedmtl.algorithms import ALGORITHMS
    from fedmtl.engine import clients

    cls = ALGORITHMS["fedprox"]
    real = cls.client_update

    def branches(self, ctx, payload, state, batches, lr):
        if self.mu > 0:  # a Python branch on the field: fine with a float, impossible on a batched value
            lr = lr * 0.5
        return real(self, ctx, payload, state, batches, lr)

    monkeypatch.setattr(cls, "client_update", branches)
    monkeypatch.setattr(clients, "_APART", set())
    space = tmp_path / "mu.toml"
    space.write_text(MU_SPACE)
    kw = {"sets": ["algorithm.name=fedprox", "run.runner=vmap"], "objective": "seen_val_loss", "prune": False}
    with caplog.at_level("WARNING", logger="fedmtl"):
        batched = tune(files / "tiny.toml", space, trials=2, seed=5, out=tmp_path / "b", batch_trials=2, **kw)
    assert caplog.text.count("cannot be carried batched") == 1 and "fedprox" in caplog.text
    for r in batched.trials:
        alone = tune(files / "tiny.toml", _one(tmp_path, f"one-{r['number']}.toml", r["params"]), trials=1,
                     seed=0, out=tmp_path / f"a-{r['number']}", **kw)
        assert alone.best_value == r["value"]


def test_val_fraction_carves_validation_from_training_only():
    """run.val_fraction: every client's training examples split into train and validation (disjoint, together the
    original, the same for every build), the test split untouched; a config whose data has its own is refused."""
    from fedmtl.config import ConfigError, validate

    raw = {"data": {"name": "fedem_synthetic", "num_clients": 4, "dim": 3, "n_test": 5, "min_samples": 10,
                    "max_samples": 20}, "model": {"name": "linear"}, "algorithm": {"name": "fedavg"}}
    plain = validate(raw).build_data()
    cut = validate({**raw, "run": {"val_fraction": 0.3}}).build_data()
    again = validate({**raw, "run": {"val_fraction": 0.3, "seed": 7}}).build_data()
    assert cut.seen.val is not None and again.seen.val is not None
    assert np.array_equal(cut.seen.val.x, again.seen.val.x)
    assert np.array_equal(cut.seen.test.x, plain.seen.test.x)
    for k in range(4):
        x, _ = plain.seen.train.client(k)
        tx, vx = cut.seen.train.client(k)[0], cut.seen.val.client(k)[0]
        assert len(vx) == round(0.3 * len(x)) and len(tx) + len(vx) == len(x)
        rows = {tuple(r) for r in x.tolist()}
        assert {tuple(r) for r in tx.tolist()} | {tuple(r) for r in vx.tolist()} == rows
        assert not {tuple(r) for r in tx.tolist()} & {tuple(r) for r in vx.tolist()}
    with pytest.raises(ConfigError, match="already has a validation split"):
        validate({**raw, "data": {**raw["data"], "val_frac": 0.2}, "run": {"val_fraction": 0.3}}).build_data()


@pytest.mark.slow
def test_two_processes_share_one_study(files, tmp_path):
    """Two `fedmtl tune --resume` started at once on a new folder: one database, created once; every trial run by
    one of them; the study stops at --trials (each process may finish the trial it runs)."""
    out = tmp_path / "shared"
    cmd = [sys.executable, "-m", "fedmtl", "tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"),
           "--trials", "3", "--seed", "3", "--out", str(out), "-q", "--resume"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    trials = _optuna_study(out).get_trials()
    assert 3 <= len(trials) <= 4 and all(t.state.is_finished() for t in trials)
    assert len({t.user_attrs["pid"] for t in trials}) <= 2
    assert all((out / t.user_attrs["dir"]).is_dir() for t in trials)


def test_without_optuna_one_line_names_the_extra(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    _refused(capsys, ["tune", str(files / "tiny.toml"), "--space", str(files / "space.toml"), "--out",
                      str(tmp_path / "o")], "pip install 'fedmtl[tune]'")
    assert not (tmp_path / "o").exists()
