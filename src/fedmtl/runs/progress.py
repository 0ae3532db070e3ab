"""What a run tells its user while it runs, wherever it runs.

* On a terminal (stderr is a TTY with a width): a progress bar (tqdm) per run that stays on screen with its last
  state (round, loss, accuracy), and one line per long phase.
* Anywhere else (nohup, a batch scheduler, a pipe, a CI log): plain lines, flushed at once: one per long phase
  (``building data: 300 clients, 67758 training examples, 12.6 s``) and one per evaluated round
  (``fedem round 20/200  loss 0.4213  acc 73.84%  p10 69.43%  0.071 s/round``).  With ``-v`` a line for every
  round.
* ``-q``: nothing but errors.

``Progress(mode)``: ``"auto"`` picks the bar or the lines by whether stderr is a terminal; ``"lines"`` forces
lines; ``"off"`` is silent.  The command line sets the process-wide default (``set_default``) from ``-q`` /
``-v`` / ``--no-progress``; ``fedmtl.run`` is silent unless asked (``progress=True``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, TextIO

from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10, UNSEEN_TEST_ACC_MEAN

Mode = Literal["auto", "bar", "lines", "off"]

# what ``progress=True`` means, for the command being run (``fedmtl.cli.main`` sets it for its command and resets it
# after: a context variable, not process-wide state, so commands run one after another in one process -- tests,
# notebooks -- never see each other's settings)
_DEFAULT: ContextVar[tuple[Mode, bool]] = ContextVar("fedmtl_progress_default", default=("auto", False))


@contextmanager
def default(mode: Mode, verbose: bool = False) -> Iterator[None]:
    """Within the block, ``Progress(True)`` uses ``mode`` (and logs every round with ``verbose``)."""
    token = _DEFAULT.set((mode, verbose))
    try:
        yield
    finally:
        _DEFAULT.reset(token)


def resolve(progress: bool | str) -> Mode:
    """``True`` -> the process default; ``False`` -> "off"; a mode name -> itself."""
    if progress is True:
        return _DEFAULT.get()[0]
    if progress is False:
        return "off"
    if progress not in ("auto", "bar", "lines", "off"):
        raise ValueError(f"progress must be True, False, 'auto', 'bar', 'lines' or 'off', got {progress!r}")
    return progress  # type: ignore[return-value]


def _sized_terminal(stream: TextIO) -> bool:
    """A terminal with a width (a pseudo-terminal of size 0x0, as some CI runners open, gets lines: a bar
    there renders empty)."""
    try:
        return bool(stream.isatty()) and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


def format_row(row: dict[str, Any], loss_label: str = "loss") -> str:
    """A round's row (or a summary's ``final``) as ``loss 0.4213  acc 73.84%  p10 69.43%  ...`` (``loss_label``:
    what the loss measures, ``Algorithm.loss_label``)."""
    parts = [f"{loss_label} {row['train_loss']:.4f}"] if isinstance(row.get("train_loss"), float) else []
    for key, label in ((SEEN_TEST_ACC_MEAN, "acc"), (SEEN_TEST_ACC_P10, "p10"),
                       (UNSEEN_TEST_ACC_MEAN, "unseen")):
        if isinstance(row.get(key), float):
            parts.append(f"{label} {100 * row[key]:.2f}%")
    if "epsilon" in row and isinstance(row["epsilon"], float):
        parts.append(f"eps {row['epsilon']:.3g}")
    for key in ("dropped", "excluded"):  # clients lost this round (stragglers, failed nodes; NaN/Inf updates)
        if isinstance(row.get(key), int) and row[key] > 0:
            parts.append(f"{key} {row[key]}")
    return "  ".join(parts)


class Progress:
    """Progress of one or more runs (the replicas of a run with several seeds) and of the phases around them."""

    def __init__(self, progress: bool | str = True, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        mode = resolve(progress)
        if mode == "auto":
            mode = "bar" if _sized_terminal(self.stream) else "lines"
        self.mode: Mode = mode
        self.verbose = _DEFAULT.get()[1] and mode != "off"
        self._bars: dict[str, Any] = {}
        self._last_eval: dict[str, dict[str, str]] = {}  # per run: the last evaluation, kept on its bar
        self._since: dict[str, list[float]] = {}  # key -> [seconds, rounds] since its last line
        self._loss: dict[str, str] = {}  # key -> what its loss measures (Algorithm.loss_label)

    def line(self, text: str) -> None:
        if self.mode == "off":
            return
        if self._bars:
            from tqdm import tqdm

            tqdm.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[dict[str, Any]]:
        """A long phase: yields a dict the caller may fill with details (printed after ``what``)."""
        info: dict[str, Any] = {}
        t0 = time.perf_counter()
        yield info
        details = ", ".join(f"{v} {k}" if isinstance(v, int) else f"{k} {v}" for k, v in info.items())
        self.line(f"{what}: {details + ', ' if details else ''}{time.perf_counter() - t0:.1f} s")

    def start(self, key: str, label: str, total: int, initial: int = 0, loss_label: str = "loss") -> None:
        """A run ``key`` of ``total`` rounds begins (at round ``initial`` when it resumes); ``loss_label`` names what
        its training loss measures."""
        self._loss[key] = loss_label
        if self.mode == "bar":
            from tqdm import tqdm

            self._bars[key] = tqdm(total=total, initial=initial, desc=label, leave=True, file=self.stream,
                                   dynamic_ncols=True)
        elif initial:
            self.line(f"{label} resumes at round {initial}/{total}")

    def round(self, key: str, label: str, total: int, row: dict[str, Any], seconds: float) -> None:
        """Round ``row["round"]`` of run ``key`` is done (``seconds``: its training time; a line shows the mean
        over the rounds since the previous line)."""
        if self.mode == "bar":
            bar = self._bars.get(key)
            if bar is not None:
                name = self._loss.get(key, "loss")
                post = {name: f"{row['train_loss']:.4f}"} if isinstance(row.get("train_loss"), float) else {}
                if isinstance(row.get(SEEN_TEST_ACC_MEAN), float):  # the last evaluation stays on the bar
                    last = {"acc": f"{100 * row[SEEN_TEST_ACC_MEAN]:.2f}%"}
                    if isinstance(row.get(SEEN_TEST_ACC_P10), float):
                        last["p10"] = f"{100 * row[SEEN_TEST_ACC_P10]:.2f}%"
                    last["eval"] = f"r{row['round']}"
                    self._last_eval[key] = last
                post.update(self._last_eval.get(key, {}))
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            return
        acc = self._since.setdefault(key, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1
        evaluated = SEEN_TEST_ACC_MEAN in row or UNSEEN_TEST_ACC_MEAN in row
        if evaluated or self.verbose or row.get("round") == total:
            self.line(f"{label} round {row['round']}/{total}  {format_row(row, self._loss.get(key, 'loss'))}  "
                      f"{acc[0] / acc[1]:.3f} s/round")
            self._since[key] = [0.0, 0]

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


__all__ = ["Progress", "default", "format_row", "resolve"]
