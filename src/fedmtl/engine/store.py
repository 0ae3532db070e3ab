"""``ClientStore``: every client's state (FedEM's pi, Ditto's personal model, MOCHA's duals) kept stacked,
leaf by leaf, as (N, ...) tensors that a round reads and writes **in place for its sampled clients only**.

A round costs O(sampled clients), never O(population):

* ``read(ids)`` gathers K rows; ``write(ids, values)`` is one ``index_copy_`` per leaf.
* Rows are initialized **lazily**: a row never written holds the algorithm's initial state, produced when it
  is read by ``init_fn(ids)`` (``Algorithm.init_clients`` with the initial server).  Nothing is computed or
  written for a client before it first trains.
* ``kind = "memory"``: ordinary tensors, allocated (zeroed) for the whole population at the start.
  ``kind = "mmap"``: one ``.npy`` file per leaf in a directory of the run (``numpy.lib.format.open_memmap``):
  a file page is materialized only when a client on it is first written, and pages can be evicted, so
  personal models of a million clients need not fit in RAM.

Resuming a memory-mapped store: the files are written in place every round, while a checkpoint is taken
every few rounds.  Before a round overwrites rows, their old values go to an **undo journal**
(``undo.log``, appended and flushed before the in-place write); a checkpoint flushes the files and then
empties the journal.  Resuming from the checkpoint of round R undoes, newest first, every journaled write
of rounds >= R, which returns the files exactly to their state at the checkpoint whatever point a crash
interrupted.  A record cut short by the crash is ignored (its in-place write had not started).

A memory store's checkpoint holds the written rows only (O(clients trained so far)).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..files import atomic, check_file, read_bytes, read_json
from ..tree import Tree

StoreKind = Literal["memory", "mmap"]
_MAGIC = b"FMUL"
_END = b"END!"


class StoreError(ValueError):
    """A client store that cannot be opened or resumed (missing, corrupt or mismatching files, non-finite states)."""


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


class ClientStore:
    """Stacked per-client state of ``num_clients`` clients; see the module docstring.

    ``init_fn(ids)`` returns the initial states of the clients ``ids`` (a (k,) long tensor) stacked along a
    leading axis; its structure, shapes and dtypes are the store's.  ``directory`` is required for
    ``kind="mmap"``; ``journal`` keeps the undo journal (needed only when the run checkpoints).
    """

    def __init__(self, num_clients: int, init_fn: Callable[[Tensor], Tree], kind: StoreKind = "memory",
                 directory: str | Path | None = None, journal: bool = False, resume: bool = False):
        self.num_clients = int(num_clients)
        self.init_fn = init_fn
        self.kind = kind
        template = init_fn(torch.zeros(1, dtype=torch.long))
        flat, self._spec = pytree.tree_flatten_with_path(template)
        for path, leaf in flat:
            if not isinstance(leaf, Tensor) or leaf.dim() == 0 or leaf.shape[0] != 1:
                raise StoreError(f"client state leaf {pytree.keystr(path)} must be a tensor stacked over clients")
        self.names = [pytree.keystr(p) for p, _ in flat]
        self.row_shapes = [tuple(leaf.shape[1:]) for _, leaf in flat]
        self.dtypes = [leaf.dtype for _, leaf in flat]
        self.directory = Path(directory) if directory is not None else None
        self._journal: _UndoJournal | None = None
        self._arrays: list[np.memmap] = []
        if kind == "memory":
            # allocated and zeroed up front (O(N) once): a round then rewrites resident rows.  Left untouched, the
            # first write of each row would pay a page fault, several times a row's copy
            self.leaves = [torch.zeros((self.num_clients, *s), dtype=d) for s, d in zip(self.row_shapes, self.dtypes,
                                                                                       strict=True)]
            self.written = torch.zeros(self.num_clients, dtype=torch.bool)
        elif kind == "mmap":
            if self.directory is None:
                raise StoreError("run.client_store = 'mmap' needs a run directory for its files (give --out)")
            self._open_files(resume)
            if journal:
                self._journal = _UndoJournal(self.directory / "undo.log", self.row_shapes, self.dtypes)
        else:
            raise StoreError(f"client store kind must be 'memory' or 'mmap', got {kind!r}")

    # ------------------------------------------------------------------------------------------ files
    def _layout(self) -> dict[str, Any]:
        return {"num_clients": self.num_clients, "names": self.names, "shapes": [list(s) for s in self.row_shapes],
                "dtypes": [str(d) for d in self.dtypes]}

    def _open_files(self, resume: bool) -> None:
        d = self.directory
        assert d is not None
        layout_file = d / "layout.json"
        if resume:
            if not layout_file.exists():
                raise StoreError(f"{d}: no client store to resume (layout.json missing)")
            try:
                saved = read_json(layout_file, 1 << 20, "client store layout", StoreError)
            except StoreError:
                raise
            except OSError as e:
                raise StoreError(f"{layout_file}: unreadable ({e.strerror or e})") from None
            if saved != self._layout():
                raise StoreError(f"{layout_file}: the stored client states do not match this run's algorithm "
                                 f"(stored {saved}, expected {self._layout()})")
        else:
            d.mkdir(parents=True, exist_ok=True)
            for f in d.glob("*"):
                f.unlink()
        mode = "r+" if resume else "w+"
        self.leaves, self._arrays = [], []
        if resume:  # numpy would silently zero-extend a truncated file opened "r+": check every file first
            for i, (shape, dtype) in enumerate(zip(self.row_shapes, self.dtypes, strict=True)):
                _check_npy(d / f"leaf{i}.npy", (self.num_clients, *shape), _np_dtype(dtype), self.names[i])
            _check_npy(d / "written.npy", (self.num_clients,), np.dtype(np.bool_), "written flags")
        try:
            for i, (shape, dtype) in enumerate(zip(self.row_shapes, self.dtypes, strict=True)):
                arr = np.lib.format.open_memmap(d / f"leaf{i}.npy", mode=mode, dtype=_np_dtype(dtype),
                                                shape=(self.num_clients, *shape))
                if arr.shape != (self.num_clients, *shape):
                    raise StoreError(f"{d / f'leaf{i}.npy'}: shape {arr.shape}, expected {(self.num_clients, *shape)}")
                self._arrays.append(arr)
                self.leaves.append(torch.from_numpy(arr))
            written = np.lib.format.open_memmap(d / "written.npy", mode=mode, dtype=np.bool_, shape=(self.num_clients,))
        except (OSError, ValueError) as e:
            raise StoreError(f"{d}: cannot open the client store files ({e})") from e
        self._arrays.append(written)
        for a in self._arrays:  # clients are read and written at random: no readahead of their neighbours' pages
            mm = getattr(a, "_mmap", None)
            if mm is not None and hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_RANDOM)
        self.written = torch.from_numpy(written)
        if not resume:
            self.written.zero_()
            with atomic(layout_file) as out:
                out.write(json.dumps(self._layout()))

    # ------------------------------------------------------------------------------------------ rows
    def _unflatten(self, leaves: list[Tensor]) -> Tree:
        return pytree.tree_unflatten(leaves, self._spec)

    def read(self, ids: Tensor) -> Tree:
        """The states of clients ``ids`` (k,), stacked (k, ...): copies, initialized where never written."""
        ids = ids.to(torch.long).cpu()
        rows = [leaf.index_select(0, ids) for leaf in self.leaves]
        miss = torch.nonzero(~self.written.index_select(0, ids)).flatten()
        if miss.numel():
            init = pytree.tree_leaves(self.init_fn(ids.index_select(0, miss)))
            for r, v in zip(rows, init, strict=True):
                r.index_copy_(0, miss, v.detach().to("cpu", r.dtype).reshape(len(miss), *r.shape[1:]))
        return self._unflatten(rows)

    def write(self, ids: Tensor, values: Tree, round_idx: int = 0) -> None:
        """Overwrite the states of clients ``ids`` (distinct) with ``values`` (stacked like ``read``'s output)."""
        ids = ids.to(torch.long).cpu()
        if ids.numel() == 0:
            return
        if not self.leaves:  # a stateless algorithm: nothing to keep
            self.written.index_fill_(0, ids, True)
            return
        vals = pytree.tree_leaves(values)
        if len(vals) != len(self.leaves):
            raise StoreError(f"a client state with {len(vals)} leaves written to a store of {len(self.leaves)}")
        if self._journal is not None:
            self._journal.append(round_idx, ids, self.written.index_select(0, ids),
                                 [leaf.index_select(0, ids) for leaf in self.leaves])
        for leaf, v in zip(self.leaves, vals, strict=True):
            leaf.index_copy_(0, ids, v.detach().to("cpu", leaf.dtype))
        self.written.index_fill_(0, ids, True)

    def read_all(self) -> Tree:
        return self.read(torch.arange(self.num_clients))

    def write_all(self, values: Tree, round_idx: int = 0) -> None:
        self.write(torch.arange(self.num_clients), values, round_idx)

    @property
    def nbytes(self) -> int:
        """Bytes the full store occupies once every row is written."""
        return sum(int(np.prod(s, dtype=np.int64)) * torch.empty(0, dtype=d).element_size() * self.num_clients
                   for s, d in zip(self.row_shapes, self.dtypes, strict=True))

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the written rows (memory), or nothing but the kind (mmap: the files are the
        state; call ``commit`` once the checkpoint file is safely written)."""
        if self.kind == "mmap":
            self.flush()
            return {"kind": "mmap"}
        ids = torch.nonzero(self.written).flatten()
        return {"kind": "memory", "ids": ids, **{f"leaf{i}": leaf.index_select(0, ids)
                                                  for i, leaf in enumerate(self.leaves)}}

    def load_state_dict(self, sd: dict[str, Any], round_idx: int) -> None:
        """Restore the state saved at the checkpoint of round ``round_idx``."""
        if sd.get("kind") != self.kind:
            raise StoreError(f"the checkpoint holds a {sd.get('kind')!r} client store, this run uses {self.kind!r}")
        if self.kind == "mmap":
            if self._journal is not None:
                self._journal.rollback(round_idx, self.leaves, self.written, self.num_clients)
            self.flush()
            written = torch.nonzero(self.written).flatten()
            for name, leaf in zip(self.names, self.leaves, strict=True):
                _check_finite(name, leaf, written, f"{self.directory}")
            return
        ids = sd.get("ids")
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise StoreError("the checkpoint's client ids are not a 1-d integer tensor")
        ids = ids.to(torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_clients):
            raise StoreError(f"the checkpoint's client ids {int(ids.min())}..{int(ids.max())} are out of range "
                             f"[0, {self.num_clients}) (a checkpoint of another federation, or tampered)")
        if int(torch.unique(ids).numel()) != ids.numel():
            raise StoreError("the checkpoint's client ids repeat (tampered)")
        vals = []
        for i, (leaf, shape) in enumerate(zip(self.leaves, self.row_shapes, strict=True)):
            v = sd.get(f"leaf{i}")
            if not isinstance(v, Tensor):
                raise StoreError(f"the checkpoint has no client state {self.names[i]} (leaf{i})")
            if tuple(v.shape) != (ids.numel(), *shape) or v.dtype != leaf.dtype:
                raise StoreError(f"the checkpoint's client state {self.names[i]} has shape {tuple(v.shape)} {v.dtype}, "
                                 f"this run's algorithm keeps {(ids.numel(), *shape)} {leaf.dtype}")
            _check_finite(self.names[i], v, None, "the checkpoint")
            vals.append(v)
        self.written.zero_()
        self.write(ids, self._unflatten(vals))

    def flush(self) -> None:
        for a in self._arrays:
            a.flush()

    def commit(self) -> None:
        """After a checkpoint was written: the journal's records are no longer needed."""
        if self._journal is not None:
            self.flush()
            self._journal.truncate()

    def close(self) -> None:
        self.flush()
        if self._journal is not None:
            self._journal.close()


def _check_npy(path: Path, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    """A store file to resume: a regular ``.npy`` file whose header says ``shape`` and ``dtype`` (C order) and whose
    size is exactly its header plus that array (numpy would zero-extend a truncated one)."""
    try:
        size = check_file(path, 1 << 50, "client store", StoreError)
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0(f) if version == (1, 0) else \
                np.lib.format.read_array_header_2_0(f)
            offset = f.tell()
    except FileNotFoundError:
        raise StoreError(f"{path}: missing ({what}); the client store cannot be resumed") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: not a readable .npy file ({what}: {e})") from None
    got_shape, fortran, got_dtype = header
    if tuple(got_shape) != shape or got_dtype != dtype or fortran:
        raise StoreError(f"{path}: holds {got_dtype} {tuple(got_shape)}{' (Fortran order)' if fortran else ''}, "
                         f"expected {dtype} {shape} ({what})")
    want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != want:
        raise StoreError(f"{path}: {size} bytes, expected {want} ({what}: truncated or padded)")


def _check_finite(name: str, values: Tensor, rows: Tensor | None, where: str) -> None:
    """Refuse a client state holding NaN or Inf (in ``rows`` of it, if given), naming the leaf and a client."""
    if not values.is_floating_point():
        return
    v = values if rows is None else values.index_select(0, rows)
    if v.shape[0] == 0:  # no client written yet (none answered before the checkpoint): nothing to check
        return
    bad = ~torch.isfinite(v.reshape(v.shape[0], -1)).all(1)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        which = first if rows is None else int(rows[first])
        raise StoreError(f"{where}: client state {name} holds NaN or Inf ({int(bad.sum())} row(s), e.g. row {which}); "
                         "a corrupt or tampered state is never resumed")


class _UndoJournal:
    """Append-only records ``(round, ids, old written flags, old rows of every leaf)``; see the module docstring."""

    def __init__(self, path: Path, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]):
        from ..machine import physical_memory

        self.path = path
        self.shapes, self.dtypes = shapes, dtypes
        if path.exists() or path.is_symlink():  # a journal left by the run: a regular file it can read back
            check_file(path, physical_memory(), "client store undo journal", StoreError)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)  # never blocks on a FIFO
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for a FIFO or a device since the check
            os.close(fd)
            raise StoreError(f"{path}: not a regular file (client store undo journal)")
        os.set_blocking(fd, True)
        self._f = os.fdopen(fd, "ab")

    def append(self, round_idx: int, ids: Tensor, written: Tensor, rows: list[Tensor]) -> None:
        k = ids.numel()
        parts = [_MAGIC, struct.pack("<qq", round_idx, k), ids.numpy().astype("<i8").tobytes(),
                 written.numpy().astype(np.uint8).tobytes()]
        parts += [np.ascontiguousarray(r.numpy()).tobytes() for r in rows]
        parts.append(_END)
        self._f.write(b"".join(parts))
        self._f.flush()  # before the in-place write: the old rows survive a crash of the process

    def _records(self) -> list[tuple[int, np.ndarray, np.ndarray, list[np.ndarray]]]:
        from ..machine import physical_memory

        data = read_bytes(self.path, physical_memory(), "client store undo journal", StoreError)
        out, pos = [], 0
        while pos + 20 <= len(data) and data[pos:pos + 4] == _MAGIC:
            rnd, k = struct.unpack("<qq", data[pos + 4:pos + 20])
            p = pos + 20
            sizes = [k * 8, k] + [k * int(np.prod(s, dtype=np.int64)) * _np_dtype(d).itemsize
                                  for s, d in zip(self.shapes, self.dtypes, strict=True)]
            if p + sum(sizes) + 4 > len(data) or data[p + sum(sizes):p + sum(sizes) + 4] != _END:
                break  # a record cut short by a crash: its in-place write never started
            ids = np.frombuffer(data, "<i8", k, p)
            p += sizes[0]
            written = np.frombuffer(data, np.uint8, k, p).astype(bool)
            p += sizes[1]
            rows = []
            for s, d, size in zip(self.shapes, self.dtypes, sizes[2:], strict=True):
                rows.append(np.frombuffer(data[p:p + size], _np_dtype(d)).reshape(k, *s))
                p += size
            out.append((rnd, ids, written, rows))
            pos = p + 4
        return out

    def rollback(self, round_idx: int, leaves: list[Tensor], written: Tensor, num_clients: int) -> int:
        """Undo, newest first, every journaled write of rounds >= ``round_idx``; returns how many."""
        self._f.flush()
        recs = [r for r in self._records() if r[0] >= round_idx]
        for _, ids, _, _ in recs:
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_clients):
                raise StoreError(f"{self.path}: a record names clients outside [0, {num_clients}) (tampered)")
        for _, ids, old_written, rows in reversed(recs):
            idx = torch.from_numpy(ids.copy())
            for leaf, r in zip(leaves, rows, strict=True):
                leaf.index_copy_(0, idx, torch.from_numpy(r.copy()))
            written.index_copy_(0, idx, torch.from_numpy(old_written.copy()))
        self.truncate()
        return len(recs)

    def truncate(self) -> None:
        self._f.truncate(0)
        self._f.seek(0)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
