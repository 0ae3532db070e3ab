"""What every fuzz case of ``tests/test_fuzz_*.py`` checks, in one place: a case ends in bounded time (``bounded``: a
SIGALRM deadline, an address-space limit, and a watchdog process that unblocks any FIFO a reader or writer hangs on),
and
either is refused cleanly -- one line on stderr (or one exception message), exit code 2, the file and the key named,
long values cut -- or gives a sane result.  A traceback (any other exception), a hang, a runaway allocation or
accepted nonsense fails the case."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: the longest refusal line accepted: a value echoed in full (a 20,000-character --set value) is a bug
MAX_LINE = 1000


class CaseTimeout(BaseException):
    """Raised by the alarm: the case ran past its deadline."""


class Accepted(BaseException):
    """Raised by a stand-in for heavy work (a Flower simulation, a benchmark): the input reached it."""


#: the smallest config the suites run: 4 clients, one round, no checkpoint
TINY = """
[data]
name = "fedem_synthetic"
num_clients = 4
dim = 3
n_test = 8
max_samples = 30
seed = 1

[model]
name = "linear"

[algorithm]
name = "fedem"
num_components = 2

[optim]
lr = 0.1

[run]
rounds = 1
batch_size = 8
eval_every = 1
checkpoint_every = 0
seed = 3
"""

def _alarm(signum: int, frame: object) -> None:
    raise CaseTimeout()


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


_WATCHDOG = """
import os, stat, sys, time
after, roots = float(sys.argv[1]), sys.argv[2:]
time.sleep(after)
while True:
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = os.path.join(dirpath, n)
                try:
                    if not stat.S_ISFIFO(os.lstat(p).st_mode):
                        continue
                except OSError:
                    continue
                try:  # succeeds only while a reader holds it open: a reader blocked on it
                    fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                    print("fired", flush=True)
                    os.close(fd)
                except OSError:
                    pass
                try:  # releases a writer blocked on it (always succeeds: no evidence of a hang)
                    os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    time.sleep(0.05)
"""


class _FifoWatchdog:
    """A separate process that, after ``after`` seconds, opens every FIFO under ``roots`` from the other end
    (non-blocking) and closes it again, so that a reader (or writer) blocked on it sees EOF and the case ends;
    ``fired`` says that it had to.  A process, not a thread: a loader blocked in native code may hold the GIL."""

    def __init__(self, roots: list[Path], after: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(after), *map(str, roots)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.fired = False

    def stop(self) -> None:
        self.proc.kill()
        out, _ = self.proc.communicate()
        self.fired = b"fired" in out


@contextlib.contextmanager
def bounded(seconds: int = 20, memory: int = 1 << 30, fifo_roots: list[Path] | None = None,
            what: str = "case") -> Iterator[None]:
    """Run the block under a ``seconds`` deadline (SIGALRM), with at most ``memory`` more bytes of address space
    than now (a list of 10^9 ids fails with MemoryError instead of taking the machine's memory), and with FIFOs
    under ``fifo_roots`` unblocked after ``seconds / 2``; fails the test on a timeout or a FIFO hang."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + memory
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    dog = _FifoWatchdog(fifo_roots, seconds / 2) if fifo_roots else None
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.alarm(seconds)
    try:
        yield
    except CaseTimeout:
        pytest.fail(f"{what} ran past {seconds} s (a hang)")
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)
        if dog is not None:
            dog.stop()
    if dog is not None and dog.fired:
        pytest.fail(f"{what} blocked on a FIFO (it was read or opened without checking its kind)")


def check_line(text: str, names: tuple[str, ...], what: str) -> None:
    """``text`` is one refusal line of bounded length naming every one of ``names``."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"{what}: {len(lines)} lines instead of one: {text[:2000]}"
    line = lines[0]
    assert "Traceback" not in line, f"{what}: {line[:2000]}"
    assert len(line) <= MAX_LINE, f"{what}: a {len(line)}-character line (values must be cut): {line[:300]}..."
    for n in names:
        assert n in line, f"{what}: the refusal does not name {n!r}: {line}"


def run_cli(argv: list[str], capsys: Any, seconds: int = 20, fifo_roots: list[Path] | None = None,
            memory: int = 1 << 30, memory_error_fails: bool = True) -> tuple[int, str, str]:
    """``fedmtl ARGV`` in this process, bounded: (exit code, stdout, stderr); argparse's own refusals (exit 2 after
    its usage lines) count as exit code 2 with the error line as stderr; any other exception fails the case."""
    from fedmtl.cli import main

    what = "fedmtl " + " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv)
    with bounded(seconds, memory, fifo_roots, what):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage, then "fedmtl ...: error: ..." on its last line
            code = e.code if isinstance(e.code, int) else 2
            out, err = capsys.readouterr()
            lines = err.strip().splitlines()
            return code, out, (lines[-1] if lines and "error:" in lines[-1] else err)
        except (CaseTimeout, Accepted):
            raise
        except MemoryError:
            if memory_error_fails:
                pytest.fail(f"{what}: ran out of its {memory >> 20} MiB memory bound (a huge file or value read "
                            "whole)")
            raise
        except BaseException as e:  # noqa: BLE001 (a traceback: the bug this suite looks for)
            pytest.fail(f"{what} raised {type(e).__name__}: {str(e)[:300]}")
    out, err = capsys.readouterr()
    return code, out, err


def expect_refused(argv: list[str], capsys: Any, *names: str, seconds: int = 20,
                   fifo_roots: list[Path] | None = None) -> str:
    """``fedmtl ARGV`` refuses in one line naming ``names`` with exit code 2; returns the line."""
    what = "fedmtl " + " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv)
    try:
        code, _, err = run_cli(argv, capsys, seconds, fifo_roots, memory_error_fails=False)
    except MemoryError:
        pytest.fail(f"{what}: ran out of its 1 GiB memory bound (a huge value materialized)")
    except Accepted as e:
        pytest.fail(f"{what}: accepted (reached {e})")
    assert code == 2, f"{what}: exit code {code}, stderr {err[:500]!r}"
    check_line(err, names, what)
    return err.strip()


def expect_error(fn: Callable[[], Any], *names: str, what: str, seconds: int = 20,
                 fifo_roots: list[Path] | None = None, errors: tuple[type[BaseException], ...] = (ValueError,)
                 ) -> str:
    """``fn()`` (a loader) refuses with one of ``errors`` (what the command line reports as invalid input, exit 2):
    one line naming ``names``, of bounded length; returns the message.  A result, another exception, a hang or a
    runaway allocation fails the case."""
    try:
        with bounded(seconds, 1 << 30, fifo_roots, what):
            try:
                got = fn()
            except errors as e:
                msg = " ".join([str(e), *getattr(e, "__notes__", [])])
            except (CaseTimeout, MemoryError):
                raise
            except BaseException as e:  # noqa: BLE001
                pytest.fail(f"{what}: raised {type(e).__name__} instead of a clear refusal: {str(e)[:300]}")
            else:
                pytest.fail(f"{what}: accepted, returned {str(got)[:200]}")
    except MemoryError:
        pytest.fail(f"{what}: ran out of its 1 GiB memory bound (a huge value materialized)")
    check_line(msg, names, what)
    return msg


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def make_huge(path: Path, size: int = 1 << 40) -> Path:
    """A sparse file of ``size`` bytes (no disk used): what a loader must refuse by its size before reading."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path
