"""Run directories that lose nothing: one run at a time (a lock file), results never overwritten by accident,
``--resume`` only where there is something to resume, and no debris from killed writes.

``RunDirectory(path, resume, overwrite)`` is a context manager around a run:

* ``.lock`` is created exclusively (``O_CREAT | O_EXCL``) and holds the owner's host and pid; a second run into
  the same directory is refused, naming the owner.  A lock left by a process that no longer exists on this host
  is taken over (with a warning).
* A directory that holds results (``checkpoint.pt``, ``summary.json`` or ``metrics.csv``) is refused unless the
  run resumes it (``resume``) or replaces it (``overwrite``: the old results are deleted first; with ``deferred``
  they are set aside in ``.replaced/`` and deleted by ``commit()`` once the new run is built, or put back if it
  fails before that, so that a replacing run that cannot start loses nothing).
* ``resume`` without ``checkpoint.pt`` is an error (nothing would be resumed).
* Temporary files of interrupted atomic writes (``.*.tmp``) are removed.
* ``seeds=True``: the top level of a run with several seeds (``fedmtl.runs.seeds``): the lock only; what it holds
  was checked by ``check_resumable`` first, and ``overwrite`` also removes its ``seed-*`` folders.

``layout(path)`` tells what a directory holds (nothing, a single-seed run, or a run with several seeds and which),
``check_resumable`` refuses every mismatch between a directory and a command (single-seed vs ``--seeds``, other
seeds, another configuration, naming the keys that differ) **before anything is touched**, with the command that
would resume it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from ..schema import shown

log = logging.getLogger("fedmtl")

RESULTS = ("checkpoint.pt", "summary.json", "metrics.csv")
OUTPUTS = (*RESULTS, "clients.csv", "accuracy.png", "config.toml", "privacy.json")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (locked, holds results, nothing to resume)."""


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lock(lock: Path) -> tuple[str, str] | None:
    """The (host, pid) a lock file names, or None where it is missing or unusable: not a small regular file (a FIFO,
    a device, a directory are never read), not two words, or a pid that is no process id."""
    from ..files import read_text

    try:
        host, pid = read_text(lock, 4096, "lock").split()
    except (OSError, ValueError):
        return None
    return (host, pid) if pid.isdigit() and len(pid) <= 9 else None


#: seconds after which a lock file naming no process is taken as left behind (a run writes its lock at once)
LOCK_WRITE_SECONDS = 10.0


def _stale(lock: Path) -> bool:
    """Whether ``lock`` was last written more than ``LOCK_WRITE_SECONDS`` ago (gone meanwhile: stale too)."""
    try:
        return time.time() - lock.stat().st_mtime > LOCK_WRITE_SECONDS
    except OSError:
        return True


