"""``fedmtl watch DIR``: follow a run while it runs, simulated or deployed over Flower.

The driver keeps a run directory current while the run runs (``metrics.csv`` rewritten at most every two seconds and
at every checkpoint, ``progress.json`` with the mean seconds per round), and a Flower ServerApp writes the same
directory on the server machine.  ``watch`` reads them and prints, per run, a line whenever the run advances::

    fedem on fedem_synthetic  round 40/200  acc 73.84%  p10 69.43% (round 40)  dropped 3  excluded 0  ETA 1m12s

(``dropped`` and ``excluded``: the client updates lost so far, to stragglers and failed nodes or for being NaN/Inf;
accuracy and p10 are those of the last evaluated round).  It ends when every run holds ``summary.json`` (exit 0,
its final line the last round's evaluation) or when a run stops unfinished, its lock released or its process gone
(exit 1, naming the command that resumes it).  A run with several seeds is followed seed by seed.  ``once=True``
prints the current state and returns.  Nothing is written: ``watch`` may follow a run it cannot modify.
"""

from __future__ import annotations

import csv
import io
import json
import socket
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from .engine.rundir import alive, read_lock, seed_dirs
from .files import FileCheckError, read_text

_LIMIT = 64 << 20  # bytes read of metrics.csv (a run of a million rounds stays below)


class WatchError(ValueError):
    """The directory holds no run to follow."""


@dataclass
class Status:
    """What a run directory says now."""

    path: Path
    label: str
    round: int
    rounds: int | None
    acc: float | None
    p10: float | None
    eval_round: int | None
    dropped: int
    excluded: int
    seconds_per_round: float | None
    finished: bool
    running: bool | None  # None: its lock names another host, which this machine cannot check

    @property
    def eta(self) -> float | None:
        if self.finished or self.rounds is None or self.seconds_per_round is None:
            return None
        return max(self.rounds - self.round, 0) * self.seconds_per_round

    def line(self) -> str:
        total = f"/{self.rounds}" if self.rounds else ""
        parts = [f"{self.label}  round {self.round}{total}"]
        if self.acc is not None:
            parts.append(f"acc {100 * self.acc:.2f}%")
        if self.p10 is not None:
            parts.append(f"p10 {100 * self.p10:.2f}%" + (f" (round {self.eval_round})" if not self.finished else ""))
        parts.append(f"dropped {self.dropped}  excluded {self.excluded}")
        if self.finished:
            parts.append("finished")
        elif (eta := self.eta) is not None:
            parts.append(f"ETA {_duration(eta)}")
        return "  ".join(parts)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def runs_in(path: Path) -> list[Path]:
    """The run directories under ``path``: itself, or the ``seed-<S>`` folders of a run with several seeds."""
    seeds = seed_dirs(path)
    if seeds:
        return list(seeds.values())
    if (path / "config.toml").exists() or (path / "metrics.csv").exists():
        return [path]
    raise WatchError(f"{path}: no run here yet (a run directory holds config.toml and metrics.csv once its run "
                     "starts)")


def _running(run: Path) -> bool | None:
    """Whether a process holds the run's lock (or that of the run with several seeds it belongs to)."""
    for lock in (run / ".lock", run.parent / ".lock"):
        owner = read_lock(lock)  # never a FIFO or a device read, never a pid beyond any process id
        if owner is None:
            continue
        host, pid = owner
        if host != socket.gethostname():
            return None
        return pid.isdigit() and alive(int(pid))
    return False


def _number(v: Any, kind: type = float) -> Any:
    try:
        return kind(float(v)) if kind is int else float(v)
    except (TypeError, ValueError):
        return None


