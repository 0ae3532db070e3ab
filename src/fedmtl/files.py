"""Reading files a user or a node could have written, defensively: the kind and size of a file are checked before a
byte of it is read, so a FIFO, a device (``/dev/zero``, ``/dev/urandom``), a directory or a multi-gigabyte file given
where a config, a checkpoint or a state file belongs is refused at once with one line naming it, instead of hanging
or exhausting memory.

``check_file(path, limit, what)`` returns the size of a regular file of at most ``limit`` bytes; ``read_bytes``,
``read_text`` and ``read_json`` read one (opened non-blocking, then checked again on the open descriptor, so a file
swapped for a FIFO between the check and the open is refused too).  Errors are ``FileCheckError`` (a
``ValueError``: the command line reports it as invalid input, exit code 2) unless the caller passes its own error
class.  ``atomic(path)`` writes a file whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["FileCheckError", "atomic", "check_file", "locked", "read_bytes", "read_json", "read_text",
           "signals_deferred"]


class FileCheckError(ValueError):
    """A file that is not a regular file of acceptable size, or cannot be read."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _check(st: os.stat_result, path: Path, limit: int, what: str, error: type[Exception]) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {_kind(st.st_mode)}, not a {what} file")
    if st.st_size > limit:
        raise error(f"{path}: {st.st_size} bytes; a {what} file is at most {limit} bytes")
    return int(st.st_size)


def check_file(path: str | Path, limit: int, what: str, error: type[Exception] = FileCheckError) -> int:
    """The size of ``path`` if it is a regular file of at most ``limit`` bytes (symbolic links followed); else
    ``error`` naming the file and what is wrong.  A missing file raises ``FileNotFoundError``."""
    path = Path(path)
    return _check(os.stat(path), path, limit, what, error)


def read_bytes(path: str | Path, limit: int, what: str, error: type[Exception] = FileCheckError) -> bytes:
    """The contents of the regular file ``path`` (at most ``limit`` bytes), checked before and after opening."""
    path = Path(path)
    check_file(path, limit, what, error)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in after the check must not block the open
    try:
        _check(os.fstat(fd), path, limit, what, error)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew after the check
                raise error(f"{path}: more than {limit} bytes; a {what} file is at most {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | Path, limit: int, what: str, error: type[Exception] = FileCheckError) -> str:
    """``read_bytes`` decoded as UTF-8 (an undecodable file is ``error`` too)."""
    data = read_bytes(path, limit, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(path: str | Path, limit: int, what: str, error: type[Exception] = FileCheckError) -> Any:
    """``read_text`` parsed as JSON; malformed or too deeply nested JSON is ``error`` naming the file too."""
    text = read_text(path, limit, what, error)
    try:
        return json.loads(text)
    except ValueError as e:
        raise error(f"{path}: not readable JSON ({str(e)[:120]})") from None
    except RecursionError:
        raise error(f"{path}: not readable JSON (nested too deeply)") from None


@contextlib.contextmanager
def atomic(path: Path, mode: str = "w", private: bool = False) -> Iterator[IO[Any]]:
    """Open a unique temporary file beside ``path``; on success fsync it and rename it over ``path`` (readers see
    the old file or the new one, never a part); on failure (a full disk, Ctrl-C) delete it.  ``private``: the
    file stays 0600 (mkstemp's mode) from its first byte, for keys."""
    path = Path(path)
    tmp = None
    try:
        with signals_deferred():  # a Ctrl-C or SIGTERM between the file's creation and ``tmp`` would leave it
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, mode, newline=None if "b" in mode else "") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if not private:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) or SIGTERM arriving inside the block takes effect when the block ends, through the handler that
    was installed before it (``KeyboardInterrupt``, the command line's exit 143): a checkpoint write is never cut
    in the middle, where ``torch.save``'s own cleanup would replace the interruption with an error of its own, and a
    temporary file is never created without its name reaching the code that deletes it.
    Signal handlers belong to the main thread: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    held = {s: h for s, h in old.items() if h is not None}  # None: a handler not set from Python, left alone
    for s in held:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        # the handlers are put back with both signals blocked: a signal landing between two of them would otherwise
        # raise there and leave the other one deferring for good; one that arrived meanwhile is delivered on unblocking
        mask = getattr(signal, "pthread_sigmask", None)
        blocked = mask(signal.SIG_BLOCK, set(held)) if mask is not None else None
        try:
            for s, h in held.items():
                signal.signal(s, h)
        finally:
            if mask is not None and blocked is not None:
                mask(signal.SIG_SETMASK, blocked)
        if pending:
            first = pending[0]
            h = held[signal.Signals(first)]
            if callable(h):
                h(first, None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), first)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) while the block runs: processes that read, change and write one file
    (a study's database being created, a table several reproductions add rows to) do it one after the other."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