class RunDirectory:
    def __init__(self, path: str | Path, resume: bool = False, overwrite: bool = False, *, seeds: bool = False,
                 deferred: bool = False):
        if resume and overwrite:
            raise RunDirError("resume and overwrite (--resume, --overwrite) exclude each other")
        self.path, self.resume, self.overwrite, self.seeds = Path(path), resume, overwrite, seeds
        self.lock = self.path / ".lock"
        self._held = False
        self.deferred = deferred
        self._aside: Path | None = None  # what an overwrite set aside until commit()

    def _replace(self, names: list[str]) -> None:
        """Remove ``names`` (files or folders) of the directory: at once, or (``deferred``) into ``.replaced/``."""
        present = [self.path / n for n in names if (self.path / n).exists()]
        if not self.deferred:
            for p in present:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            return
        aside = self.path / REPLACED
        aside.mkdir()
        self._aside = aside
        for p in present:
            p.rename(aside / p.name)

    def _recover(self) -> None:
        """``.replaced/`` left by a replacing run killed before it was built: the results it replaced come back."""
        aside = self.path / REPLACED
        if aside.is_dir() and not aside.is_symlink():
            log.warning("%s: putting back the results of %s (a run that was to replace them stopped before it "
                        "started)", self.path, aside)
            self._aside = aside
            self._put_back()

    def commit(self) -> None:
        """The replacing run is built: delete the results it replaces (``deferred``)."""
        if self._aside is not None:
            shutil.rmtree(self._aside, ignore_errors=True)
            self._aside = None

    def _put_back(self, clear: bool = True) -> None:
        """The replacing run failed before it was built: its outputs go (``clear``), the results it replaced come
        back."""
        aside, self._aside = self._aside, None
        if aside is None:
            return
        new = (*OUTPUTS, COMMIT, "client_store", *(d.name for d in seed_dirs(self.path).values())) if clear else ()
        for name in new:
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        for p in aside.iterdir():
            p.rename(self.path / p.name)
        aside.rmdir()

    def in_use(self) -> None:
        """Refuse, before anything is built, a directory whose lock a live process holds (``_acquire`` takes the lock
        itself later, when the run starts)."""
        owner = read_lock(self.lock)
        if owner is None:
            return
        host, pid = owner
        if host != socket.gethostname() or (pid.isdigit() and alive(int(pid))):
            raise RunDirError(f"{self.path} is in use by another run (process {pid} on {host or '?'}; lock file "
                              f"{self.lock}); choose another out directory (--out), or delete the lock if that "
                              "process is gone")

    def _acquire(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_lock(self.lock)
                if owner is None and _stale(self.lock):  # empty or unusable, and no process is writing it now
                    log.warning("%s: taking over the lock %s, which names no process (left by a run stopped as it "
                                "took it)", self.path, self.lock)
                    self.lock.unlink(missing_ok=True)
                    continue
                host, pid = owner or ("", "0")
                if host == socket.gethostname() and pid.isdigit() and not alive(int(pid)):
                    log.warning("%s: taking over the lock of process %s, which no longer runs", self.path, pid)
                    self.lock.unlink(missing_ok=True)
                    continue
                raise RunDirError(f"{self.path} is in use by another run (process {pid} on {host or '?'}; "
                                  f"lock file {self.lock}); choose another out directory (--out), or delete the "
                                  "lock if that process is gone") from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(me)
            except BaseException:  # a full disk, a kill: an empty lock left behind would hold the directory
                self.lock.unlink(missing_ok=True)
                raise
            self._held = True
            return
        raise RunDirError(f"{self.path}: could not take the lock {self.lock}")

    def __enter__(self) -> RunDirectory:
        if self.seeds:
            return self._enter_seeds()
        if self.resume and not (self.path / "checkpoint.pt").exists():
            raise RunDirError(f"resume: {self.path / 'checkpoint.pt'} does not exist (nothing to resume; "
                              "start without resume=True / --resume)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire()
        try:
            self._recover()
            for tmp in self.path.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            held = [f for f in RESULTS if (self.path / f).exists()]
            in_way = [f for f in (*held, *OUTPUTS) if (self.path / f).is_dir()]
            if in_way:  # nothing can write (nor --overwrite delete) the file a directory stands for
                raise RunDirError(f"{self.path / in_way[0]} is a directory, where a run writes its {in_way[0]} file: "
                                  "move it out of the way, or choose another out directory (--out)")
            if held and not self.resume:
                if not self.overwrite:
                    raise holds_a_run(self.path, held)
                self._replace([*OUTPUTS, "client_store"])
        except BaseException:
            self._put_back(clear=False)
            self.release()
            raise
        return self

    def _enter_seeds(self) -> RunDirectory:
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire()
        try:
            self._recover()
            for tmp in self.path.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            if self.overwrite:
                self._replace([*OUTPUTS, COMMIT, "client_store", *(d.name for d in seed_dirs(self.path).values())])
        except BaseException:
            self._put_back(clear=False)
            self.release()
            raise
        return self

    def release(self) -> None:
        if self._held:
            self.lock.unlink(missing_ok=True)
            self._held = False

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if et is None:
                self.commit()
            else:
                self._put_back()
        finally:
            self.release()


def check_output(path: str | Path, *, overwrite: bool, resume: bool | None = None,
                 names: tuple[str, ...] | None = None) -> None:
    """Refuse, before anything is built or written, a command whose output folder ``path`` already holds files
    (``names``: only these count; None: any entry), unless it continues them (``resume``; None: the command cannot)
    or replaces them (``overwrite``).  The one rule of every command that writes a folder: nothing is overwritten
    without ``--overwrite``."""
    path = Path(path)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other")
    if overwrite or resume or not path.exists():
        return
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory; choose another out directory (--out)")
    have = sorted(p.name for p in path.iterdir() if names is None or p.name in names)
    if have:
        cont = "continue it with --resume, " if resume is not None else ""
        raise RunDirError(f"{path} already holds {', '.join(have[:3])}{' ...' if len(have) > 3 else ''}; nothing "
                          f"was changed: {cont}replace it with --overwrite, or choose another out directory (--out)")


def holds_a_run(path: Path, held: list[str]) -> RunDirError:
    """The refusal of a run into ``path``, which holds the results ``held``, without resume or overwrite
    (``--resume`` offered only where there is a checkpoint to resume)."""
    return RunDirError(f"{path} already holds a run ({', '.join(held)}); " + (
        "continue it with resume=True (--resume), replace it with overwrite=True (--overwrite), or choose another out "
        "directory (--out)" if "checkpoint.pt" in held else
        "it has no checkpoint to resume: replace it with overwrite=True (--overwrite), or choose another out "
        "directory (--out)"))


def is_out_of_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


# a run with several seeds commits its replicas' checkpoints together: each writes NEXT, then the top level's
# COMMIT marker makes the group durable, then each NEXT is renamed to checkpoint.pt (fedmtl.runs.seeds)
NEXT = "checkpoint.next.pt"
COMMIT = "seeds-commit.json"
REPLACED = ".replaced"  # results an overwrite set aside until the replacing run is built (RunDirectory.commit)
_SEED = re.compile(r"seed-(\d+)")


def seed_dirs(path: Path) -> dict[int, Path]:
    """The ``seed-<S>`` folders of ``path``, by seed."""
    if not path.is_dir():
        return {}
    found = {}
    for d in path.iterdir():
        m = _SEED.fullmatch(d.name)
        if m and d.is_dir():
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


@dataclass
class Layout:
    """What a run directory holds: ``empty`` (nothing of a run), ``single`` (a single-seed run) or ``seeds`` (a run
    with several seeds: its ``seed-<S>`` folders)."""

    kind: Literal["empty", "single", "seeds"]
    seeds: list[int] = field(default_factory=list)


def layout(path: str | Path) -> Layout:
    path = Path(path)
    seeds = list(seed_dirs(path))
    if seeds:
        return Layout("seeds", seeds)
    if any((path / f).exists() for f in (*RESULTS, "config.toml")):
        return Layout("single")
    return Layout("empty")


def resume_command(path: Path, lay: Layout) -> str:
    """The command that resumes the run ``path`` holds: ``fedmtl run --resume --out DIR`` reads the directory's own
    resolved ``config.toml`` (the --set overrides included) and its seeds, so nothing else is needed."""
    return f"fedmtl run --resume --out {path}"


def run_top(path: Path) -> Path:
    """The run directory that the folder ``path`` of a checkpoint belongs to: ``DIR`` for ``DIR/seed-<S>`` of a run
    with several seeds, else ``path`` itself."""
    return path.parent if _SEED.fullmatch(path.name) and layout(path.parent).kind == "seeds" else path


def start_again(top: Path, source: str | None) -> str:
    """Advice that always works where a run cannot be resumed: the command that starts it again into a new
    directory (one that does not exist yet), or over this one with ``--overwrite``; ``source``: the user's config
    file (CONFIG where there is none)."""
    import shlex

    new = next(p for p in (Path(f"{top}-{i}") for i in range(2, 10**6)) if not p.exists())
    config = shlex.quote(source) if source and Path(source).is_file() else "CONFIG"
    seeds = layout(top).seeds
    extra = f" --seeds {','.join(map(str, seeds))}" if seeds else ""
    return (f"start it again with: fedmtl run {config}{extra} --out {shlex.quote(str(new))} (or replace it: "
            f"fedmtl run {config}{extra} --out {shlex.quote(str(top))} --overwrite)")


def resume_advice(run_dir: Path, saved: dict[str, Any], source: str | None) -> str:
    """What to do when the checkpoint of ``run_dir`` (written with the resolved config ``saved``) does not fit the
    command's config: resume with the directory's own config where that config is the checkpoint's (a command
    that succeeds), else start again (``start_again``): never the command that just failed."""
    top = run_top(run_dir)
    f = run_dir / "config.toml"
    try:
        own = _saved_config(run_dir)
    except RunDirError:
        own = None
    if own is not None and not config_diff(saved, own):
        return f"resume with the run directory's own config: {resume_command(top, layout(top))}"
    why = (f"{f} does not match {run_dir / 'checkpoint.pt'} either (one of them was edited or replaced), so no "
           "command resumes it" if own is not None or f.exists() else f"{run_dir} has no config.toml to resume with")
    return f"{why}; {start_again(top, source)}"


def _plain(x: Any) -> Any:
    """A resolved config as it reads back from TOML: tuples as lists, and no None values (TOML has none: an unset key
    and None are the same setting)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if v is not None}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``table.key: saved -> now`` for every key whose value differs between two resolved configs."""
    saved, now = _plain(saved), _plain(now)
    out = []
    for t in sorted(set(saved) | set(now)):
        a, b = saved.get(t, {}), now.get(t, {})
        if not isinstance(a, dict) or not isinstance(b, dict):
            if a != b:
                out.append(f"[{t}]")
            continue
        for k in sorted(set(a) | set(b)):
            if a.get(k, "(unset)") != b.get(k, "(unset)"):
                out.append(f"{t}.{k}: {shown(a.get(k, '(unset)'))} -> {shown(b.get(k, '(unset)'))}")
    return out


def _saved_config(path: Path) -> dict[str, Any] | None:
    from ..config import ConfigError, read_toml

    f = path / "config.toml"
    if not f.exists():
        return None
    try:
        return read_toml(f)
    except ConfigError as e:
        raise RunDirError(f"{f}: the run directory's config cannot be read ({e})") from None


def _differs(where: Path, saved: dict[str, Any] | None, now: dict[str, Any], advice: str) -> None:
    if saved is None:
        return
    diff = config_diff(saved, now)
    if diff:
        raise RunDirError(f"{where} was run with another configuration ({'; '.join(diff[:8])}"
                          f"{'; ...' if len(diff) > 8 else ''}); nothing was changed. {advice}")


def _own_configs_agree(path: Path, lay: Layout) -> bool:
    """Whether ``fedmtl run --resume --out path`` would pass ``check_resumable``: the configuration it reads (the
    top ``config.toml``, else the first seed folder's) gives each seed folder's own."""
    if lay.kind != "seeds":
        return True  # a single-seed run is resumed with its own config.toml, compared with itself
    from ..config import validate

    try:
        raw = _saved_config(path) or _saved_config(path / f"seed-{lay.seeds[0]}")
        cfg = validate(raw, str(path)) if raw is not None else None
    except ValueError:
        return False
    return cfg is not None and all(
        not config_diff(_saved_config(path / f"seed-{s}") or {}, cfg.with_seed(s).raw) for s in lay.seeds)


def check_resumable(path: str | Path, config: dict[str, Any], seeds: list[int] | None, resume: bool,
                    overwrite: bool, with_seed: Any = None, source: str | None = None) -> Layout:
    """Refuse, before anything in ``path`` is touched, a command that does not fit what ``path`` holds: a single-seed
    run asked to continue with seeds or the reverse, other seeds, another configuration (the differing keys named),
    results that would be overwritten without ``--overwrite``.  ``seeds``: the command's seeds (None: a single-seed
    run with ``config``); ``with_seed(s)``: the resolved config of seed ``s`` (to compare each seed folder's);
    ``source``: the command's config file, which the advice to start again names."""
    path = Path(path)
    lay = layout(path)
    if lay.kind == "empty" or overwrite:
        return lay
    command = resume_command(path, lay)
    if seeds is None and lay.kind == "seeds":
        raise RunDirError(f"{path} holds a run with seeds {lay.seeds} (seed-* folders), and this command runs a "
                          f"single seed; nothing was changed. Resume it with: {command}; or choose another out "
                          "directory (--out)")
    if seeds is not None and lay.kind == "single":
        raise RunDirError(f"{path} holds a single-seed run, and this command runs seeds {seeds}; nothing was changed. "
                          f"Resume it with: {command}; or choose another out directory (--out), or replace it with "
                          "overwrite=True (--overwrite)")
    if seeds is None:
        if resume:
            _differs(path, _saved_config(path), config, f"Resume it as it was with: {command}")
        elif held := [f for f in RESULTS if (path / f).is_file()]:  # refused before the data is built
            raise holds_a_run(path, held)
        return lay
    if not resume:
        raise RunDirError(f"{path} already holds a run with seeds {lay.seeds}; resume it with: {command} "
                          "(resume=True in Python); or choose another out directory (--out), or replace it with "
                          "overwrite=True (--overwrite)")
    if sorted(seeds) != lay.seeds:
        raise RunDirError(f"{path} holds seeds {lay.seeds}, and this command asks for seeds {sorted(seeds)}; nothing "
                          f"was changed. Resume it with: {command}")
    advice = (f"Resume it as it was with: {command}" if _own_configs_agree(path, lay) else
              f"Its own configs disagree (a seed folder's config.toml was edited or replaced), so no command resumes "
              f"it; {start_again(path, source)}")
    for s in lay.seeds:
        d = path / f"seed-{s}"
        _differs(d, _saved_config(d), with_seed(s) if with_seed else config, advice)
    return lay


__all__ = ["COMMIT", "NEXT", "REPLACED", "Layout", "RunDirError", "RunDirectory", "alive", "check_output",
           "check_resumable", "config_diff", "holds_a_run", "is_out_of_space", "layout", "read_lock", "resume_advice",
           "resume_command", "run_top", "seed_dirs", "start_again"]
