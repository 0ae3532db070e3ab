"""The research workflow: several seeds in one batched run, logs without a terminal, TensorBoard, ``fedmtl
compare``, sweeps' axes, ``fedmtl list --algorithm``, bundled configs from any folder, quick marks and learning
rate milestones in rounds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl.cli import main
from fedmtl.config import ConfigError, load
from fedmtl.optim import SGD
from fedmtl.runs.driver import run_experiment
from fedmtl.runs.seeds import run_seeds, stats

SMALL = ["data.num_clients=24", "run.rounds=6", "run.eval_every=3", "run.checkpoint_every=3", "run.threads=1"]


def _cfg(name: str = "synthetic/fedem", extra: tuple[str, ...] = ()) -> object:
    return load(name, [*SMALL, *extra])


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [
    # (vmap: on auto's stacked executor the replicas train one after the other, never batched: _batchable)
    ("synthetic/fedem", ("run.sampling_rate=0.5", "run.runner=vmap")),  # partial participation: each samples its own
    ("synthetic/ditto", ("run.runner=loop",)),  # the loop executor
    ("synthetic/fedavg", ("data.unseen_frac=0.25", "systems.drop_prob=0.2", "run.runner=vmap")),  # unseen, dropped
    ("synthetic/fedavg", ("attack.kind=labelflip", "attack.fraction=0.25")),  # per-seed attackers, own data copies
    # replicas that split into different numbers of clusters (7, 6, 6): their payloads differ in shape
    ("synthetic/clustered", ("run.runner=vmap", "algorithm.warmup_rounds=1", "algorithm.eps1=10.0",
                             "algorithm.eps2=0.01")),
])
def test_seeds_equal_separate_runs(name, extra, monkeypatch):
    """Each replica of a batched several-seeds run is exactly the run with that seed alone."""
    from fedmtl.engine.clients import LocalClients

    cfg = _cfg(name, extra)
    data = cfg.build_data()
    apart = []  # a replica's round trained on its own (LocalClients.train), not batched with the others
    train = LocalClients.train
    monkeypatch.setattr(LocalClients, "train", lambda self, *a, **k: apart.append(1) or train(self, *a, **k))
    res = run_seeds(cfg, [3, 11, 5], data=data, progress=False)
    assert len(res.runs) == 3
    # batched (some rounds at least: clustered's replicas split apart), but labelflip's own data copies never are
    assert (len(apart) < 3 * cfg.run.rounds) == ("attack.kind=labelflip" not in extra), len(apart)
    finals = []
    for seed, batched in zip([3, 11, 5], res.runs, strict=True):
        alone = run_experiment(cfg.with_seed(seed), None, data=data, progress=False)
        assert batched.summary["seed"] == seed
        assert len(batched.history) == len(alone.history) == 6
        for a, b in zip(batched.history, alone.history, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if isinstance(a[k], float):
                    assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7, nan_ok=True), (seed, a["round"], k)
        assert batched.final == pytest.approx(alone.final, rel=1e-6, abs=1e-7)
        finals.append(alone.final["seen_test_acc_mean"])
    # replicas differ (their own init, sampling and batch order), and the statistics are of them
    assert len({round(f, 9) for f in finals}) == 3
    st = res.final["seen_test_acc_mean"]
    assert st["mean"] == pytest.approx(np.mean(finals))
    assert st["std"] == pytest.approx(np.std(finals, ddof=1))
    from scipy.stats import t

    half = t.ppf(0.975, 2) * np.std(finals, ddof=1) / math.sqrt(3)
    assert st["ci95_low"] == pytest.approx(np.mean(finals) - half)
    assert st["ci95_high"] == pytest.approx(np.mean(finals) + half)


@pytest.mark.parametrize("runner", ["vmap", "loop"])
def test_seeds_whose_payload_copies_do_not_fit_train_one_after_the_other(monkeypatch, runner):
    """A batched round holds one copy of the payload per client (pFedHN's is its whole hypernetwork: 16 GB for 50
    clients x 5 seeds on the Fashion-MNIST MLP, which ended a tuned rerun out of memory). Where the copies do not fit
    the device's memory (here: no room at all), the replicas train one after the other, each still the run with its
    seed alone."""
    from fedmtl.engine import clients as engine_clients

    cfg = _cfg("synthetic/fedavg", ("algorithm.name=pfedhn", f"run.runner={runner}"))
    data = cfg.build_data()
    apart_calls = []
    train = engine_clients.LocalClients.train

    def counted(self, *a, **k):
        apart_calls.append(1)
        return train(self, *a, **k)

    monkeypatch.setattr(engine_clients.LocalClients, "train", counted)
    together = run_seeds(cfg, [3, 11], data=data, progress=False)
    assert not apart_calls  # the copies fit here: every round batched (else apart is compared with apart)
    monkeypatch.setattr(engine_clients, "PAYLOAD_COPIES_SHARE", 0.0)
    apart = run_seeds(cfg, [3, 11], data=data, progress=False)
    assert len(apart_calls) == 2 * cfg.run.rounds  # each replica's round on its own
    for a, b in zip(together.runs, apart.runs, strict=True):
        assert a.final == pytest.approx(b.final, rel=1e-6, abs=1e-7)
    assert not engine_clients.payload_copies_fit({"w": torch.zeros(10)}, 1, torch.device("cpu"))


def test_stats_of_one_and_of_none():
    assert stats([0.5]) == {"mean": 0.5, "std": 0.0, "ci95_low": None, "ci95_high": None, "values": [0.5]}
    assert stats([float("nan")])["mean"] is None


@pytest.mark.slow
@pytest.mark.figures
def test_run_seeds_cli_writes_per_seed_folders_and_resumes(tmp_path, capsys):
    out = tmp_path / "fedem"
    sets = [a for s in SMALL for a in ("--set", s)]
    assert main(["run", "synthetic/fedem", "--seeds", "1-3", "--out", str(out), "-q", *sets]) == 0
    text = capsys.readouterr().out
    assert "seeds [1, 2, 3]" in text and "+-" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [1, 2, 3] and summary["runs"] == ["seed-1", "seed-2", "seed-3"]
    for s in (1, 2, 3):
        run = json.loads((out / f"seed-{s}" / "summary.json").read_text())
        assert run["seed"] == s and run["config"]["run"]["seed"] == s and "seeds" not in run["config"]["run"]
        assert (out / f"seed-{s}" / "checkpoint.pt").exists()
    vals = [json.loads((out / f"seed-{s}" / "summary.json").read_text())["final"]["seen_test_acc_mean"]
            for s in (1, 2, 3)]
    assert summary["final"]["seen_test_acc_mean"]["values"] == vals
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("round,runs,") and "seen_test_acc_mean_std" in rows[0] and len(rows) == 3
    assert (out / "accuracy.png").stat().st_size > 1000
    # a second run into the same folder is refused; --resume continues (finished: the kept evaluation, same numbers)
    assert main(["run", "synthetic/fedem", "--seeds", "1-3", "--out", str(out), "-q", *sets]) == 2
    assert main(["run", "synthetic/fedem", "--seeds", "1-3", "--out", str(out), "-q", "--resume", *sets]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["final"]["seen_test_acc_mean"]["values"] == vals
    assert main(["run", "synthetic/fedem", "--seeds", "1,x", "--out", str(tmp_path / "bad"), *sets]) == 2


@pytest.mark.slow
def test_fedmtl_run_with_seeds_from_python():
    import fedmtl

    res = fedmtl.run("synthetic/fedavg", seeds=[1, 2], data__num_clients=24, run__rounds=4, run__eval_every=2,
                     run__threads=1)
    assert isinstance(res, fedmtl.SeedsResult) and [r.summary["seed"] for r in res.runs] == [1, 2]
    with pytest.raises(ConfigError, match="distinct"):
        fedmtl.run("synthetic/fedavg", seeds=[1, 1])


@pytest.mark.slow
def test_logging_without_a_terminal_prints_plain_lines(tmp_path, monkeypatch, capsys):
    """Under nohup or a scheduler (no TTY): a line for building the data and one per evaluated round, flushed."""
    sets = [a for s in SMALL for a in ("--set", s)]
    cmd = [sys.executable, "-m", "fedmtl", "run", "synthetic/fedavg", "--out", str(tmp_path / "r"), *sets]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    data = [ln for ln in lines if ln.startswith("building data fedem_synthetic:")]
    assert len(data) == 1 and "24 clients" in data[0] and "training examples" in data[0] and data[0].endswith(" s")
    rounds = [ln for ln in lines if " round " in ln]
    assert [ln.split()[2] for ln in rounds] == ["3/6", "6/6"]
    for ln in rounds:
        assert "loss " in ln and "acc " in ln and "%" in ln and ln.endswith("s/round")
    assert "\r" not in p.stderr  # no progress-bar redraws in a log
    # -v: a line for every round; -q: nothing on stderr (in this process: its stderr, captured, is no terminal either)
    monkeypatch.chdir(tmp_path)
    assert main([*cmd[3:], "-v", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert [ln.split()[2] for ln in err.splitlines() if " round " in ln] == [f"{r}/6" for r in range(1, 7)]
    assert main([*cmd[3:], "-q", "--overwrite"]) == 0
    got = capsys.readouterr()
    assert got.err == "" and "seen_test_acc_mean" in got.out


@pytest.mark.slow
def test_tensorboard_scalars_and_client_histogram(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = run_experiment(_cfg("synthetic/fedavg", ("log.tensorboard=true",)), tmp_path / "r", progress=False)
    logdir = tmp_path / "r" / "tensorboard"
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 7))
    assert [e.value for e in loss] == pytest.approx([r["train_loss"] for r in res.history], rel=1e-6)
    ev = acc.Scalars("eval/seen_test_acc_mean")
    assert [e.step for e in ev] == [3, 6] and ev[-1].value == pytest.approx(res.final["seen_test_acc_mean"], rel=1e-6)
    hist = acc.Histograms("clients/seen_test_acc")
    assert [h.step for h in hist] == [3, 6] and hist[-1].histogram_value.num == 24
    assert hist[-1].histogram_value.sum == pytest.approx(res.per_client["seen"]["test"]["acc"].sum(), rel=1e-5)
    with pytest.raises(ConfigError, match=r"\[log\]"):
        load("synthetic/fedavg", ["log.tensorboard=1"])


@pytest.mark.slow
def test_mlflow_logger_round_trips_every_round_and_resumes_into_its_run(tmp_path, monkeypatch):
    """[log] loggers = ["mlflow"]: one MLflow run per fedmtl run in a file store under the run directory; the
    config as parameters, every round's loss and every evaluation with the round as step (read back equal to
    metrics.csv), the final summary; an interrupted run resumed with --resume logs into the same MLflow run."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _cfg("synthetic/fedavg", ('log.loggers=["mlflow"]', "log.mlflow_experiment=fedmtl-test",
                                    "run.checkpoint_every=3"))
    full = run_experiment(cfg, tmp_path / "full", progress=False)
    client = MlflowClient(tracking_uri=(tmp_path / "full" / "mlruns").resolve().as_uri())
    run_id = json.loads((tmp_path / "full" / "mlflow_run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm.name"] == "fedavg"
    assert run.data.tags["fedmtl.seed"] == str(cfg.run.seed)
    loss = sorted(client.get_metric_history(run_id, "train.loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == list(range(1, 7))
    assert [m.value for m in loss] == pytest.approx([r["train_loss"] for r in full.history], rel=1e-6)
    acc = sorted(client.get_metric_history(run_id, "eval.seen_test_acc_mean"), key=lambda m: m.step)
    assert [m.step for m in acc] == [3, 6] and acc[-1].value == pytest.approx(full.final["seen_test_acc_mean"])
    assert run.data.metrics["final.seen_test_acc_p10"] == pytest.approx(full.final["seen_test_acc_p10"])
    # interrupted after round 4 (checkpoint at round 3), resumed: the same MLflow run, every round logged
    from fedmtl.runs import driver

    real = driver._after_round

    def stop_after_4(rep, row, *a, **k):
        real(rep, row, *a, **k)
        if row["round"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(driver, "_after_round", stop_after_4)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", progress=False)
    monkeypatch.setattr(driver, "_after_round", real)
    cut_id = json.loads((tmp_path / "cut" / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=(tmp_path / "cut" / "mlruns").resolve().as_uri())
    assert client.get_run(cut_id).info.status == "KILLED"
    run_experiment(cfg, tmp_path / "cut", resume=True, progress=False)
    assert json.loads((tmp_path / "cut" / "mlflow_run.json").read_text())["run_id"] == cut_id
    assert client.get_run(cut_id).info.status == "FINISHED"
    steps = sorted({m.step for m in client.get_metric_history(cut_id, "train.loss")})
    assert steps == list(range(1, 7))
    with pytest.raises(ConfigError, match="unknown logger 'mlflo'.*did you mean 'mlflow'"):
        load("synthetic/fedavg", ['log.loggers=["mlflo"]'])


@pytest.mark.slow
def test_a_failing_logger_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    """A registered logger that raises (an unreachable tracking server) is dropped with a warning naming it; the run
    finishes with the same numbers as without it."""
    from fedmtl.runs.loggers import LOGGERS, register_logger

    class Broken:
        def __init__(self, run_dir, cfg, resume):
            self.rounds = 0

        def round(self, row, per_client):
            raise ConnectionError("tracking server unreachable")

        def close(self, summary):
            pass

    register_logger("broken-test", Broken)
    try:
        cfg = _cfg("synthetic/fedavg", ('log.loggers=["broken-test"]',))
        res = run_experiment(cfg, tmp_path / "r", progress=False)
    finally:
        LOGGERS.pop("broken-test")
    plain = run_experiment(_cfg("synthetic/fedavg", ()), tmp_path / "p", progress=False)
    assert res.final == plain.final
    assert "logger Broken failed (ConnectionError: tracking server unreachable)" in caplog.text


@pytest.mark.slow
def test_compare_table_plots_and_errors(tmp_path, capsys):
    sets = [a for s in SMALL for a in ("--set", s)]
    assert main(["run", "synthetic/fedem", "--seeds", "1-3", "--out", str(tmp_path / "fedem"), "-q", *sets]) == 0
    assert main(["run", "synthetic/fedavg", "--out", str(tmp_path / "fedavg"), "-q", *sets]) == 0
    capsys.readouterr()
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "fedavg"), str(tmp_path / "fedem"), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| run")]
    fedem = json.loads((tmp_path / "fedem" / "summary.json").read_text())["final"]["seen_test_acc_mean"]
    fedavg = json.loads((tmp_path / "fedavg" / "summary.json").read_text())["final"]["seen_test_acc_mean"]
    first = "fedem" if fedem["mean"] >= fedavg else "fedavg"
    assert rows[0].startswith(f"| {first} |")  # sorted by the metric
    fedem_row = next(r for r in rows if r.startswith("| fedem |"))
    assert f"{100 * fedem['mean']:.2f} ± {100 * fedem['std']:.2f}" in fedem_row and "| 3 |" in fedem_row
    assert "p10 (bottom decile)" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["results"]["fedavg"]["seen_test_acc_mean"]["mean"] == pytest.approx(fedavg)
    assert (out / "curves.png").stat().st_size > 1000 and (out / "clients.png").stat().st_size > 1000
    assert main(["compare", str(tmp_path / "fedavg"), "--metric", "nope", "--out", str(tmp_path / "c2")]) == 2
    assert main(["compare", str(tmp_path / "missing"), "--out", str(tmp_path / "c3")]) == 2


def test_sweep_axes():
    from fedmtl.runs.sweep import axis_kind

    assert axis_kind(["fedavg", "fedem"]) == "category"
    assert axis_kind([0.0, 0.1, 1.0, 10.0]) == "symlog"
    assert axis_kind([1e-3, 1e-2, 1e-1]) == "log"
    assert axis_kind([1, 2, 5]) == "linear"


@pytest.mark.slow
def test_list_algorithm_fields_all_documented(capsys):
    import dataclasses

    from fedmtl.registry import ALGORITHMS, field_table

    for name, cls in ALGORITHMS.items():
        rows = field_table(cls)
        assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(cls) if f.init]
        assert all(r[3] for r in rows), (name, [r[0] for r in rows if not r[3]])
    assert main(["list", "--algorithm", "fedem"]) == 0
    text = capsys.readouterr().out
    assert "num_components" in text and "int in [1, 256] = 3" in text and "shared component models" in text
    assert "'participants' | 'all_clients'" in text
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "synthetic/fedem" in text
    described, names = text.split("configs (bundled", 1)  # the bundled configs are listed by name only
    assert "tuned/synthetic_mixture/fedem" in names
    for line in described.splitlines():
        if line.startswith("  "):
            assert line.rstrip().endswith((".", ")")), line  # whole sentences
    assert main(["list", "--algorithm", "nope"]) == 2


@pytest.mark.slow
def test_bundled_config_and_quick_reproduction_from_any_folder(tmp_path, monkeypatch):
    """After an install, configs and reproductions work outside the repository, and --quick says so."""
    monkeypatch.chdir(tmp_path)
    assert main(["-q", "reproduce", "personalization", "--quick", "--out", "repro"]) == 0
    assert (tmp_path / "repro" / "summary.png").exists() and (tmp_path / "repro" / "summary.pdf").exists()
    md = (tmp_path / "repro" / "personalization.md").read_text()
    assert md.splitlines()[0].startswith("# ") and "QUICK run" in md.splitlines()[0]
    assert not (tmp_path / "configs").exists()


@pytest.mark.slow
def test_lr_milestones_in_rounds():
    frac = SGD(lr=0.1, lr_milestones=(0.5, 0.75))
    rounds = SGD(lr=0.1, lr_milestone_rounds=(100, 150))
    assert [frac.lr_at(r, 200) for r in range(200)] == [rounds.lr_at(r, 200) for r in range(200)]
    assert rounds.lr_at(99, 200) == 0.1 and rounds.lr_at(100, 200) == pytest.approx(0.01)
    assert rounds.lr_at(100, 400) == pytest.approx(0.01)  # rounds do not move with run.rounds
    assert frac.lr_at(100, 400) == 0.1  # fractions do
    with pytest.raises(ConfigError, match="not both"):
        load("synthetic/fedem", ["optim.lr_milestone_rounds=[3]"])
    cfg = load("synthetic/fedem", [*SMALL, "optim.lr_milestones=[]", "optim.lr_milestone_rounds=[2, 4]"])
    res = run_experiment(cfg, None, progress=False)
    assert res.summary["lr_decay_from_rounds"] == [3, 5]
    assert [r["lr"] for r in res.history] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_progress_bar_on_a_terminal_keeps_its_last_state():
    """On a terminal with a width: a bar that ends at its last state; on a 0x0 pseudo-terminal: plain lines.  The
    loss is labelled with what it measures (Ditto's: the global model's)."""
    import fcntl
    import pty
    import struct
    import termios

    from fedmtl.runs.progress import Progress

    for cols, expect_bar in ((100, True), (0, False)):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, cols, 0, 0))
        with os.fdopen(slave, "w") as stream:
            p = Progress("auto", stream=stream)
            assert p.mode == ("bar" if expect_bar else "lines")
            p.start("k", "ditto", 4, loss_label="global loss")
            for r in range(1, 5):
                row = {"round": r, "train_loss": 0.5 / r}
                if r % 2 == 1 or not expect_bar:
                    row["seen_test_acc_mean"] = 0.6 + r / 100
                    row["seen_test_acc_p10"] = 0.5
                p.round("k", "ditto", 4, row, 0.01)
            p.close()
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        os.close(master)
        text = out.decode()
        last = [s for s in text.replace("\r", "\n").splitlines() if s.strip()][-1]
        if expect_bar:  # the last evaluation (accuracy, p10, its round) stays on the bar after it
            assert "4/4" in last and "100%" in last and "global loss=0.1250" in last, text
            assert "acc=63.00%" in last and "p10=50.00%" in last and "eval=r3" in last, text
        else:
            assert last.startswith("ditto round 4/4  global loss 0.1250") and "acc 64.00%" in last, text


@pytest.mark.slow
def test_seeds_memory_check_counts_every_replica(monkeypatch):
    """The replicas' clients share the batched calls: a run that fits with one seed can be refused with three,
    before anything is trained (the machine's memory is faked small here)."""
    import fedmtl.machine

    cfg = _cfg("synthetic/fedem")  # 24 clients, 3 linear components of 151 parameters (binary: W (1, 150), b)
    one = 4.0 * 151 * 3 * (3 * 24 + 4)
    monkeypatch.setattr(fedmtl.machine, "physical_memory", lambda: int(one / 0.8 * 1.5))
    run_experiment(cfg, None, progress=False)  # one seed fits
    with pytest.raises(ValueError, match=r"x 3 replicas \(seeds\)"):
        run_seeds(cfg, [1, 2, 3], progress=False)


@pytest.mark.slow
def test_main_job_quick_reports_every_method_with_seed_spread(tmp_path, monkeypatch):
    """``fedmtl main --quick``: the paper's Table 1 rows and the added linear-model methods, mean ± std over the
    quick run's 2 seeds (the full job's first two), marked quick; one summary figure, no per-run figures.  The one
    data set every method runs on is the legacy generator's with its defaults, and has the reference's statistics
    (checked here on the data the job built, rather than built again in tests/test_synthetic.py)."""
    from fedmtl.experiments import fedem
    from fedmtl.experiments.fedem import MAIN_EXTRA, MAIN_METHODS, MAIN_QUICK_ROUNDS, MAIN_SEEDS

    from .test_synthetic import assert_reference_statistics

    built = []  # (the config's [data], the data) of every data set the job builds
    real = fedem.build_data

    def build_data(cfg, prog):
        built.append((dict(cfg.data), real(cfg, prog)))
        return built[-1][1]

    monkeypatch.setattr(fedem, "build_data", build_data)
    assert main(["-q", "main", "--quick", "--out", str(tmp_path / "res")]) == 0
    assert [spec for spec, _ in built] == [{"name": "fedem_synthetic", "legacy": True}]  # fedem_synthetic(legacy=True)
    assert_reference_statistics(built.pop()[1], legacy=True, pos_rate=0.368)
    table = (tmp_path / "res" / "table.md").read_text()
    assert "QUICK" in table.splitlines()[0] and f", {MAIN_QUICK_ROUNDS} rounds," in table.splitlines()[0]
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert list(summary) == [*MAIN_METHODS, *MAIN_EXTRA]
    for name, row in summary.items():
        assert f"| {name} | " in table
        assert len(row["avg_per_seed"]) == 2 and row["seeds"] == MAIN_SEEDS[:2]
        assert row["avg"]["std"] == pytest.approx(float(np.std(row["avg_per_seed"], ddof=1)), abs=1e-6)
        assert 10 < row["avg"]["mean"] < 100
    assert summary["fedem"]["paper"] is not None and summary["ifca"]["paper"] is None
    assert (tmp_path / "res" / "summary.png").exists() and not list((tmp_path / "res").rglob("accuracy.png"))
