"""The distributed executor (``fedmtl.engine.distributed``): 2 gloo ranks started by torchrun on loopback against
one process, for FedAvg, FedEM, Ditto and D-FedEM, with Poisson sampling, stragglers, drops, robust aggregation
and DP; checkpoints, resume, a killed rank."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedmtl.cli import main
from fedmtl.engine.distributed import owned
from fedmtl.runs import checkpoint

BASE = """
[data]
name = "fedem_synthetic"
num_clients = 13
dim = 8
n_test = 20
min_samples = 20
max_samples = 90
unseen_frac = 0.2
seed = 3

[model]
name = "linear"

[algorithm]
name = "{alg}"
{alg_extra}

[optim]
lr = 0.05
momentum = 0.9

[run]
rounds = {rounds}
batch_size = 16
sampling_rate = 0.6
seed = 7
eval_every = {eval_every}
checkpoint_every = {checkpoint_every}
threads = 1
runner = "{runner}"
{extra}
"""


def write_config(tmp: Path, name: str, alg: str = "fedavg", runner: str = "loop", rounds: int = 6,
                 extra: str = "", alg_extra: str = "", eval_every: int = 3, checkpoint_every: int = 2) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(BASE.format(alg=alg, runner=runner, rounds=rounds, extra=extra, alg_extra=alg_extra,
                             eval_every=eval_every, checkpoint_every=checkpoint_every))
    return p


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    e["OMP_NUM_THREADS"] = "1"
    return e


def one_process(cfg: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``fedmtl run`` in this process: the reference the ranks (separate processes) are held to."""
    args = ["run", str(cfg), "--out", str(out), "-q", *extra]
    out_text, err_text = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err_text):
        code = main(args)
    return subprocess.CompletedProcess(args, code, out_text.getvalue(), err_text.getvalue())


def torchrun_cmd(cfg: Path, out: Path, ranks: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "fedmtl", "run", str(cfg), "--out", str(out), "-q", *extra]


