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

The files are read as untrusted (a run writes them, but they may be corrupt or hand-edited): each is read up to a
size bound, and each field used must have the expected type and lie in its range (rounds and counts whole numbers
below 10^12, accuracies fractions in [0, 1], seconds per round finite and below 10^7); a field that does not is left
out and named at the end of the line (``unreadable: progress.json round``), and an accuracy it would have given
shows as ``?``.  No content of these files makes ``watch`` fail.
"""

from __future__ import annotations

import csv
import io
import json
import math
import socket
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..files import FileCheckError, read_text
from .rundir import alive, read_lock, seed_dirs

_LIMIT = 64 << 20  # bytes read of metrics.csv (a run of a million rounds stays below)
_JSON_LIMIT = 16 << 20  # bytes read of summary.json and progress.json
_MAX_COUNT = 10**12  # rounds, dropped and excluded counts: larger is not a run's
_MAX_SECONDS = 1e7  # seconds per round (115 days)
#: --interval's range in seconds
INTERVAL_RANGE = (0.01, 3600.0)


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
    unreadable: tuple[str, ...] = ()  # the fields left out for a wrong type or range ("progress.json round")
    acc_unreadable: bool = False  # the accuracy's source was there but unreadable: shown as "?"

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
        elif self.acc_unreadable:
            parts.append("acc ?")
        if self.p10 is not None:
            parts.append(f"p10 {100 * self.p10:.2f}%" + (f" (round {self.eval_round})" if not self.finished
                                                         and self.eval_round is not None else ""))
        elif self.acc_unreadable:
            parts.append("p10 ?")
        parts.append(f"dropped {self.dropped}  excluded {self.excluded}")
        if self.finished:
            parts.append("finished")
        elif (eta := self.eta) is not None:
            parts.append(f"ETA {_duration(eta)}")
        if self.unreadable:
            parts.append("unreadable: " + ", ".join(self.unreadable))
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
        return pid.isascii() and pid.isdigit() and 0 < int(pid) < 1 << 22 and alive(int(pid))
    return False


class _Fields:
    """The checked fields of one run directory's files; what fails a check is named in ``bad``."""

    def __init__(self) -> None:
        self.bad: list[str] = []

    def count(self, v: Any, where: str) -> int | None:
        """A whole number in [0, 10^12] (an int, a float with no fraction or a string of either), else None."""
        if v is None or v == "":
            return None
        got = _number(v)
        if got is None or not got.is_integer() or not 0 <= got <= _MAX_COUNT:
            self.bad_field(where)
            return None
        return int(got)

    def fraction(self, v: Any, where: str) -> float | None:
        if v is None or v == "":
            return None
        got = _number(v)
        if got is None or not 0.0 <= got <= 1.0:
            self.bad_field(where)
            return None
        return got

    def seconds(self, v: Any, where: str) -> float | None:
        if v is None:
            return None
        got = _number(v)
        if got is None or not 0.0 <= got <= _MAX_SECONDS:
            self.bad_field(where)
            return None
        return got

    def bad_field(self, where: str) -> None:
        """Name ``where`` (once) as unreadable."""
        if where not in self.bad:
            self.bad.append(where)
        return None


