"""Run directories that lose nothing: locks, no silent overwrite, --resume only with a checkpoint, tampered or
corrupt checkpoints refused in one line, orphan temporary files removed, a full disk, Ctrl-C and SIGTERM ending
with one line that names the checkpoint, and the documented exit codes."""

from __future__ import annotations

import errno
import os
import signal
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


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["garbage", "truncated", "pickle", "format", "nan", "round"])
def test_corrupt_or_tampered_checkpoints_are_refused_in_one_line(tmp_path, capsys, kind):
    cfg2, out2 = _cfg(tmp_path, rounds=4, every=2), tmp_path / "o2"
    assert _run(cfg2, out2) == 0  # a finished run whose checkpoint is then damaged; --resume must refuse it
    ck = out2 / "checkpoint.pt"
    payload = torch.load(ck, weights_only=True)
    if kind == "garbage":
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
    assert _run(cfg2, out2, "--resume") == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint.pt" in err, err
    assert not (tmp_path / "pwned").exists()


def test_full_disk_ends_with_one_line_naming_the_checkpoint(tmp_path, capsys, monkeypatch):
    import fedmtl.engine.driver as driver

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
