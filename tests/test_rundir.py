"""Run directories that lose nothing: locks, no silent overwrite, --resume only with a checkpoint, tampered or
corrupt checkpoints refused in one line, orphan temporary files removed, a full disk, Ctrl-C and SIGTERM ending
with one line that names the checkpoint, and the documented exit codes."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedmtl.cli import EXIT_INPUT, EXIT_INTERRUPTED, EXIT_OS, EXIT_TERMINATED, main

TINY = """
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
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = {rounds}
batch_size = 16
eval_every = 2
checkpoint_every = {every}
"""


def _cfg(tmp_path: Path, rounds: int = 4, every: int = 2) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(TINY.format(rounds=rounds, every=every))
    return p


def _run(cfg: Path, out: Path, *extra: str) -> int:
    return main(["run", str(cfg), "--out", str(out), "-q", *extra])


def test_results_are_never_overwritten_without_overwrite(tmp_path, capsys):
    cfg, out = _cfg(tmp_path, every=0), tmp_path / "o"
    assert _run(cfg, out) == 0
    before = (out / "summary.json").read_text()
    assert _run(cfg, out) == EXIT_INPUT
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == before
    assert _run(cfg, out, "--resume") == EXIT_INPUT  # checkpoint_every = 0: nothing to resume
    assert "does not exist (nothing to resume" in capsys.readouterr().err
    assert _run(cfg, out, "--overwrite") == 0
    assert not (out / ".lock").exists()


def test_a_second_run_into_a_locked_directory_is_refused_and_stale_locks_are_taken_over(tmp_path, capsys):
    import socket

    cfg, out = _cfg(tmp_path), tmp_path / "o"
    out.mkdir()
    (out / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}")  # this very process: alive
    assert _run(cfg, out) == EXIT_INPUT
    assert "in use by another run" in capsys.readouterr().err
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".lock").write_text(f"{socket.gethostname()} {int(dead.stdout)}")  # a process that has ended
    (out / ".ckpt-orphan.tmp").write_bytes(b"half a checkpoint")
    assert _run(cfg, out) == 0
    assert not (out / ".ckpt-orphan.tmp").exists() and not (out / ".lock").exists()
    # an empty lock (a run stopped, or its disk full, between creating its lock and writing it) held the directory for
    # good: one written just now is left alone (a run may be writing it), an older one is taken over
    (out / ".lock").write_text("")
    assert _run(cfg, out, "--overwrite") == EXIT_INPUT
    assert "in use by another run" in capsys.readouterr().err
    old = time.time() - 60
    os.utime(out / ".lock", (old, old))
    assert _run(cfg, out, "--overwrite") == 0 and not (out / ".lock").exists()


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """The lock's write failing (a full disk) removes the lock: the directory stays usable."""
    from fedmtl.runs.rundir import RunDirectory

    real = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.f = real(fd, mode)

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", Full)
    with pytest.raises(OSError, match="No space left"), RunDirectory(tmp_path / "o"):
        pass
    assert not (tmp_path / "o" / ".lock").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["garbage", "truncated", "pickle", "format", "nan", "round", "empty", "client_ids",
                                  "client_shape", "client_nan", "fifo", "float64", "client_int"])