def ranks_run(cfg: Path, out: Path, ranks: int = 2, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(torchrun_cmd(cfg, out, ranks, *extra), env=env(), capture_output=True, text=True,
                          timeout=300)


def ok(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def server(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(out / "checkpoint.pt")["server"]


def assert_same_run(a: Path, b: Path, tol: float) -> None:
    """The two runs' metrics (every column but wall-clock ones) and final server states agree within ``tol``
    (``tol = 0``: bit for bit)."""
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb) > 0
    for ra, rb in zip(ma, mb, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            if ra[k] == rb[k]:
                continue
            x, y = float(ra[k]), float(rb[k])
            assert abs(x - y) <= tol * max(1.0, abs(x)), (k, ra["round"], x, y)
    sa, sb = server(a), server(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        if tol == 0:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], rtol=tol, atol=tol)
    ca, cb = checkpoint.load(a / "checkpoint.pt")["clients"], checkpoint.load(b / "checkpoint.pt")["clients"]
    assert ca.keys() == cb.keys()
    for k in ca:
        if isinstance(ca[k], torch.Tensor):
            if tol == 0 or not ca[k].is_floating_point():
                assert torch.equal(ca[k], cb[k]), k
            else:
                torch.testing.assert_close(ca[k], cb[k], rtol=tol, atol=tol)


def test_ownership_is_round_robin_and_covers_everyone() -> None:
    parts = [owned(11, r, 3) for r in range(3)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(11))
    assert parts[1].tolist() == [1, 4, 7, 10]


@pytest.mark.slow
@pytest.mark.parametrize("alg,runner,extra,alg_extra", [
    ("fedavg", "loop", "", ""),  # the updates summed across ranks (all_reduce), not gathered
    ("fedem", "auto", "", "num_components = 3"),
    ("ditto", "vmap", "[privacy]\nclip_norm = 1.0\nnoise_multiplier = 0.5\nreproducible_noise = true\n", ""),
    ("dfedem", "vmap", "", "num_components = 2\ntopology = \"erdos_renyi\"\nedge_prob = 0.5"),
])
def test_two_ranks_equal_one_process(tmp_path: Path, alg: str, runner: str, extra: str, alg_extra: str) -> None:
    """FedEM (stacked), Ditto with Poisson-sampled DP-FedAvg noise, D-FedEM's gossip: 2 ranks within 1e-6 of one
    process (the batched executors group a rank's clients differently; see the module docstring)."""
    cfg = write_config(tmp_path, alg, alg=alg, runner=runner, extra=extra, alg_extra=alg_extra)
    ok(one_process(cfg, tmp_path / "one"))
    ok(ranks_run(cfg, tmp_path / "two"))
    assert_same_run(tmp_path / "one", tmp_path / "two", 1e-6)
    summary = (tmp_path / "two" / "summary.json").read_text()
    assert '"executor": "distributed"' in summary and '"ranks": 2' in summary  # the ranks, not one process each
    summed = '"updates": "summed"' in summary
    assert summed == (alg in ("fedavg", "ditto") and not extra)


@pytest.mark.slow
def test_secure_dp_noise_is_the_same_on_every_rank(tmp_path: Path) -> None:
    """With noise from the OS's CSPRNG the run cannot equal another, but every rank must add rank 0's noise: the
    ranks compare their server states at every checkpoint and stop if they differ."""
    cfg = write_config(tmp_path, "dp", extra="[privacy]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n")
    p = ranks_run(cfg, tmp_path / "two")
    ok(p)
    assert (tmp_path / "two" / "privacy.json").exists()


@pytest.mark.slow
def test_resume_from_a_killed_rank_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """A 2-rank run whose rank 1 is killed (SIGKILL) stops as the distributed guide promises: torchrun exits 1
    naming the dead rank (exitcode -9); rank 0 meets the loss at its next collective and prints one line (the run
    stopped, the last checkpoint's round, resume with --resume), no traceback.  Resumed on 2 ranks it equals the
    uninterrupted run bit for bit, and its checkpoint also resumes in one process, bit for bit too.  (The median
    makes the ranks gather Ditto's updates, not sum them: 2 ranks then equal one process exactly on the loop runner,
    so one uninterrupted process is the reference for both.)"""
    cfg = write_config(tmp_path, "kill", alg="ditto", rounds=80, eval_every=40, checkpoint_every=1,
                       extra="[robust]\naggregator = \"median\"\n")
    ok(one_process(cfg, tmp_path / "ref1"))
    out = tmp_path / "two"
    proc, err = _start_and_kill(cfg, out, signal.SIGKILL, 1, last_round=80)
    assert proc.returncode == 1, err[-3000:]
    assert "rank      : 1 (local_rank: 1)" in err and "exitcode  : -9" in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("fedmtl:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("fedmtl: distributed run stopped") and "--resume" in lines[0], lines[0]
    assert f"checkpoint is round {checkpoint.load(out / 'checkpoint.pt')['round']}" in lines[0], lines[0]
    assert not any('File "' in ln and "fedmtl" in ln for ln in err.splitlines()), err[-3000:]  # no traceback of ours
    # the checkpoint is in the one-process format (rows in client order) and resumes in one process too
    got = checkpoint.load(out / "checkpoint.pt")["clients"]
    assert bool((got["ids"][1:] > got["ids"][:-1]).all())
    shutil.copytree(out, tmp_path / "one")
    ok(one_process(cfg, tmp_path / "one", "--resume"))
    assert_same_run(tmp_path / "ref1", tmp_path / "one", 0.0)
    # resumed on 2 ranks: the uninterrupted run, bit for bit (the loop runner)
    ok(ranks_run(cfg, out, 2, "--resume"))
    assert '"updates": "gathered"' in (out / "summary.json").read_text()
    assert_same_run(tmp_path / "ref1", out, 0.0)


def _start_and_kill(cfg: Path, out: Path, sig: signal.Signals, rank: int,
                    last_round: int) -> tuple[subprocess.Popen[str], str]:
    """Start a 2-rank run of ``last_round`` rounds, wait for its first checkpoint, send ``sig`` to rank ``rank``;
    torchrun's stderr (skips the test if the run finished before the signal landed)."""
    proc = subprocess.Popen(torchrun_cmd(cfg, out, 2), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "checkpoint.pt").exists():
            time.sleep(0.05)
        assert (out / "checkpoint.pt").exists(), "no checkpoint"
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(next(w for w in workers if _rank_of(w) == rank), sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if checkpoint.load(out / "checkpoint.pt")["round"] == last_round:
        pytest.skip("the run finished before the signal landed")
    return proc, err


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_with_the_documented_codes(tmp_path: Path) -> None:
    """What the distributed guide promises when a rank dies, here for a rank that torchrun stops with SIGTERM
    before it meets the loss at a collective: torchrun exits 1, every rank it lists exited 4, and every line the
    ranks print says the distributed run stopped.  (A rank killed outright by SIGKILL, torchrun naming it with
    exitcode -9 and the surviving rank's one line naming the last checkpoint and --resume: checked on the kill of
    test_resume_from_a_killed_rank_equals_the_uninterrupted_run.)"""
    cfg = write_config(tmp_path, "k", rounds=400, eval_every=100, checkpoint_every=1)
    # a rank stopped by a SIGTERM (torchrun's way of stopping a rank) exits 4, as does the rank that then loses it:
    # torchrun's report shows code 4 for every rank it lists
    proc, err = _start_and_kill(cfg, tmp_path / "b", signal.SIGTERM, 0, last_round=400)
    assert proc.returncode == 1, err[-3000:]
    codes = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", err)
    assert codes and all(code == "4" for _, code in codes), err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("fedmtl:")]
    assert lines and all(ln.startswith("fedmtl: distributed run stopped") for ln in lines), err[-3000:]


@pytest.mark.slow
def test_distributed_refusals(tmp_path: Path) -> None:
    """A client store in files (mmap) is refused under torchrun (by every rank, whatever the number of ranks: one is
    enough to see it); ``--executor distributed`` outside torchrun names torchrun."""
    cfg = write_config(tmp_path, "mm", extra="client_store = \"mmap\"\n", alg="ditto")
    p = ranks_run(cfg, tmp_path / "mm", 1)
    assert p.returncode != 0 and "client_store = 'mmap'" in p.stderr
    p = one_process(cfg, tmp_path / "x", "--executor", "distributed")
    assert p.returncode == 2 and "torchrun" in p.stderr


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


@pytest.mark.slow
def test_several_seeds_are_refused_on_every_rank_before_anything_is_written(tmp_path: Path, monkeypatch,
                                                                            capsys) -> None:
    """--seeds (or run.seeds) under torchrun: every rank refuses with the same one line and exit 2, before anything is
    written; with --overwrite the results the directory already holds are left byte-identical.  The seeds given on
    the command line are refused by a real 2-rank job; the seeds of a run directory's own config (--resume) and of a
    config's run.seeds are refused by the same check, here in this process seen as rank 0 of 2 (torchrun's
    environment, no store to meet: it refuses at once)."""
    cfg = write_config(tmp_path, "seeds", rounds=2, eval_every=1, checkpoint_every=1)
    out = tmp_path / "out"
    ok(one_process(cfg, out, "--seeds", "1,2"))
    before = _files(out)
    p = ranks_run(cfg, out, 2, "--seeds", "1,2", "--overwrite")
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("fedmtl:")]
    assert len(lines) == 2 and lines[0] == lines[1], p.stderr[-3000:]
    assert "several seeds" in lines[0] and "torchrun" in lines[0], lines[0]
    assert "exitcode  : 2" in p.stderr, p.stderr[-3000:]
    assert not any('File "' in ln and "fedmtl" in ln for ln in p.stderr.splitlines()), p.stderr[-3000:]
    assert _files(out) == before
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    seeded = write_config(tmp_path, "seeded", rounds=2, extra="seeds = [3, 4]\n")
    capsys.readouterr()
    for args in (["run", "--resume", "--out", str(out), "-q"],  # the run directory's own config and seeds
                 ["run", str(seeded), "--out", str(tmp_path / "fresh"), "-q"]):  # the config's run.seeds
        assert main(args) == 2, args
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("fedmtl:")]
        assert len(lines) == 1 and "several seeds" in lines[0] and "torchrun" in lines[0], err
        assert "Traceback" not in err
        assert _files(out) == before
    assert not (tmp_path / "fresh").exists()


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _rank_of(pid: int) -> int:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    for kv in raw:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return -1


@pytest.mark.slow
def test_the_several_hosts_command_line_equals_one_process_bit_for_bit(tmp_path: Path) -> None:
    """The handbook's several-host command with two "hosts" on loopback: two torchrun launchers of one rank each
    meet at a c10d rendezvous endpoint.  FedAvg with stragglers, drops and a median (robust: the updates are
    gathered, not summed) on the loop runner: the 2 ranks are bit-identical to one process; rank 0 alone reports
    and writes, and keeps no client store."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = write_config(tmp_path, "hosts", extra="[systems]\nvariability = \"high\"\ndrop_prob = 0.2\n"
                                                "[robust]\naggregator = \"median\"\n")
    ok(one_process(cfg, tmp_path / "one"))
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fedmtl-test", "-m", "fedmtl", "run", str(cfg), "--out",
           str(out), "-q"]
    hosts = [subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [h.communicate(timeout=300) for h in hosts]
    for h, (_, err) in zip(hosts, outs, strict=True):
        assert h.returncode == 0, err[-3000:]
    assert_same_run(tmp_path / "one", out, 0.0)
    summary = (out / "summary.json").read_text()
    assert '"executor": "distributed"' in summary and '"ranks": 2' in summary and '"updates": "gathered"' in summary
    assert not (out / "client_store").exists()
    assert sum(o.count("fedavg on fedem_synthetic") for o, _ in outs) == 1  # rank 0 reports, once
