"""Run directories that lose nothing: one run at a time (a lock file), results never overwritten by accident,
``--resume`` only where there is something to resume, and no debris from killed writes.

``RunDirectory(path, resume, overwrite)`` is a context manager around a run:

* ``.lock`` is created exclusively (``O_CREAT | O_EXCL``) and holds the owner's host and pid; a second run into
  the same directory is refused, naming the owner.  A lock left by a process that no longer exists on this host
  is taken over (with a warning).
* A directory that holds results (``checkpoint.pt``, ``summary.json`` or ``metrics.csv``) is refused unless the
  run resumes it (``resume``) or replaces it (``overwrite``: the old results are deleted first).
* ``resume`` without ``checkpoint.pt`` is an error (nothing would be resumed).
* Temporary files of interrupted atomic writes (``.*.tmp``) are removed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
from pathlib import Path
from types import TracebackType

log = logging.getLogger("fedmtl")

RESULTS = ("checkpoint.pt", "summary.json", "metrics.csv")
OUTPUTS = (*RESULTS, "clients.csv", "accuracy.png", "config.toml")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (locked, holds results, nothing to resume)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirectory:
    def __init__(self, path: str | Path, resume: bool = False, overwrite: bool = False):
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite exclude each other")
        self.path, self.resume, self.overwrite = Path(path), resume, overwrite
        self.lock = self.path / ".lock"
        self._held = False

    def _acquire(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    host, pid = self.lock.read_text().split()
                except (OSError, ValueError):
                    host, pid = "", "0"
                if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                    log.warning("%s: taking over the lock of process %s, which no longer runs", self.path, pid)
                    self.lock.unlink(missing_ok=True)
                    continue
                raise RunDirError(f"{self.path} is in use by another run (process {pid} on {host or '?'}; "
                                  f"lock file {self.lock}); choose another --out, or delete the lock if that "
                                  "process is gone") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self._held = True
            return
        raise RunDirError(f"{self.path}: could not take the lock {self.lock}")

    def __enter__(self) -> RunDirectory:
        if self.resume and not (self.path / "checkpoint.pt").exists():
            raise RunDirError(f"--resume: {self.path / 'checkpoint.pt'} does not exist (nothing to resume; "
                              "run without --resume to start)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire()
        try:
            for tmp in self.path.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            held = [f for f in RESULTS if (self.path / f).exists()]
            if held and not self.resume:
                if not self.overwrite:
                    raise RunDirError(f"{self.path} already holds a run ({', '.join(held)}); pass --resume to "
                                      "continue it, --overwrite to replace it, or choose another --out")
                for f in OUTPUTS:
                    (self.path / f).unlink(missing_ok=True)
                shutil.rmtree(self.path / "client_store", ignore_errors=True)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        if self._held:
            self.lock.unlink(missing_ok=True)
            self._held = False

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def is_out_of_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


__all__ = ["RunDirError", "RunDirectory", "is_out_of_space"]