def _number(v: Any) -> float | None:
    """A finite float from a number or a numeric string (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float | str) or (isinstance(v, str) and len(v) > 64):
        return None
    try:
        got = float(v)
    except (ValueError, OverflowError):
        return None
    return got if math.isfinite(got) else None


def _label_text(v: Any) -> str | None:
    """A config name fit for one line: a string of printable characters, cut to 40."""
    if not isinstance(v, str) or not v:
        return None
    clean = "".join(c if c.isprintable() else "?" for c in v[:41])
    return clean if len(clean) <= 40 else clean[:37] + "..."


def status(run: Path) -> Status:
    """Read ``run``'s directory as it is now (files the run replaces atomically: never half-written; any content of
    them is checked, see the module docstring)."""
    f = _Fields()
    label, rounds = run.name, None
    cfg = _toml(run / "config.toml")
    if cfg is not None:
        alg, data, rcfg = (_table(cfg, t) for t in ("algorithm", "data", "run"))
        a, d = _label_text(alg.get("name")), _label_text(data.get("name"))
        if a and d:
            label = f"{a} on {d}"
        elif "name" in alg or "name" in data:
            f.bad_field("config.toml name")
        rounds = f.count(rcfg.get("rounds"), "config.toml rounds") or None
    if run.parent != run and run.name.startswith("seed-"):
        label = f"{label} [{run.name}]"
    rows: list[dict[str, Any]] = []
    if (run / "metrics.csv").exists():
        try:
            rows = list(csv.DictReader(io.StringIO(read_text(run / "metrics.csv", _LIMIT, "metrics", WatchError))))
        except (OSError, FileCheckError, WatchError, csv.Error):
            f.bad_field("metrics.csv")
    evals = [r for r in rows if _number(r.get(SEEN_TEST_ACC_MEAN)) is not None]
    last = evals[-1] if evals else {}
    summary, prog = _json(run / "summary.json", f), _json(run / "progress.json", f)
    spr = f.seconds(prog.get("seconds_per_round"), "progress.json seconds_per_round")
    acc_bad = False
    if summary:  # the final evaluation (a resumed finished run may have no evaluated row of its own)
        final = summary.get("final", {})
        if not isinstance(final, dict):
            final = {}
            f.bad_field("summary.json final")
        acc = f.fraction(final.get(SEEN_TEST_ACC_MEAN), f"summary.json {SEEN_TEST_ACC_MEAN}")
        p10 = f.fraction(final.get(SEEN_TEST_ACC_P10), f"summary.json {SEEN_TEST_ACC_P10}")
        acc_bad = acc is None and p10 is None and bool(summary.get("final"))
    else:
        acc = f.fraction(last.get(SEEN_TEST_ACC_MEAN), f"metrics.csv {SEEN_TEST_ACC_MEAN}")
        p10 = f.fraction(last.get(SEEN_TEST_ACC_P10), f"metrics.csv {SEEN_TEST_ACC_P10}")
        acc_bad = acc is None and bool(last)
    r = max((f.count(x.get("round"), "metrics.csv round") or 0 for x in rows), default=0)
    r = max(r, f.count(prog.get("round"), "progress.json round") or 0,
            f.count(summary.get("rounds"), "summary.json rounds") or 0)
    eval_round = f.count(last.get("round"), "metrics.csv round")
    dropped = sum(f.count(x.get("dropped"), "metrics.csv dropped") or 0 for x in rows)
    excluded = sum(f.count(x.get("excluded"), "metrics.csv excluded") or 0 for x in rows)
    return Status(run, label, r, rounds, acc, p10, eval_round, dropped, excluded, spr, bool(summary), _running(run),
                  tuple(f.bad), acc_bad)


def _table(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    got = cfg.get(name)
    return got if isinstance(got, dict) else {}


def _toml(path: Path) -> dict[str, Any] | None:
    try:
        return tomllib.loads(read_text(path, 1 << 20, "run configuration", WatchError))
    except (OSError, FileCheckError, WatchError, tomllib.TOMLDecodeError, RecursionError, ValueError):
        return None


def _json(path: Path, fields: _Fields) -> dict[str, Any]:
    try:
        out = json.loads(read_text(path, _JSON_LIMIT, "run file", WatchError))
    except (OSError, FileCheckError, WatchError):  # not there (yet), being replaced, or too large
        return {}
    except (ValueError, RecursionError):  # not JSON (a value too deep, too long a number)
        fields.bad_field(path.name)
        return {}
    if not isinstance(out, dict):
        fields.bad_field(path.name)
        return {}
    return out


def _show(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)[:40]


def watch(path: str | Path, interval: float = 2.0, once: bool = False, stream: TextIO | None = None,
          wait: float = 60.0) -> int:
    """Follow the run(s) in ``path`` (see the module docstring); 0 when all finished, 1 when one stopped unfinished.
    A directory with no run yet is waited for up to ``wait`` seconds (a run started just after ``watch``)."""
    out = stream if stream is not None else sys.stdout
    path = Path(path)
    lo, hi = INTERVAL_RANGE
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not lo <= interval <= hi:
        raise WatchError(f"--interval {_show(interval)}: expected a number of seconds from {lo:g} to {hi:g}")
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