def test_corrupt_or_tampered_checkpoints_are_refused_in_one_line(tmp_path, capsys, kind):
    cfg2, out2 = _cfg(tmp_path, rounds=4, every=2), tmp_path / "o2"
    cfg2.write_text(cfg2.read_text().replace('name = "fedavg"', 'name = "ditto"'))  # ditto: client states to tamper
    assert _run(cfg2, out2) == 0  # a finished run whose checkpoint is then damaged; --resume must refuse it
    ck = out2 / "checkpoint.pt"
    payload = torch.load(ck, weights_only=True)
    clients = payload["clients"]
    if kind == "empty":
        ck.write_bytes(b"")
    elif kind == "client_ids":
        torch.save({**payload, "clients": {**clients, "ids": clients["ids"] + 1000}}, ck)
    elif kind == "client_shape":
        torch.save({**payload, "clients": {**clients, "leaf0": clients["leaf0"][..., :1]}}, ck)
    elif kind == "client_int":  # never cast to the state's dtype
        torch.save({**payload, "clients": {**clients, "leaf0": clients["leaf0"].to(torch.int64)}}, ck)
    elif kind == "float64":  # finite in float64, Inf once cast to float32: refused, never cast
        payload["server"] = {k: torch.full(v.shape, 1e299, dtype=torch.float64) for k, v in payload["server"].items()}
        torch.save(payload, ck)
    elif kind == "client_nan":
        torch.save({**payload, "clients": {**clients, "leaf0": clients["leaf0"] * float("nan")}}, ck)
    elif kind == "fifo":
        ck.unlink()
        os.mkfifo(ck)
    elif kind == "garbage":
        ck.write_bytes(os.urandom(300))
    elif kind == "truncated":
        ck.write_bytes(ck.read_bytes()[:200])
    elif kind == "pickle":
        import pickle

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {tmp_path / 'pwned'}",))

        ck.write_bytes(pickle.dumps({"format": "x", "x": Evil()}))
    elif kind == "format":
        torch.save({**payload, "format": "something-else"}, ck)
    elif kind == "nan":
        payload["server"] = {k: torch.full_like(v, float("nan")) for k, v in payload["server"].items()}
        torch.save(payload, ck)
    else:
        torch.save({**payload, "round": 1000}, ck)
    before = {f: (out2 / f).read_bytes() for f in ("summary.json", "metrics.csv", "config.toml", "clients.csv")}
    damaged = None if kind == "fifo" else ck.read_bytes()
    assert _run(cfg2, out2, "--resume") == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.pt" in err, err
    if kind.startswith("client"):
        assert {"client_ids": "out of range", "client_shape": "has shape", "client_nan": "NaN or Inf",
                "client_int": "torch.int64"}[kind] in err
    if kind == "float64":
        assert "torch.float64, expected" in err and ".params['" in err, err
    assert not (tmp_path / "pwned").exists()
    # nothing overwritten: the refusal comes before any file of the run directory is touched
    assert {f: (out2 / f).read_bytes() for f in before} == before
    assert kind == "fifo" or ck.read_bytes() == damaged


def _mmap_run(tmp_path: Path) -> tuple[Path, Path]:
    cfg, out = _cfg(tmp_path, rounds=4, every=2), tmp_path / "m"
    cfg.write_text(cfg.read_text().replace('name = "fedavg"', 'name = "fedem"\nnum_components = 2')
                   + 'client_store = "mmap"\n')
    assert _run(cfg, out) == 0
    return cfg, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated", "padded", "header", "layout", "written", "nan", "journal", "missing"])
def test_corrupt_memory_mapped_client_stores_are_refused_in_one_line(tmp_path, capsys, kind):
    """Finding: with run.client_store = "mmap" a truncated leaf0.npy was accepted (numpy zero-extends a file opened
    "r+") and other corruptions gave raw tracebacks.  Every file is checked (kind, header, exact size, finite written
    rows, journal records) before the run resumes."""
    import struct

    import numpy as np

    cfg, out = _mmap_run(tmp_path)
    store = out / "client_store"
    leaf = store / "leaf0.npy"
    if kind == "truncated":
        leaf.write_bytes(leaf.read_bytes()[:-8])
    elif kind == "padded":
        leaf.write_bytes(leaf.read_bytes() + b"\0" * 8)
    elif kind == "header":
        np.save(leaf, np.zeros((3, 3), np.float64))
    elif kind == "layout":
        (store / "layout.json").write_text("{not json")
    elif kind == "written":
        (store / "written.npy").write_bytes(b"garbage")
    elif kind == "nan":
        arr = np.load(leaf, mmap_mode="r+")
        arr[:] = np.nan
        arr.flush()
        del arr
    elif kind == "journal":  # a complete record that names a client outside the federation
        (store / "undo.log").write_bytes(b"FMUL" + struct.pack("<qq", 4, 1) + struct.pack("<q", 10**6) + b"\0"
                                         + b"\0" * 8 + b"END!")
    else:
        leaf.unlink()
    assert _run(cfg, out, "--resume") == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.pt" in err, err
    assert "Traceback" not in err


