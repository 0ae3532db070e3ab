"""``fedmtl watch``: following a run while it runs, a finished run, a stopped one, a run with several seeds."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

import fedmtl
from fedmtl.cli import main
from fedmtl.config import read_toml
from fedmtl.engine import driver
from fedmtl.watch import WatchError, status, watch


def _raw(rounds: int = 12) -> dict:
    raw = read_toml("synthetic/fedavg")
    raw["data"].update(num_clients=8, n_test=20)
    raw["run"].update(rounds=rounds, eval_every=4, checkpoint_every=4)
    return raw


def test_watch_follows_a_running_run_to_its_final_evaluation(tmp_path, monkeypatch):
    """While the run trains in another thread, watch prints a line each time metrics.csv grows (rounds rising), and
    ends with the run's final evaluation, equal to summary.json's, exit 0."""
    monkeypatch.setattr(driver, "LIVE_EVERY", 0.0)  # a live write after every round
    out = tmp_path / "run"
    started = threading.Event()
    result: dict = {}

    def train() -> None:
        started.set()
        result["r"] = fedmtl.run(_raw(), out=out)

    t = threading.Thread(target=train)
    t.start()
    started.wait()
    buf = io.StringIO()
    code = watch(out, interval=0.05, stream=buf, wait=120)
    t.join()
    lines = buf.getvalue().splitlines()
    rounds = [int(m.group(1)) for ln in lines if (m := re.search(r"round (\d+)/12", ln))]
    assert code == 0 and rounds == sorted(rounds) and rounds[-1] == 12, lines
    final = result["r"].summary["final"]
    assert lines[-1].startswith("fedavg on fedem_synthetic  round 12/12")
    assert f"acc {100 * final['seen_test_acc_mean']:.2f}%" in lines[-1] and "finished" in lines[-1]
    assert f"p10 {100 * final['seen_test_acc_p10']:.2f}%" in lines[-1]
    progress = json.loads((out / "progress.json").read_text())
    assert progress["rounds"] == 12 and progress["seconds_per_round"] > 0


def test_watch_names_a_stopped_run_and_how_to_resume_it(tmp_path):
    """A run interrupted after its round-4 checkpoint (no summary, no live lock): watch shows round 4/12 with the
    last evaluation and the NaN/straggler counts of metrics.csv, then the resume command, exit 1."""
    out = tmp_path / "run"
    fedmtl.run(_raw(), out=out)
    (out / "summary.json").unlink()
    rows = (out / "metrics.csv").read_text().splitlines()
    (out / "metrics.csv").write_text("\n".join(rows[:5]) + "\n")  # the header and rounds 1-4
    (out / "progress.json").unlink()
    st = status(out)
    assert (st.round, st.rounds, st.finished, st.running, st.eval_round) == (4, 12, False, False, 4)
    buf = io.StringIO()
    assert watch(out, interval=0.05, stream=buf) == 1
    text = buf.getvalue()
    assert "round 4/12" in text and "dropped 0  excluded 0" in text
    assert f"continue it with: fedmtl run --resume --out {out}" in text
    # a run whose lock a live process holds is running, not stopped
    import os
    import socket

    (out / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}")
    assert status(out).running is True


def test_watch_once_on_a_run_with_several_seeds_and_on_nothing(tmp_path, capsys):
    """--once prints one line per seed of a finished run with several seeds (exit 0); a folder with no run is a
    one-line error naming it, exit 2."""
    out = tmp_path / "seeds"
    fedmtl.run(_raw(4), out=out, seeds=[1, 2])
    assert main(["watch", str(out), "--once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("round 4/4" in ln and "finished" in ln for ln in lines)
    assert "[seed-1]" in lines[0] and "[seed-2]" in lines[1]
    with pytest.raises(WatchError, match="no run here yet"):
        watch(tmp_path / "nothing", once=True)
    assert main(["watch", str(tmp_path / "nothing"), "--once"]) == 2
    assert "no run here yet" in capsys.readouterr().err