def status(run: Path) -> Status:
    """Read ``run``'s directory as it is now (files the run replaces atomically: never half-written)."""
    label, rounds = run.name, None
    try:
        cfg = tomllib.loads(read_text(run / "config.toml", 1 << 20, "run configuration", WatchError))
        label = f"{cfg['algorithm']['name']} on {cfg['data']['name']}"
        rounds = int(cfg["run"]["rounds"])
    except (OSError, FileCheckError, WatchError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError):
        pass
    if run.parent != run and run.name.startswith("seed-"):
        label = f"{label} [{run.name}]"
    rows: list[dict[str, str]] = []
    if (run / "metrics.csv").exists():
        try:
            rows = list(csv.DictReader(io.StringIO(read_text(run / "metrics.csv", _LIMIT, "metrics", WatchError))))
        except (OSError, FileCheckError, WatchError, csv.Error):
            rows = []
    evals = [r for r in rows if _number(r.get(SEEN_TEST_ACC_MEAN)) is not None]
    last = evals[-1] if evals else {}
    summary, prog = _json(run / "summary.json"), _json(run / "progress.json")
    spr = _number(prog.get("seconds_per_round"))
    if summary:  # the final evaluation (a resumed finished run may have no evaluated row of its own)
        final = summary.get("final", {})
        acc, p10 = _number(final.get(SEEN_TEST_ACC_MEAN)), _number(final.get(SEEN_TEST_ACC_P10))
    else:
        acc, p10 = _number(last.get(SEEN_TEST_ACC_MEAN)), _number(last.get(SEEN_TEST_ACC_P10))
    r = max((_number(x.get("round"), int) or 0 for x in rows), default=0)
    r = max(r, _number(prog.get("round"), int) or 0, _number(summary.get("rounds"), int) or 0)
    return Status(run, label, r, rounds, acc, p10, _number(last.get("round"), int),
                  sum(_number(x.get("dropped"), int) or 0 for x in rows),
                  sum(_number(x.get("excluded"), int) or 0 for x in rows), spr, bool(summary), _running(run))


def _json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(read_text(path, 1 << 24, "run file", WatchError))
    except (OSError, FileCheckError, WatchError, ValueError):  # not there (yet), or being replaced
        return {}
    return out if isinstance(out, dict) else {}


def watch(path: str | Path, interval: float = 2.0, once: bool = False, stream: TextIO | None = None,
          wait: float = 60.0) -> int:
    """Follow the run(s) in ``path`` (see the module docstring); 0 when all finished, 1 when one stopped unfinished.
    A directory with no run yet is waited for up to ``wait`` seconds (a run started just after ``watch``)."""
    out = stream if stream is not None else sys.stdout
    path = Path(path)
    if not interval > 0:
        raise WatchError(f"--interval {interval}: expected a positive number of seconds")
    deadline = time.monotonic() + wait
    while True:
        try:
            runs = runs_in(path)
            break
        except WatchError:
            if once or time.monotonic() >= deadline:
                raise
            time.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))
    shown: dict[Path, str] = {}
    while True:
        states = [status(r) for r in (runs if once else runs_in(path))]  # seeds may appear as it runs
        for s in states:
            text = s.line()
            if once or shown.get(s.path) != text:
                print(text, file=out, flush=True)
                shown[s.path] = text
        if once:
            return 0 if all(s.finished for s in states) else 1 if any(s.running is False for s in states) else 0
        if all(s.finished for s in states):
            return 0
        stopped = [s for s in states if not s.finished and s.running is False]
        if stopped:
            time.sleep(min(interval, 1.0))  # the run may have just written summary.json and released its lock
            stopped = [s for s in (status(x.path) for x in stopped) if not s.finished]
            for s in stopped:
                top = s.path.parent if s.path.name.startswith("seed-") else s.path
                print(f"{s.path}: stopped at round {s.round}{f'/{s.rounds}' if s.rounds else ''} (no process holds "
                      f"it); continue it with: fedmtl run --resume --out {top} (a Flower run: the same flwr run)",
                      file=out, flush=True)
            if stopped:
                return 1
            continue
        time.sleep(interval)


__all__ = ["Status", "WatchError", "runs_in", "status", "watch"]