def test_full_disk_ends_with_one_line_naming_the_checkpoint(tmp_path, capsys, monkeypatch):
    import fedmtl.runs.driver as driver

    cfg, out = _cfg(tmp_path, rounds=4, every=2), tmp_path / "o"
    real = driver.write_history_csv
    calls = {"n": 0}

    def full(path, history):
        calls["n"] += 1
        if len(history) >= 4:  # the disk fills up between the checkpoint of round 4 and its metrics.csv
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, history)

    monkeypatch.setattr(driver, "write_history_csv", full)
    assert _run(cfg, out) == EXIT_OS
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out of disk space" in err and "round 4" in err and "--resume" in err
    assert "round,lr" in (out / "metrics.csv").read_text().replace('"', "")  # the last good file is intact
    assert not list(out.glob(".*.tmp")) and not (out / ".lock").exists()


def test_cuda_on_a_machine_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _run(_cfg(tmp_path), tmp_path / "o", "--device", "cuda") == EXIT_INPUT
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_TERMINATED)])
def test_ctrl_c_and_sigterm_name_the_checkpoint_to_resume_from(tmp_path, sig, code):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(rounds=100000, every=1).replace("max_samples = 60", "max_samples = 600"))
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT at its default: a shell starts background jobs (CI, nohup) with SIGINT ignored, and Python then
    # keeps ignoring it, as a user who ran fedmtl that way asked
    p = subprocess.Popen([sys.executable, "-m", "fedmtl.cli", "run", str(cfg), "--out", str(out), "-q"],
                         stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not (out / "checkpoint.pt").exists():
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "resume with fedmtl run" in lines[0] and "--resume" in lines[0], err
    assert not (out / ".lock").exists() and not list(out.glob(".*.tmp"))


def _snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``out`` (the lock aside): contents and modification time."""
    return {str(f.relative_to(out)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(out.rglob("*"))
            if f.is_file() and f.name != ".lock"}


@pytest.mark.slow
def test_a_resume_that_does_not_fit_the_directory_touches_nothing(tmp_path, capsys):
    """Finding: `fedmtl run ... --seeds 1,2 --resume` on a single-seed run directory deleted its checkpoint,
    clients.csv and config.toml (exit code 0).  Every mismatch (single-seed vs seeds, other seeds, another config)
    is refused before anything is touched, naming the command that resumes the directory, which then works."""
    cfg = _cfg(tmp_path, rounds=4, every=2)
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert _run(cfg, single) == 0 and _run(cfg, multi, "--seeds", "1,2") == 0
    capsys.readouterr()
    cases = [(single, ("--seeds", "1,2", "--resume"), "single-seed run"),
             (single, ("--seeds", "1,2"), "single-seed run"),
             (multi, ("--resume",), "seeds [1, 2]"),
             (multi, (), "seeds [1, 2]"),
             (multi, ("--seeds", "1,2,3", "--resume"), "asks for seeds [1, 2, 3]"),
             (multi, ("--seeds", "1,2", "--resume", "--set", "optim.lr=0.2"), "optim.lr: 0.1 -> 0.2"),
             (single, ("--resume", "--set", "optim.lr=0.2"), "optim.lr: 0.1 -> 0.2")]
    for out, extra, named in cases:
        before = _snapshot(out)
        assert _run(cfg, out, *extra) == EXIT_INPUT, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err and f"--resume --out {out}" in err, (extra, err)
        assert _snapshot(out) == before, extra
        command = err.split("with: ")[-1].split(";")[0].split()
        assert command[:2] == ["fedmtl", "run"]
        assert main([*command[1:], "-q"]) == 0, command  # the command named resumes it (finished: nothing to train)
        capsys.readouterr()


def _seeds_cfg(tmp_path: Path) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(TINY.format(rounds=6, every=2).replace('name = "fedavg"', 'name = "fedem"\nnum_components = 2'))
    return p


def _final_states(out: Path, seeds: tuple[int, ...]) -> list[dict]:
    return [torch.load(out / f"seed-{s}" / "checkpoint.pt", weights_only=True) for s in seeds]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["written", "marked", "renamed"])
def test_several_seeds_resume_exactly_wherever_a_kill_falls_in_their_checkpoint(tmp_path, monkeypatch, phase):
    """Finding: with --seeds 1,2,3 a kill between the replicas' checkpoints left seed 3 a round behind, and the
    resumed run differed by 2e-8 (seed 3 then trained alone, in other batched calls).  The replicas' checkpoints
    are committed as a group; a kill at each phase of that commit (after one replica's new checkpoint is written;
    after the group's marker; after one rename) resumes to a run byte-identical to an uninterrupted one."""
    from fedmtl.runs import checkpoint as ck
    from fedmtl.runs import driver

    cfg, seeds = _seeds_cfg(tmp_path), ("--seeds", "1,2,3")
    ref = tmp_path / "ref"
    assert _run(cfg, ref, *seeds) == 0
    out = tmp_path / "run"
    state = {"n": 0}

    def kill_after(fn, match):
        def wrapped(*a, **k):
            res = fn(*a, **k)
            if match(*a):
                state["n"] += 1
                if state["n"] == 4:  # the second group commit (round 4): 3 replicas x the first, then this one
                    raise KeyboardInterrupt("killed")
            return res
        return wrapped

    if phase == "written":  # one replica's checkpoint.next.pt written, no marker yet
        monkeypatch.setattr(ck, "save", kill_after(ck.save, lambda p, *a: Path(p).name == "checkpoint.next.pt"))
    elif phase == "marked":  # the marker written, no rename yet
        state["n"] = 2
        marker = kill_after(driver.write_json, lambda p, *a: p.name == "seeds-commit.json")
        monkeypatch.setattr(driver, "write_json", marker)
    else:  # one replica renamed and committed
        monkeypatch.setattr(driver, "_committed", kill_after(driver._committed, lambda *a: True))
    assert _run(cfg, out, *seeds) == EXIT_INTERRUPTED
    monkeypatch.undo()
    rounds = {torch.load(out / f"seed-{s}" / "checkpoint.pt", weights_only=True)["round"] for s in (1, 2, 3)}
    assert len(rounds) <= 2  # the kill left the replicas' files mid-commit ...
    assert _run(cfg, out, *seeds, "--resume") == 0  # ... and the resume completes or undoes that commit
    for got, want in zip(_final_states(out, (1, 2, 3)), _final_states(ref, (1, 2, 3)), strict=True):
        assert got["round"] == want["round"] == 6
        for k in want["server"]:
            assert torch.equal(got["server"][k], want["server"][k]), k
        assert got["history"] == want["history"]
    assert not list(out.glob("seed-*/checkpoint.next.pt")) and not (out / "seeds-commit.json").exists()


def test_config_diff_names_keys_and_reads_a_config_back_from_toml_as_equal():
    from fedmtl.runs.rundir import config_diff

    saved = {"run": {"rounds": 4, "seeds": [1, 2]}, "attack": {"kind": "ipm"}}
    now = {"run": {"rounds": 5, "seeds": (1, 2)}, "attack": {"kind": "ipm", "strength": None}}
    assert config_diff(saved, now) == ["run.rounds: 4 -> 5"]  # a tuple is a list, None is unset (TOML has none)
    assert config_diff(now, now) == []


def test_a_signal_during_a_checkpoint_write_waits_for_the_write(tmp_path):
    """SIGTERM or Ctrl-C arriving inside ``checkpoint.save`` takes effect after the file is complete, through the
    handler installed before (it used to land inside ``torch.save``, whose cleanup turned it into a RuntimeError and
    the command's exit code into 1)."""
    import os

    from fedmtl.files import signals_deferred

    class Stop(BaseException):
        pass

    def raise_stop(signum, frame):
        raise Stop()

    previous = signal.signal(signal.SIGTERM, raise_stop)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever an earlier test left there
    done = []
    try:
        with pytest.raises(Stop):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("the block ran on")
        assert done == ["the block ran on"]
        assert signal.getsignal(signal.SIGTERM) is raise_stop  # the handler is back
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("again")
        assert done[-1] == "again"
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_a_signal_as_a_temporary_file_is_created_leaves_no_file(tmp_path, monkeypatch):
    """A SIGTERM landing as ``mkstemp`` returns (seen once as a ``.metrics.csv.*.tmp`` left behind by a terminated
    run on a loaded machine) still stops the write, through the handler installed before, and the temporary is
    deleted: for ``files.atomic``, a Flower node's client-state files (which use it) and downloads."""
    import tempfile

    from fedmtl.data import download as dl
    from fedmtl.files import atomic

    class Stop(BaseException):
        pass

    def raise_stop(signum, frame):
        raise Stop()

    real = tempfile.mkstemp

    def mkstemp_then_signal(*args, **kwargs):  # the signal arrives once the file exists, before its name is returned
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_signal)
    previous = signal.signal(signal.SIGTERM, raise_stop)
    try:
        with pytest.raises(Stop), atomic(tmp_path / "metrics.csv") as f:
            f.write("never")
        remote = dl.Remote("x.bin", ("http://127.0.0.1:9/x.bin",))
        with pytest.raises(Stop):
            dl.download(remote, tmp_path / "dl")
        assert signal.getsignal(signal.SIGTERM) is raise_stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(f.name for f in tmp_path.rglob("*") if f.is_file()) == []


@pytest.mark.slow
def test_resume_needs_nothing_but_the_run_directory(tmp_path, capsys):
    """`fedmtl run --resume --out DIR` reads DIR's own resolved config, --set overrides and seeds included; the same
    config passed again with the overrides forgotten is refused naming the differing key."""
    cfg, out = _cfg(tmp_path, rounds=4, every=1), tmp_path / "o"
    assert _run(cfg, out, "--set", "optim.lr=0.05") == 0
    ck = out / "checkpoint.pt"
    before = ck.read_bytes()
    assert main(["run", "--resume", "--out", str(out), "-q"]) == 0  # a finished run: nothing left to train
    assert ck.read_bytes() == before
    assert _run(cfg, out, "--resume") == EXIT_INPUT  # the override forgotten
    err = capsys.readouterr().err
    assert "optim.lr" in err and f"fedmtl run --resume --out {out}" in err, err
    seeds = tmp_path / "s"
    assert _run(cfg, seeds, "--seeds", "1,2", "--set", "run.batch_size=8") == 0
    assert main(["run", "--resume", "--out", str(seeds), "-q"]) == 0
    assert main(["run", "--out", str(tmp_path / "none"), "-q"]) == EXIT_INPUT
    assert "needs a CONFIG" in capsys.readouterr().err
    assert main(["run", "--resume", "--out", str(tmp_path / "none"), "-q"]) == EXIT_INPUT
    assert "no run there to resume" in capsys.readouterr().err


def test_cheap_refusals_come_before_the_data_is_built(tmp_path, monkeypatch, capsys):
    """--resume with --overwrite, and a directory another live run holds, are refused before any data is built."""
    from fedmtl.config import ExperimentConfig

    def no_data(self):
        raise AssertionError("the data was built before a cheap check")

    monkeypatch.setattr(ExperimentConfig, "build_data", no_data)
    cfg, out = _cfg(tmp_path), tmp_path / "o"
    assert _run(cfg, out, "--resume", "--overwrite") == EXIT_INPUT
    assert "exclude each other" in capsys.readouterr().err
    out.mkdir()
    (out / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}")  # this live process holds it
    assert _run(cfg, out) == EXIT_INPUT
    assert "in use by another run" in capsys.readouterr().err


@pytest.mark.slow
def test_resuming_a_finished_run_reports_the_evaluation_its_checkpoint_kept(tmp_path, monkeypatch):
    """The last round's checkpoint keeps the per-client evaluation: `--resume` of a finished run (one seed or
    several) writes the same summary and clients.csv without evaluating a client again.  An older checkpoint
    without it is still resumed, by evaluating again, once: the evaluation is then kept in it."""
    from fedmtl.engine.round import Engine
    from fedmtl.runs import checkpoint

    cfg = _cfg(tmp_path, rounds=4, every=2)
    one, seeds = tmp_path / "one", tmp_path / "seeds"
    assert _run(cfg, one) == 0 and _run(cfg, seeds, "--seeds", "1,2") == 0
    kept = checkpoint.evaluation_of(checkpoint.load(one / "checkpoint.pt"))
    assert kept is not None and set(kept["seen"]) == {"train", "test"}
    runs = [one, seeds / "seed-1", seeds / "seed-2"]
    before = {d: ((d / "clients.csv").read_text(), (d / "summary.json").read_text()) for d in runs}

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a finished run was evaluated again")

    with monkeypatch.context() as m:
        m.setattr(Engine, "evaluate", refuse)
        assert main(["run", "--resume", "--out", str(one), "-q"]) == 0
        assert main(["run", "--resume", "--out", str(seeds), "-q"]) == 0
    for d in runs:
        s0, s1 = json.loads(before[d][1]), json.loads((d / "summary.json").read_text())
        assert (d / "clients.csv").read_text() == before[d][0] and s1["final"] == s0["final"], d
    saved = torch.load(one / "checkpoint.pt", weights_only=True)  # a checkpoint from before the evaluation was kept
    del saved["evaluation"]
    torch.save(saved, one / "checkpoint.pt")
    assert checkpoint.evaluation_of(checkpoint.load(one / "checkpoint.pt")) is None
    assert main(["run", "--resume", "--out", str(one), "-q"]) == 0
    assert (one / "clients.csv").read_text() == before[one][0]
    assert checkpoint.evaluation_of(checkpoint.load(one / "checkpoint.pt")) is not None  # kept from now on
    saved["evaluation"] = {"seen/test": torch.zeros(3)}  # malformed: refused in one line, like any damage
    torch.save(saved, one / "checkpoint.pt")
    with pytest.raises(checkpoint.CheckpointError, match="stored evaluation"):
        checkpoint.load(one / "checkpoint.pt")


def test_a_resume_over_other_data_is_refused(tmp_path, monkeypatch, capsys):
    """A run over a data directory named by a relative path (``[data] name = "npz_folder"``, ``path = "e4"``),
    resumed from another folder that holds other data under the same name: refused in one line (the checkpoint keeps
    the data's digest), nothing written; from the folder it started in it resumes."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, 1), (b, 2)):
        d.mkdir()
        monkeypatch.chdir(d)
        (d / "c.toml").write_text(TINY.format(rounds=4, every=2).replace("seed = 1", f"seed = {seed}"))
        assert main(["data", "export", "c.toml", "--out", "e4"]) == 0
    (a / "npz.toml").write_text(TINY.format(rounds=4, every=2).split("[model]")[0].replace(
        'name = "fedem_synthetic"', 'name = "npz_folder"\npath = "e4"').split("num_clients")[0]
        + "\n[model]" + TINY.format(rounds=4, every=2).split("[model]")[1])
    monkeypatch.chdir(a)
    out = tmp_path / "run"
    assert main(["run", "npz.toml", "--out", str(out), "-q", "--set", "run.rounds=2"]) == 0
    before = (out / "checkpoint.pt").read_bytes()
    monkeypatch.chdir(b)  # the same relative path, other data
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "-q"]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trained on other data" in err and "current folder" in err, err
    assert (out / "checkpoint.pt").read_bytes() == before
    monkeypatch.chdir(a)
    assert main(["run", "--resume", "--out", str(out), "-q"]) == 0
