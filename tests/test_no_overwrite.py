"""Nothing is overwritten without ``--overwrite``: every command that writes a folder, run a second time into the same
output, refuses with one line on stderr and exit code 2, and leaves every file of the folder byte-identical."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedmtl.cli import EXIT_INPUT, main

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 5
n_test = 10
max_samples = 60
seed = 3

[model]
name = "linear"

[algorithm]
name = "fedavg"

[run]
rounds = 2
eval_every = 1
checkpoint_every = 1
"""


def files(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (its relative path -> its bytes)."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def refused(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv`` once more into ``out``: exit 2, one line naming ``out`` and --overwrite, ``out`` unchanged."""
    before = files(out)
    assert before, f"{out} holds nothing: the first invocation wrote nothing"
    capsys.readouterr()
    assert main(argv) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "--overwrite" in err, err
    assert files(out) == before
    return err


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(CONFIG)
    return p


def test_run(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    argv = ["run", str(cfg), "--out", str(out), "-q"]
    assert main(argv) == 0
    refused(argv, out, capsys)
    refused([*argv, "--set", "run.rounds=3"], out, capsys)


@pytest.mark.slow
def test_run_with_seeds(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    argv = ["run", str(cfg), "--out", str(out), "--seeds", "1,2", "-q"]
    assert main(argv) == 0
    refused(argv, out, capsys)


@pytest.mark.slow
def test_sweep(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", str(cfg), "--set", "optim.lr=0.05,0.1", "--out", str(out), "-q"]
    assert main(argv) == 0
    refused(argv, out, capsys)
    refused(["sweep", str(cfg), "--set", "optim.lr=0.2,0.3", "--out", str(out), "-q"], out, capsys)
    assert main([*argv, "--resume"]) == 0  # continues: the finished settings are read back
    assert main([*argv[:-1], "--set", "run.rounds=1", "--overwrite", "-q"]) == 0  # starts every setting over
    assert (out / "optim.lr=0.05" / "metrics.csv").read_text().count("\n") == 2  # a header and one round


def _fake(name: str) -> Callable[..., Any]:
    """A stand-in for a reproduction that writes its table (so that a refusal that fails is seen at once, without
    the hours a real reproduction takes)."""
    def write(out: Path, quick: bool = False) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text("new results\n")
    return write


def test_reproduce(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import fedmtl.experiments as ex

    monkeypatch.setattr(ex, "reproduction", _fake)
    out = tmp_path / "rep"
    out.mkdir()
    (out / "fmnist.md").write_text("results of hours\n")
    refused(["reproduce", "fmnist", "--out", str(out)], out, capsys)
    assert main(["-q", "reproduce", "fmnist", "--out", str(out), "--overwrite"]) == 0
    assert (out / "fmnist.md").read_text() == "new results\n"
    assert main(["-q", "reproduce", "fmnist", "--out", str(out), "--resume"]) == 0
    assert main(["-q", "reproduce", "fmnist", "--out", str(tmp_path / "new")]) == 0


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import fedmtl.experiments.fedem as fedem

    monkeypatch.setattr(fedem, "main_job", lambda out, quick=False: _fake("table")(out))
    out = tmp_path / "res"
    out.mkdir()
    (out / "table.md").write_text("results of hours\n")
    refused(["main", "--out", str(out)], out, capsys)
    assert main(["-q", "main", "--out", str(out), "--resume"]) == 0


@pytest.mark.slow
def test_reproductions_start_every_run_over_with_overwrite(cfg: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """--overwrite: a reproduction's runs start over (a finished run is not read back); --resume: they continue."""
    import fedmtl.experiments.common as common
    from fedmtl.config import load

    calls: list[tuple[bool, bool]] = []
    real = common.run_experiment

    def spy(*args: Any, resume: bool = False, overwrite: bool = False, **kw: Any) -> Any:
        calls.append((resume, overwrite))
        return real(*args, resume=resume, overwrite=overwrite, **kw)

    monkeypatch.setattr(common, "run_experiment", spy)
    c = load(str(cfg))
    first = common.run_one(c, tmp_path / "one", None)
    assert common.run_one(c, tmp_path / "one", None)["final"] == first["final"]
    with common.starting_over():
        assert common.run_one(c, tmp_path / "one", None)["final"] == first["final"]
    assert calls == [(False, True), (True, False), (False, True)]


@pytest.mark.slow
def test_compare(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "-q"]) == 0
    out = tmp_path / "cmp"
    argv = ["compare", str(tmp_path / "r"), "--out", str(out), "-q"]
    assert main(argv) == 0
    refused(argv, out, capsys)
    assert main([*argv, "--overwrite"]) == 0


@pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower is not installed")
def test_flower_app(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "app"
    argv = ["flower", "app", str(cfg), "--out", str(out)]
    assert main(argv) == 0
    refused([*argv, "--nodes", "2"], out, capsys)
    assert main([*argv, "--nodes", "2", "--overwrite"]) == 0
    assert "fedmtl-num-nodes = 2" in (out / "pyproject.toml").read_text()


@pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower is not installed")
def test_flower_simulate(cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory that holds results (here a run's own) is not continued or replaced by a Flower simulation
    without --resume or --overwrite."""
    out = tmp_path / "r"
    assert main(["run", str(cfg), "--out", str(out), "-q"]) == 0
    refused(["flower", "simulate", str(cfg), "--out", str(out), "--nodes", "2"], out, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seeds", [[], ["--seeds", "1,2"]])
def test_run_overwrite_that_cannot_start_keeps_the_results(cfg: Path, tmp_path: Path, seeds: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--overwrite with a model that does not fit the data: refused after the data is built, and the results the
    directory held are still there, byte-identical (they are deleted only once the new run is built)."""
    out = tmp_path / "r"
    assert main(["run", str(cfg), "--out", str(out), "-q", *seeds]) == 0
    before = files(out)
    capsys.readouterr()
    assert main(["run", str(cfg), "--out", str(out), "-q", *seeds, "--overwrite", "--set",
                 "model.name=cnn_femnist"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "image inputs" in err, err
    assert files(out) == before and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert main(["run", str(cfg), "--out", str(out), "-q", *seeds, "--overwrite", "--set", "run.rounds=1"]) == 0
    assert files(out) != before and not (out / ".replaced").exists()
    metrics = out / ("seed-1" if seeds else "") / "metrics.csv"
    assert metrics.read_text().count("\n") == 2  # the new run's header and one round


def test_results_set_aside_by_a_killed_overwrite_come_back(cfg: Path, tmp_path: Path) -> None:
    """A replacing run killed between setting the old results aside and starting leaves them in .replaced/; the next
    run into the directory puts them back, so it is refused as holding results (nothing lost)."""
    import socket

    from fedmtl.runs.rundir import RunDirectory

    out = tmp_path / "r"
    assert main(["run", str(cfg), "--out", str(out), "-q"]) == 0
    before = files(out)
    rd = RunDirectory(out, overwrite=True, deferred=True).__enter__()  # as a replacing run killed now leaves it
    assert (out / ".replaced" / "checkpoint.pt").exists() and not (out / "checkpoint.pt").exists()
    rd._held = False  # the killed process's lock: it is gone (taken over below)
    (out / ".lock").write_text(f"{socket.gethostname()} 999999999")
    assert main(["run", str(cfg), "--out", str(out), "-q"]) == EXIT_INPUT
    assert files(out) == before


def test_a_run_into_a_run_directory_is_refused_before_its_data_is_built(cfg: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmtl.config import ExperimentConfig

    out = tmp_path / "r"
    assert main(["run", str(cfg), "--out", str(out), "-q"]) == 0
    built: list[int] = []
    real = ExperimentConfig.build_data
    monkeypatch.setattr(ExperimentConfig, "build_data", lambda self, *a, **k: built.append(1) or real(self, *a, **k))
    assert main(["run", str(cfg), "--out", str(out), "-q"]) == EXIT_INPUT
    assert built == []
