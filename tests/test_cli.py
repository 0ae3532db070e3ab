"""CLI: error messages, run outputs, resume after a real interruption."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmtl.cli import EXIT_INPUT, main
from fedmtl.config import ConfigError, load

TINY = """
[data]
name = "fedem_synthetic"
num_clients = 12
dim = 8
n_test = 30
max_samples = 200
unseen_frac = 0.25
seed = 2

[model]
name = "linear"

[algorithm]
name = "{alg}"

[optim]
lr = 0.1
momentum = 0.9
weight_decay = 5e-4
lr_milestones = [0.5, 0.75]

[run]
rounds = {rounds}
batch_size = 16
eval_every = 2
checkpoint_every = 2
seed = 5
"""


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_key_names_key_and_file(tmp_path, capsys):
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2).replace("[algorithm]", "[algorithm]\nmuu = 1.0"))
    assert main(["run", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "'muu'" in err and "[algorithm]" in err
    assert not (tmp_path / "o").exists()  # failed before any work


def test_wrong_type_names_key_and_file(tmp_path):
    p = write(tmp_path, TINY.format(alg="fedprox", rounds=2).replace("[algorithm]", '[algorithm]\nmu = "big"'))
    with pytest.raises(ConfigError, match=r"c\.toml.*\[algorithm\]\.mu: expected a number, got string 'big'"):
        load(p)
    with pytest.raises(ConfigError, match=r"\[run\]\.rounds: expected an integer"):
        load(write(tmp_path, TINY.format(alg="fedavg", rounds="2.5")))
    with pytest.raises(ConfigError, match=r"unknown table \[trainer\]"):
        load(write(tmp_path, TINY.format(alg="fedavg", rounds=2) + "\n[trainer]\nx = 1\n"))
    with pytest.raises(ConfigError, match=r"\[algorithm\]\.name = 'fedsgd' is not one of"):
        load(write(tmp_path, TINY.format(alg="fedsgd", rounds=2)))
    with pytest.raises(ConfigError, match=r"\[data\]: unknown key 'dims'"):
        load(write(tmp_path, TINY.format(alg="fedavg", rounds=2).replace("dim = 8", "dims = 8")))
    with pytest.raises(ConfigError, match=r"sampling_rate must be in \(0, 1\]"):
        load(write(tmp_path, TINY.format(alg="fedavg", rounds=2)), ["run.sampling_rate=1.5"])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[data\nname=1"))


def test_set_overrides(tmp_path):
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    cfg = load(p, ["algorithm.name=fedem", "algorithm.num_components=2", "run.sampling_rate=0.5"])
    assert cfg.algorithm == {"name": "fedem", "num_components": 2}
    assert cfg.run.sampling_rate == 0.5


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("fedavg", "fedprox", "fedavg+", "local", "fedem"):
        assert name in out


@pytest.mark.figures
def test_run_writes_run_directory(tmp_path):
    p = write(tmp_path, TINY.format(alg="fedem", rounds=4))
    out = tmp_path / "run"
    assert main(["run", str(p), "--out", str(out), "--no-progress"]) == 0
    for f in ("config.toml", "metrics.csv", "clients.csv", "summary.json", "accuracy.png", "checkpoint.pt"):
        assert (out / f).exists(), f
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds"] == 4 and 0.3 < s["final"]["seen_test_acc_mean"] <= 1.0
    assert "unseen_test_acc_mean" in s["final"] and "participation_gap" in s["final"]
    lines = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(lines) == 5
    # the resolved config can be run again as it is
    load(out / "config.toml")
    # a second run into the same directory without --resume is refused, nothing overwritten
    assert main(["run", str(p), "--out", str(out), "--no-progress"]) == 2


@pytest.mark.slow
def test_resume_after_real_interruption_matches_uninterrupted(tmp_path):
    rounds = 60
    p = write(tmp_path, TINY.format(alg="fedem", rounds=rounds).replace("checkpoint_every = 2", "checkpoint_every = 5"))
    # one torch thread in every run, those in this process included (an unrelated pytest may run on more)
    args = ["run", str(p), "--no-progress", "--set", "run.threads=1"]
    cmd = [sys.executable, "-m", "fedmtl.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    full = tmp_path / "full"
    assert main([*args, "--out", str(full)]) == 0  # the reference, in this process

    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, "--out", str(cut)], env=env)
    metrics = cut / "metrics.csv"
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it once a checkpoint exists but before the end
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 11:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(metrics.read_text().splitlines()) - 1
    assert 0 < done < rounds, "the run was not interrupted mid-way"
    assert not (cut / "summary.json").exists()
    assert main([*args, "--out", str(cut), "--resume"]) == 0
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((cut / "summary.json").read_text())
    assert a["final"] == b["final"]
    assert (full / "clients.csv").read_text() == (cut / "clients.csv").read_text()
    ra = (full / "metrics.csv").read_text().splitlines()
    rb = (cut / "metrics.csv").read_text().splitlines()
    assert ra == rb


@pytest.mark.slow
def test_sweep_runs_each_value_and_plots(tmp_path):
    from fedmtl.runs.sweep import split_top_level

    assert split_top_level("1,2,[0.5, 0.75],'a,b'") == ["1", "2", "[0.5, 0.75]", "'a,b'"]
    p = write(tmp_path, TINY.format(alg="fedem", rounds=2))
    out = tmp_path / "sweep"
    assert main(["sweep", str(p), "--set", "algorithm.num_components=1,2,3", "--set", "run.seed=3",
                 "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "sweep.json").read_text())
    assert [r["algorithm.num_components"] for r in s["results"]] == [1, 2, 3]
    assert all(0 < r["seen_test_acc_mean"] <= 1 for r in s["results"])
    assert (out / "sweep.png").stat().st_size > 1000
    assert (out / "algorithm.num_components=2" / "summary.json").exists()
    with pytest.raises(ConfigError, match="nothing to sweep"):
        from fedmtl.runs.sweep import run_sweep

        run_sweep(p, ["run.seed=3"], out)


@pytest.mark.slow
def test_sweep_with_seeds_runs_and_continues(tmp_path):
    """``fedmtl sweep --seeds`` (the Figure 1 commands): every setting with every seed, mean and std per setting;
    run again with --resume, the finished settings are resumed, not re-run (without it: refused)."""
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    out = tmp_path / "sweep"
    args = ["sweep", str(p), "--set", "run.sampling_rate=0.5,1.0", "--seeds", "1-2", "--out", str(out), "-q"]
    assert main(args) == 0
    s = json.loads((out / "sweep.json").read_text())
    assert [r["run.sampling_rate"] for r in s["results"]] == [0.5, 1.0]
    assert all("seen_test_acc_mean_std" in r for r in s["results"])
    assert main(args) == EXIT_INPUT
    assert main([*args, "--resume"]) == 0
    assert json.loads((out / "sweep.json").read_text())["results"] == s["results"]


def test_sweep_resume_reads_back_settings_without_checkpoints(tmp_path, capsys):
    """run.checkpoint_every = 0: --resume reads a finished setting back (its summary.json) and starts over one
    interrupted without a checkpoint, instead of refusing both."""
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    out = tmp_path / "sweep"
    args = ["sweep", str(p), "--set", "optim.lr=0.1,0.2", "--set", "run.checkpoint_every=0", "--out", str(out), "-q"]
    assert main(args) == 0
    rows = json.loads((out / "sweep.json").read_text())["results"]
    assert not list(out.glob("*/checkpoint.pt"))
    (out / "optim.lr=0.2" / "summary.json").unlink()  # the second setting was interrupted: no summary, no checkpoint
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((out / "sweep.json").read_text())["results"] == rows


def test_sweep_resume_refuses_another_plan(tmp_path, capsys):
    """sweep.json records the grid from the start; --resume with another grid is one line, exit 2, and the first
    sweep's tables stay."""
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    out = tmp_path / "sweep"
    assert main(["sweep", str(p), "--set", "optim.lr=0.1,0.2", "--out", str(out), "-q"]) == 0
    before = (out / "sweep.json").read_text()
    assert json.loads(before)["grid"] == [["optim.lr", ["0.1", "0.2"]]]
    capsys.readouterr()
    assert main(["sweep", str(p), "--set", "optim.momentum=0,0.5", "--out", str(out), "--resume", "-q"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert "another plan" in err and "optim.lr=0.1,0.2" in err and len(err.strip().splitlines()) == 1
    assert (out / "sweep.json").read_text() == before and not list(out.glob("optim.momentum=*"))


@pytest.mark.parametrize(("sets", "says"), [
    (["optim.lr=0.1,0.1"], "'0.1' is listed twice"),
    (["optim.lr=0.1,0.2", "optim.lr=0.3,0.4"], "'optim.lr': given twice"),
    (["optim.lr=0.1,0.2", "optim.lr=0.3"], "'optim.lr': given twice"),
])
def test_sweep_refuses_a_repeated_key_or_value_before_any_run(tmp_path, capsys, sets, says):
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    argv = ["sweep", str(p), *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path / "s"), "-q"]
    assert main(argv) == EXIT_INPUT
    assert says in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_sweep_builds_every_model_before_the_first_run(tmp_path, capsys):
    """An image model on vector features, in the second setting: refused before the first setting runs."""
    p = write(tmp_path, TINY.format(alg="fedavg", rounds=2))
    out = tmp_path / "s"
    assert main(["sweep", str(p), "--set", "model.name=linear,cnn_femnist", "--out", str(out), "-q"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert "model.name=cnn_femnist" in err and "image inputs" in err
    assert not out.exists()


def test_every_shipped_config_validates():
    configs = sorted(Path(__file__).resolve().parents[1].glob("configs/**/*.toml"))
    assert len(configs) >= 10
    for c in configs:
        load(c)  # raises ConfigError on any unknown key or wrong type


def test_misspellings_get_a_did_you_mean_and_a_renamed_table_names_its_file(capsys):
    """A misspelled algorithm, key, flag or command gets the nearest valid one; --set algorithm.name on a file whose
    [algorithm] table was written for another method says where the unknown key comes from."""
    assert main(["run", "synthetic/fedem", "--set", "algorithm.name=fedavgg"]) == EXIT_INPUT
    assert "did you mean 'fedavg'?" in capsys.readouterr().err
    assert main(["run", "synthetic/fedem", "--set", "algorithm.num_component=2"]) == EXIT_INPUT
    assert "did you mean 'num_components'?" in capsys.readouterr().err
    assert main(["run", "synthetic/fedem", "--set", "algorithm.name=fedrep"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert "unknown key 'num_components'" in err and "written for 'fedem'" in err and "synthetic/fedem" in err
    for argv, near in ((["run", "synthetic/fedem", "--sedds", "1,2"], "--seeds"), (["reproduc", "x"], "reproduce")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and f"did you mean {near}?" in capsys.readouterr().err


def test_from_arrays_blames_the_odd_client_even_when_it_is_the_first():
    import numpy as np

    from fedmtl import DataError, FederatedData

    odd = [(np.zeros((5, 4)), np.zeros(5, dtype=int))] + [(np.zeros((5, 3)), np.zeros(5, dtype=int))] * 3
    with pytest.raises(DataError, match=r"train client 0: feature shape \(4,\), most clients have \(3,\)"):
        FederatedData.from_arrays(odd, odd)


def test_a_sigterm_while_the_input_is_checked_lets_the_refusal_through():
    """Under torchrun a rank may be stopped (SIGTERM) because another rank refused the same input first: the
    refusal still wins, so every rank says why; without one the SIGTERM takes effect at the end of the checks."""
    from fedmtl.cli import _sigterm_deferred, _Terminated

    with pytest.raises(ConfigError, match="bad key"), _sigterm_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        raise ConfigError("bad key")
    reached = False
    with pytest.raises(_Terminated), _sigterm_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        reached = True
    assert reached


def test_output_flags_after_every_command_name_and_quick_help_says_what_it_runs(tmp_path):
    """-q / -v / --no-progress are accepted after every command's name as before it (list, watch, data and bench
    refused them there); ``fedmtl main --help`` gives the rounds --quick runs."""
    from fedmtl.cli import _parser
    from fedmtl.experiments.fedem import MAIN_QUICK_ROUNDS

    for argv in (["list", "-q"], ["watch", "r1", "--once", "--no-progress"], ["data", "-v", "synthetic/fedavg"],
                 ["bench", "engine", "--out", str(tmp_path / "b.json"), "-q"], ["run", "synthetic/fedavg", "-q"]):
        args = _parser().parse_args(argv)
        assert args.quiet or args.verbose or args.no_progress, argv
    main_help = next(a for a in _parser()._subparsers._group_actions[0].choices["main"]._actions  # type: ignore
                     if "--quick" in a.option_strings).help
    assert f"{MAIN_QUICK_ROUNDS} rounds" in main_help
