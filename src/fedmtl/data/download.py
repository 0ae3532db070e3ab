"""Finding, downloading and caching dataset files, with checksums and atomic writes.

A dataset file is looked for, in order, in the ``data_dir`` the user gives, in the system locations
(e.g. /usr/share/datasets/fashion-mnist from the Debian package ``dataset-fashion-mnist``), and in
the cache (``$FEDMTL_CACHE`` or ``~/.cache/fedmtl``); failing that it is downloaded into the cache,
written to a temporary file, checked against its MD5 and only then renamed into place, so an
interrupted or corrupt download never leaves a partial file behind.  Offline with no local copy,
the error says where it looked and what to download.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..files import signals_deferred
from .federated import DataError


@dataclass(frozen=True)
class Remote:
    """One downloadable file: its name, URL(s) and MD5 (empty md5 = not checked)."""

    filename: str
    urls: tuple[str, ...]
    md5: str = ""


def cache_dir() -> Path:
    return Path(os.environ.get("FEDMTL_CACHE", Path.home() / ".cache" / "fedmtl"))


def md5sum(path: Path, chunk: int = 1 << 20) -> str:
    from ..files import check_file

    check_file(path, 1 << 50, "dataset file", DataError)  # a FIFO or a device in the data folder: refused, not read
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download(remote: Remote, dest_dir: Path, timeout: float = 60.0) -> Path:
    """Download ``remote`` into ``dest_dir`` atomically; verify its checksum; return the path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / remote.filename
    errors = []
    for url in remote.urls:
        tmp = None
        try:
            with signals_deferred():  # the name reaches the cleanup below whenever the file exists
                fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{remote.filename}.", suffix=".part")
            with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310
                while block := r.read(1 << 20):
                    f.write(block)
            if remote.md5 and md5sum(Path(tmp)) != remote.md5:
                raise DataError(f"{url}: checksum mismatch (expected md5 {remote.md5})")
            os.replace(tmp, dest)
            return dest
        except (urllib.error.URLError, OSError, DataError) as e:
            errors.append(f"{url}: {e}")
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    raise DataError(f"could not download {remote.filename}: " + "; ".join(errors))


def packaged_md5(path: Path) -> str | None:
    """The MD5 a Debian package recorded for ``path`` (``/var/lib/dpkg/info/<package>.md5sums``), if any.
    Debian's dataset packages recompress the original files, so the publisher's MD5 does not apply to them."""
    info = Path("/var/lib/dpkg/info")
    if not info.is_dir():
        return None
    rel = str(path.resolve()).lstrip("/")
    for lst in info.glob("*.md5sums"):
        if "dataset" not in lst.name:
            continue
        try:
            for line in lst.read_text().splitlines():
                digest, _, name = line.partition("  ")
                if name.strip() == rel:
                    return digest.strip()
        except OSError:
            continue
    return None


def verify_local(path: Path, remote: Remote) -> None:
    """Refuse a local copy whose MD5 differs from the known one (the publisher's, or the installing package's).
    ``FEDMTL_VERIFY_MD5=0`` skips the check (a copy you made yourself, e.g. a test's small file)."""
    if os.environ.get("FEDMTL_VERIFY_MD5", "1") == "0":
        return
    want = packaged_md5(path) or remote.md5
    if not want:
        return
    got = md5sum(path)
    if got != want:
        raise DataError(f"{path}: MD5 {got} differs from the known {want}: a corrupt or modified copy. Delete it "
                        "to download it afresh, or set FEDMTL_VERIFY_MD5=0 to use a copy you trust")


def locate(
    remote: Remote, name: str, data_dir: str | Path = "", system_dirs: tuple[str, ...] = (), allow_download: bool = True
) -> Path:
    """Path of ``remote.filename``: user dir, system dirs, cache, else download into the cache.  A local copy is
    checked against its known MD5 (``verify_local``) before it is used."""
    candidates = [Path(data_dir)] if data_dir else []
    candidates += [Path(d) for d in system_dirs] + [cache_dir() / name]
    for d in candidates:
        p = d / remote.filename
        if p.is_file():
            verify_local(p, remote)
            return p
    if not allow_download:
        raise DataError(f"{remote.filename} not found in {[str(c) for c in candidates]} and downloading is off")
    try:
        return download(remote, cache_dir() / name)
    except DataError as e:
        raise DataError(
            f"{name}: {remote.filename} not found locally (looked in {[str(c) for c in candidates]}) and the "
            f"download failed ({e}). Download it from {remote.urls[0]} into one of those folders "
            "or pass data_dir."
        ) from None
