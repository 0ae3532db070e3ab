"""Node-local data: one ``.npz`` file per client, the format a site's SuperNode reads (``data-dir``).

Layout of a data directory::

    dataset.json        {"format": "fedmtl-npz/1", "num_classes": C, "meta": {...}}   (2 <= C <= 10^6; meta: public
                        metadata only, ``fedmtl.data.federated.public_meta``)
    client_<k>.npz      x_train, y_train, x_test, y_test[, x_val, y_val]  for client k (its federation-wide id)

* ``k`` is a non-negative integer, the client's id in the whole federation; a node may hold any subset of
  the ids, the nodes of one deployment together hold 0..N-1, each id on one node only.
* ``x_*`` have shape ``(n, *feature_shape)``, the same feature shape and dtype for every client of every
  node (float features are trained in float32; integer features, e.g. token ids, stay integer);
  ``y_*`` are 1-d integer class labels in ``[0, num_classes)``.  A client needs at least one training
  example; test and validation splits may be empty.  ``x_val`` and ``y_val`` come together, and either every
  client of a node has them or none does.
* Files are read with ``numpy.load(allow_pickle=False)``: object arrays are refused, never unpickled.

``export`` writes any federation in this format (``fedmtl data export CONFIG --out DIR --clients A-B``; a
directory that holds an export is replaced only with ``--overwrite``);
``load_dir`` reads one back as a ``FederatedData`` of the directory's clients plus their ids.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..files import atomic, check_file, read_json
from ..ranges import parse_ids
from ..schema import shown
from .federated import DataError, FederatedData, public_meta

FORMAT = "fedmtl-npz/1"
MAX_CLASSES = 10**6  # classes a data directory may declare (a model's output layer has one unit each)
_NAME = re.compile(r"client_(\d+)\.npz")


def parse_range(spec: str, n: int) -> list[int]:
    """``"A-B"`` (inclusive), ``"A,B,C"`` or a mix, as sorted distinct ids in [0, n) (``fedmtl.ranges``: checked
    against ``n`` before any list is built)."""
    return parse_ids(spec, n, "--clients", DataError)


def held(out: str | Path) -> list[str]:
    """The files of a data export that ``out`` already holds (its ``client_<k>.npz`` files, then ``dataset.json``)."""
    out = Path(out)
    if not out.is_dir():
        return []
    names = sorted((f.name for f in out.iterdir() if _NAME.fullmatch(f.name)),
                   key=lambda n: int(n[len("client_"):-len(".npz")]))
    return names + (["dataset.json"] if (out / "dataset.json").exists() else [])


def check_target(out: str | Path, overwrite: bool = False) -> None:
    """Refuse, before anything is built or written, an export into a directory that already holds one (a site's
    data is replaced only with ``overwrite``)."""
    have = held(out)
    if have and not overwrite:
        raise DataError(f"{out} already holds {', '.join(have[:3])}{' ...' if len(have) > 3 else ''} (a data export); "
                        "nothing was changed: replace it with --overwrite (overwrite=True), or export into another "
                        "directory (--out)")


def export(data: FederatedData, out: str | Path, clients: list[int], overwrite: bool = False) -> Path:
    """Write the seen clients ``clients`` of ``data`` to ``out`` (one ``client_<k>.npz`` each, plus
    ``dataset.json``); files are written atomically.  The export holds those clients' examples and nothing about
    any other client: ``dataset.json`` gets the dataset's name, its number of classes and only its public
    metadata (``public_meta``: what a model needs, plus keys the dataset lists in ``meta["public_keys"]``), never
    a generator's parameters or other clients' sizes, mixture weights or latent labels.

    A directory that already holds an export is refused unless ``overwrite``; then its ``dataset.json`` is removed
    first, the clients' files are replaced, other clients' files removed, and ``dataset.json`` written last, so
    that an export cut short is never read as a data directory (``load_dir`` needs ``dataset.json``)."""
    out = Path(out)
    n = data.seen.num_clients
    bad = [k for k in clients if not 0 <= k < n]
    if bad:
        raise DataError(f"clients {bad[:5]} out of range: the federation has {n} seen clients")
    check_target(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)
    for k in clients:
        arrays: dict[str, Any] = {}  # np.savez's keyword arrays
        for split, s in data.seen.splits().items():
            x, y = s.client(k)
            arrays[f"x_{split}"], arrays[f"y_{split}"] = x.numpy(), y.numpy()
        with atomic(out / f"client_{k}.npz", "wb") as fh:
            np.savez(fh, **arrays)
    keep = {f"client_{k}.npz" for k in clients}
    for name in held(out):  # another export's clients: the directory would hold data that is not this site's
        if name != "dataset.json" and name not in keep:
            (out / name).unlink()
    info = {"format": FORMAT, "name": data.name, "num_classes": data.num_classes,
            "meta": public_meta(data.meta, data.name)}
    with atomic(out / "dataset.json") as fh:
        fh.write(json.dumps(info, indent=1))
    return out


def _read_info(path: Path) -> dict[str, Any]:
    f = path / "dataset.json"
    if not f.is_file():
        raise DataError(f"{path}: no dataset.json (a data directory holds dataset.json and client_<k>.npz files; "
                        "'fedmtl data export' writes one)")
    try:  # kind and size first: a FIFO or a device given as dataset.json is refused, not read
        info = read_json(f, 1 << 20, "dataset description", DataError)
    except DataError:
        raise
    except OSError as e:
        raise DataError(f"{f}: not readable ({e.strerror or e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise DataError(f"{f}: not a fedmtl data directory description (\"format\" must be {FORMAT!r})")
    c = info.get("num_classes")
    if isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= MAX_CLASSES:
        raise DataError(f"{f}: num_classes must be an integer in [2, {MAX_CLASSES}], got {shown(c)}")
    if not isinstance(info.get("meta", {}), dict):
        raise DataError(f"{f}: meta must be a JSON object")
    return info


def _check_headers(f: Path) -> None:
    """Each array's header against the bytes its member holds: a header that claims more (a shape of 10^12 rows in a
    few bytes) is refused before numpy allocates it."""
    import math

    with zipfile.ZipFile(f) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with zf.open(info) as m:
                version = np.lib.format.read_magic(m)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read(m)
            need = math.prod(shape) * dtype.itemsize
            if need > info.file_size:
                raise DataError(f"{f}: array {info.filename[:-4]!r} claims shape {shown(shape)} ({need:,} bytes) "
                                f"but holds {info.file_size:,} bytes")


def _read_client(f: Path, train_only: bool = False) -> dict[str, np.ndarray]:
    from ..machine import physical_memory

    try:
        check_file(f, physical_memory(), "client data (.npz)", DataError)  # never np.load a FIFO or a device
        _check_headers(f)
        with np.load(f, allow_pickle=False) as z:
            names = [n for n in z.files if not train_only or n in ("x_train", "y_train")]
            arrays = {name: z[name] for name in names}
            if train_only:  # the test split's shape only (an npz member is read on access)
                for need in ("x_test", "y_test"):
                    if need not in z.files:
                        raise DataError(f"{f}: missing array {need!r} (has {sorted(z.files)})")
                arrays["x_test"] = np.zeros((0, *arrays["x_train"].shape[1:]), arrays["x_train"].dtype)
                arrays["y_test"] = np.zeros(0, np.int64)
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as e:
        raise DataError(f"{f}: not a readable .npz file ({type(e).__name__}: {str(e)[:200]})") from None
    for need in ("x_train", "y_train", "x_test", "y_test"):
        if need not in arrays:
            raise DataError(f"{f}: missing array {need!r} (has {sorted(arrays)})")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise DataError(f"{f}: x_val and y_val must come together")
    extra = set(arrays) - {"x_train", "y_train", "x_test", "y_test", "x_val", "y_val"}
    if extra:
        raise DataError(f"{f}: unexpected arrays {sorted(extra)}")
    return arrays


def load_dir(path: str | Path, train_only: bool = False) -> tuple[Tensor, FederatedData]:
    """The clients of a data directory: their ids (sorted, long) and their data (seen clients in id order).
    Every problem (missing or corrupt file, wrong keys, shapes, dtypes, labels) is a ``DataError`` naming
    the file.  ``train_only``: read the training split only (test splits empty, no validation split)."""
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a name too long, a loop of links: not a directory to read
        shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:77]}..."
        raise DataError(f"data-dir {shown}: {e.strerror or e}") from None
    if not is_dir:
        raise DataError(f"data-dir {path}: no such directory")
    info = _read_info(path)
    files = {}
    for f in path.iterdir():
        m = _NAME.fullmatch(f.name)
        if m:
            files[int(m.group(1))] = f
        elif f.suffix == ".npz":
            raise DataError(f"{f}: client files are named client_<k>.npz with k the client's federation-wide id")
    if not files:
        raise DataError(f"data-dir {path}: no client_<k>.npz files")
    ids = sorted(files)
    per: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": [], "val": []}
    has_val = None
    for k in ids:
        a = _read_client(files[k], train_only)
        if has_val is None:
            has_val = "x_val" in a
        elif has_val != ("x_val" in a):
            raise DataError(f"{files[k]}: either every client of {path} has x_val/y_val or none does")
        for split in ("train", "test", "val"):
            if f"x_{split}" not in a:
                continue
            x, y = a[f"x_{split}"], a[f"y_{split}"]
            if x.dtype == object or y.dtype == object:
                raise DataError(f"{files[k]}: object arrays are not allowed")
            if y.dtype.kind not in "iu":
                raise DataError(f"{files[k]}: y_{split} must hold integer class labels, got {y.dtype}")
            per[split].append((x, y))
    try:
        data = FederatedData.from_arrays(per["train"], per["test"], per["val"] if has_val else None,
                                         num_classes=int(info["num_classes"]), name=str(info.get("name", path.name)),
                                         meta=dict(info.get("meta", {})))
    except DataError as e:
        # from_arrays numbers clients by position: name the file instead
        msg = re.sub(r"client (\d+)", lambda m: f"client_{ids[int(m.group(1))]}.npz", str(e))
        raise DataError(f"data-dir {path}: {msg}") from None
    return torch.tensor(ids, dtype=torch.long), data


def npz_folder(path: str, train_only: bool = False) -> FederatedData:
    """``[data] name = "npz_folder"``: your own per-client data from the command line, a folder in the format above
    (what ``fedmtl data export`` writes: ``dataset.json`` and one ``client_<k>.npz`` per client).  Its clients are
    the run's seen clients in the order of their ids (ids with gaps are numbered 0..N-1 in that order).
    ``train_only``: read the training splits only."""
    if not path:
        raise DataError("[data] npz_folder needs path = the folder of dataset.json and client_<k>.npz files")
    return load_dir(Path(path).expanduser(), train_only)[1]


__all__ = ["FORMAT", "check_target", "export", "held", "load_dir", "npz_folder", "parse_range"]
