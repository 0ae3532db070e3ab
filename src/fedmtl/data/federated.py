"""The federated dataset: every client's train / validation / test split stored once, flat.

Examples of all clients are stored client-major in one tensor per split with per-client offsets
(``Split``).  Padded ``(K, S, B, ...)`` batch tensors plus masks are built only for the clients of a
round (``round_batches``), and padded ``(K, N_max, ...)`` evaluation views only for a chunk of
clients at a time (``padded``).  Optional *unseen* clients (``FederatedData.unseen``) never take part
in training; they are evaluated after fitting whatever local state the algorithm needs.

``FederatedData.from_arrays`` is the public way in: per-client numpy arrays or tensors, validated client
by client.  Labels are class indices (``num_classes >= 2``), or real-valued targets when
``num_classes == 0`` (regression: the networked GTV solver; the round engine trains classifiers only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..hostsync import to_device
from ..optim import Batches


class DataError(ValueError):
    """Malformed federated data (shapes, labels, empty clients)."""


def all_finite(x: Tensor, chunk: int = 1 << 22) -> bool:
    """No NaN/Inf in ``x``, checked a chunk at a time (no temporary the size of a million-client federation)."""
    flat = x.reshape(-1)
    return all(bool(torch.isfinite(c).all()) for c in flat.split(chunk))


def _tensor(a: Any, what: str) -> Tensor:
    """A numpy array, tensor or nested list as a CPU tensor (no copy where possible)."""
    if isinstance(a, Tensor):
        return a.detach().cpu()
    try:
        arr = np.asarray(a)
    except Exception as e:  # ragged lists and the like
        raise DataError(f"{what}: not an array ({e})") from e
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise DataError(f"{what}: expected numbers, got dtype {arr.dtype}")
    return torch.from_numpy(np.ascontiguousarray(arr))


def _labels(y: Tensor, regression: bool, what: str, dtype: torch.dtype = torch.float32) -> Tensor:
    if regression:
        if y.dtype == torch.bool or y.is_complex():
            raise DataError(f"{what}: regression targets must be real numbers, got {y.dtype}")
        y = y.to(dtype)
        if y.numel() and not bool(torch.isfinite(y).all()):
            raise DataError(f"{what}: targets contain NaN or Inf")
        return y
    if y.dtype == torch.bool:
        return y.long()
    if y.is_floating_point():
        if y.numel() and not bool(torch.isfinite(y).all()):
            raise DataError(f"{what}: labels contain NaN or Inf")
        if not bool(torch.equal(y, torch.round(y))):
            bad = y[y != torch.round(y)][:3].tolist()
            raise DataError(f"{what}: labels must be integer class indices, found {bad} "
                            "(pass regression=True for real-valued targets)")
        return y.long()
    y = y.long()
    if y.numel() and int(y.min()) < 0:
        raise DataError(f"{what}: labels must be >= 0, found {int(y.min())}")
    return y


@dataclass(frozen=True)
class Split:
    """One split of all clients: x (N, *feat), y (N,) long, offsets (C + 1,) long."""

    x: Tensor
    y: Tensor
    offsets: Tensor

    @property
    def num_clients(self) -> int:
        return self.offsets.numel() - 1

    @property
    def counts(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def client(self, k: int) -> tuple[Tensor, Tensor]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        return self.x[a:b], self.y[a:b]

    def to(self, device: torch.device | str) -> Split:
        return Split(self.x.to(device), self.y.to(device), self.offsets.to(device))

    @staticmethod
    def from_lists(xs: list[Tensor], ys: list[Tensor]) -> Split:
        """Concatenate per-client tensors; integer labels become int64, float targets (regression) stay."""
        if len(xs) != len(ys):
            raise DataError(f"{len(xs)} feature arrays but {len(ys)} label arrays")
        counts = torch.tensor([len(x) for x in xs], dtype=torch.long)
        offsets = torch.zeros(len(xs) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(counts, 0)
        return Split(torch.cat(xs), torch.cat([y if y.is_floating_point() else y.long() for y in ys]), offsets)

    def subset(self, clients: Tensor) -> Split:
        """The clients ``clients`` (indices, in that order) as a split of their own."""
        return Split.from_lists([self.client(int(k))[0] for k in clients], [self.client(int(k))[1] for k in clients])

    def validate(self, name: str, num_classes: int, allow_empty: bool) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"{name}: {self.x.shape[0]} examples but {self.y.shape[0]} labels")
        if self.y.dim() != 1:
            raise DataError(f"{name}: labels must be 1-d, got shape {tuple(self.y.shape)}")
        if self.offsets.dim() != 1 or self.offsets.numel() < 2:
            raise DataError(f"{name}: offsets must be a 1-d tensor of length num_clients + 1")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.x.shape[0]:
            raise DataError(f"{name}: offsets must start at 0 and end at {self.x.shape[0]}")
        c = self.counts
        if bool((c < 0).any()):
            raise DataError(f"{name}: offsets must be non-decreasing")
        if not allow_empty and bool((c == 0).any()):
            bad = torch.nonzero(c == 0).flatten()[:10].tolist()
            raise DataError(f"{name}: clients {bad} have no examples (every client needs training data)")
        if num_classes == 0:  # regression targets
            if not self.y.is_floating_point() or (self.y.numel() and not bool(torch.isfinite(self.y).all())):
                raise DataError(f"{name}: regression targets must be finite floats")
        elif self.y.is_floating_point():
            raise DataError(f"{name}: class labels must be integers, got {self.y.dtype}")
        elif self.y.numel():
            lo, hi = int(self.y.min()), int(self.y.max())
            if lo < 0 or hi >= num_classes:
                raise DataError(f"{name}: labels must lie in [0, {num_classes - 1}], found values in [{lo}, {hi}]")
        if self.x.is_floating_point() and not all_finite(self.x):
            raise DataError(f"{name}: features contain NaN or Inf")


@dataclass(frozen=True)
class ClientGroup:
    """Train / optional validation / test splits of one group of clients (same client order)."""

    train: Split
    test: Split
    val: Split | None = None

    @property
    def num_clients(self) -> int:
        return self.train.num_clients

    def splits(self) -> dict[str, Split]:
        out = {"train": self.train, "test": self.test}
        if self.val is not None:
            out["val"] = self.val
        return out

    def validate(self, name: str, num_classes: int, feature_shape: tuple[int, ...]) -> None:
        for split_name, s in self.splits().items():
            s.validate(f"{name}.{split_name}", num_classes, allow_empty=split_name != "train")
            if tuple(s.x.shape[1:]) != feature_shape:
                raise DataError(
                    f"{name}.{split_name}: feature shape {tuple(s.x.shape[1:])} != {feature_shape}"
                )
            if s.num_clients != self.num_clients:
                raise DataError(f"{name}.{split_name}: {s.num_clients} clients, train has {self.num_clients}")

    def subset(self, clients: Tensor) -> ClientGroup:
        val = None if self.val is None else self.val.subset(clients)
        return ClientGroup(self.train.subset(clients), self.test.subset(clients), val)


#: ``meta`` keys a model builder reads (``fedmtl.models.inputs.input_transform_for``): what a node may always send
#: the server and a site's export may always hold.  Every other key is private unless the dataset lists it in
#: ``meta["public_keys"]``.
MODEL_META_KEYS = ("input", "mean", "std")


def _plain(v: Any) -> Any:
    """``v`` as JSON-able data: tensors and arrays as (nested) lists, mappings with string keys."""
    if isinstance(v, Tensor | np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)


def public_meta(meta: dict[str, Any], name: str = "data") -> dict[str, Any]:
    """The part of a dataset's ``meta`` that may leave the process holding the data (a site's export, a
    SuperNode's reply to the server): the keys a model needs (``MODEL_META_KEYS``: input, mean, std) plus the
    keys the dataset declares public in ``meta["public_keys"]`` (kept as ``public_keys``, listing those present),
    as JSON-able values.  Everything else (a generator's true parameters, other clients' mixture weights, sizes
    or latent labels) is dropped.  A ``public_keys`` that is not a list of key names is a ``DataError`` naming
    the dataset ``name``."""
    declared = meta.get("public_keys", [])
    if isinstance(declared, str) or not isinstance(declared, list | tuple) or \
            not all(isinstance(k, str) for k in declared):
        raise DataError(f"{name}: meta['public_keys'] must be a list of key names, got {declared!r}"[:300])
    extra = [k for k in dict.fromkeys(declared) if k in meta and k not in MODEL_META_KEYS and k != "public_keys"]
    out = {k: _plain(meta[k]) for k in (*MODEL_META_KEYS, *extra) if k in meta}
    if extra:
        out["public_keys"] = extra
    return out


@dataclass(frozen=True)
class FederatedData:
    """Seen clients (trained on) and optional unseen clients (held out of training).

    ``meta`` describes the dataset.  A model builder reads only ``meta["input"]`` ("image", "float16", ...),
    ``meta["mean"]`` and ``meta["std"]`` (image normalization); a generator may add what it knows about every
    client (the synthetic mixture's ``theta``, ``pi``, ``sizes`` and ``latent`` labels) for in-process analysis.
    Only ``public_meta(meta)`` ever leaves the process: those three keys plus the keys listed in
    ``meta["public_keys"]`` (a list of key names a dataset declares safe to share with the server and every
    site, e.g. ``["partition"]``); ``fedmtl data export`` writes it to ``dataset.json`` and a SuperNode sends it to
    the server.
    """

    seen: ClientGroup
    num_classes: int
    unseen: ClientGroup | None = None
    name: str = "data"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.seen.train.x.shape[1:])

    @property
    def num_clients(self) -> int:
        return self.seen.num_clients

    @property
    def is_regression(self) -> bool:
        return self.num_classes == 0

    def validate(self) -> None:
        if self.num_classes < 2 and self.num_classes != 0:
            raise DataError(f"num_classes must be >= 2 (or 0 for regression targets), got {self.num_classes}")
        self.seen.validate(f"{self.name}.seen", self.num_classes, self.feature_shape)
        if self.unseen is not None:
            self.unseen.validate(f"{self.name}.unseen", self.num_classes, self.feature_shape)

    @classmethod
    def from_arrays(
        cls,
        train: Sequence[tuple[Any, Any]],
        test: Sequence[tuple[Any, Any]],
        val: Sequence[tuple[Any, Any]] | None = None,
        unseen_train: Sequence[tuple[Any, Any]] | None = None,
        unseen_test: Sequence[tuple[Any, Any]] | None = None,
        num_classes: int | None = None,
        *,
        regression: bool = False,
        dtype: torch.dtype = torch.float32,
        name: str = "arrays",
        meta: dict[str, Any] | None = None,
    ) -> FederatedData:
        """A federation from per-client arrays: ``train[k] = (x_k, y_k)`` for client k, numpy arrays or tensors.

        ``test`` (and ``val``) hold one ``(x, y)`` pair per training client, in the same order (a client may
        have zero test examples); ``unseen_train`` / ``unseen_test`` describe clients held out of training.
        Features keep their shape (n_k, *feature_shape), the same for every client; floating-point features
        are cast to ``dtype`` (float32: what the engine trains in; the float64 reference solvers pass float64),
        integer features (token ids, uint8 images) are kept.  Labels are integer class indices, given as
        integers or as floats with integer values; ``num_classes`` defaults to the largest label + 1.
        ``regression=True`` keeps real-valued targets (``num_classes = 0``, cast to ``dtype``).  Every client
        is validated on its own: a client whose features and labels differ in length is an error even when the
        totals match; so are NaN/Inf features, non-integer or out-of-range labels and training clients
        without examples.
        """
        groups = {"train": train, "test": test, "val": val, "unseen_train": unseen_train, "unseen_test": unseen_test}
        if (unseen_train is None) != (unseen_test is None):
            raise DataError("unseen clients need both unseen_train and unseen_test")
        conv: dict[str, list[tuple[Tensor, Tensor]]] = {}
        # the feature shape most clients have: the odd client is blamed, whichever its position (client 0 included)
        shapes: list[tuple[int, ...]] = []
        for pairs in groups.values():
            for item in pairs or ():
                shape = getattr(item[0], "shape", None) if isinstance(item, tuple | list) and len(item) == 2 else None
                if shape is not None and len(shape) >= 1:
                    shapes.append(tuple(int(d) for d in shape[1:]))
        feat: tuple[int, ...] | None = max(set(shapes), key=shapes.count) if shapes else None
        for gname, pairs in groups.items():
            if pairs is None:
                continue
            if isinstance(pairs, tuple) and len(pairs) == 2 and not isinstance(pairs[0], tuple):
                raise DataError(f"{gname} must be a sequence of (x, y) pairs, one per client, not one (x, y) pair")
            out = []
            for k, item in enumerate(pairs):
                if not isinstance(item, tuple | list) or len(item) != 2:
                    raise DataError(f"{gname} client {k}: expected an (x, y) pair, got {type(item).__name__}")
                x, y = _tensor(item[0], f"{gname} client {k} features"), _tensor(item[1], f"{gname} client {k} labels")
                if x.dim() < 1:
                    raise DataError(f"{gname} client {k}: features must have a leading example axis")
                if y.dim() != 1:
                    raise DataError(f"{gname} client {k}: labels must be 1-d (n,), got shape {tuple(y.shape)}")
                if x.shape[0] != y.shape[0]:
                    raise DataError(f"{gname} client {k}: {x.shape[0]} feature rows but {y.shape[0]} labels")
                if feat is None:
                    feat = tuple(x.shape[1:])
                elif tuple(x.shape[1:]) != feat:
                    raise DataError(f"{gname} client {k}: feature shape {tuple(x.shape[1:])}, "
                                    f"most clients have {feat}")
                if x.is_floating_point():
                    xc = x.to(dtype)  # checked after the conversion: 1e299 is finite in float64, Inf in float32
                    if xc.numel() and not bool(torch.isfinite(xc).all()):
                        raise DataError(f"{gname} client {k}: features contain NaN or Inf" if not bool(
                            torch.isfinite(x).all()) else f"{gname} client {k}: features beyond the range of {dtype} "
                            f"(Inf once converted from {x.dtype}); rescale them")
                    x = xc
                elif x.dtype == torch.bool or x.is_complex():
                    raise DataError(f"{gname} client {k}: features must be real numbers, got {x.dtype}")
                y = _labels(y, regression, f"{gname} client {k}", dtype)
                out.append((x, y))
            conv[gname] = out
        n = len(conv["train"])
        if n == 0:
            raise DataError("train holds no clients")
        for gname, ref in (("test", "train"), ("val", "train"), ("unseen_test", "unseen_train")):
            if gname in conv and len(conv[gname]) != len(conv[ref]):
                raise DataError(f"{gname} has {len(conv[gname])} clients but {ref} has {len(conv[ref])}")
        for gname in ("train", "unseen_train"):
            for k, (x, _) in enumerate(conv.get(gname, [])):
                if x.shape[0] == 0:
                    raise DataError(f"{gname} client {k} has no examples (every client needs training data)")
        if regression:
            if num_classes not in (None, 0):
                raise DataError("regression targets have no classes: leave num_classes out")
            num_classes = 0
        else:
            top = max((int(y.max()) for pairs in conv.values() for _, y in pairs if y.numel()), default=-1)
            if num_classes is None:
                num_classes = max(top + 1, 2)
            elif isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
                raise DataError(f"num_classes must be an int >= 2, got {num_classes!r}")
            elif top >= num_classes:
                raise DataError(f"labels go up to {top} but num_classes = {num_classes}")

        def group(tr: str, te: str, va: str | None) -> ClientGroup:
            def split(key: str) -> Split:
                return Split.from_lists([x for x, _ in conv[key]], [y for _, y in conv[key]])

            return ClientGroup(split(tr), split(te), split(va) if va and va in conv else None)

        unseen = group("unseen_train", "unseen_test", None) if "unseen_train" in conv else None
        return cls(group("train", "test", "val"), num_classes, unseen, name, meta or {})

    def subset(self, clients: Tensor) -> FederatedData:
        """The seen clients ``clients`` only (a node's share of the federation), without unseen clients."""
        return FederatedData(self.seen.subset(clients), self.num_classes, None, self.name, self.meta)

    def group(self, which: str) -> ClientGroup:
        g = self.seen if which == "seen" else self.unseen
        if g is None:
            raise KeyError(f"no {which} clients")
        return g


def describe(data: FederatedData) -> str:
    """Clients and examples per client of every split (what LEAF reports for its datasets)."""
    kind = "real-valued targets" if data.is_regression else f"{data.num_classes} classes"
    lines = [f"{data.name}: {kind}, features {data.feature_shape} ({data.seen.train.x.dtype})"]
    for gname in ("seen", "unseen"):
        g = data.seen if gname == "seen" else data.unseen
        if g is None:
            continue
        for sname, s in g.splits().items():
            c = s.counts.double()
            lines.append(f"  {gname:6s} {sname:5s} clients {s.num_clients:6d}  examples {int(c.sum()):9d}  per client: "
                         f"mean {float(c.mean()):9.1f}  std {float(c.std()) if c.numel() > 1 else 0.0:9.1f}  "
                         f"median {float(c.median()):8.1f}  min {int(c.min()):6d}  max {int(c.max()):7d}")
    return "\n".join(lines)


#: the seed of the permutation that picks every client's validation examples (``carve_validation``)
VAL_SEED = 20240


def carve_validation(data: FederatedData, fraction: float) -> FederatedData:
    """``data`` with ``round(fraction * n_k)`` of every seen client k's ``n_k`` training examples moved to its
    validation split (``[run] val_fraction``): drawn by a permutation seeded with ``VAL_SEED`` and the client's
    index, so the same examples for every run and every seed; at least one example stays for training.  The
    remaining training examples keep their order; the test split and the unseen clients are untouched."""
    if not 0 < fraction < 1:
        raise DataError(f"val_fraction must lie in (0, 1), got {fraction}")
    if data.seen.val is not None:
        raise DataError(f"{data.name}: already has a validation split")
    train = data.seen.train
    keep_x, keep_y, val_x, val_y = [], [], [], []
    for k in range(train.num_clients):
        x, y = train.client(k)
        n = x.shape[0]
        n_val = min(int(round(fraction * n)), n - 1)
        g = torch.Generator().manual_seed(VAL_SEED * 1_000_003 + k)
        picked = torch.zeros(n, dtype=torch.bool)
        picked[torch.randperm(n, generator=g)[:n_val]] = True
        keep_x.append(x[~picked])
        keep_y.append(y[~picked])
        val_x.append(x[picked])
        val_y.append(y[picked])
    seen = ClientGroup(Split.from_lists(keep_x, keep_y), data.seen.test, Split.from_lists(val_x, val_y))
    return FederatedData(seen, data.num_classes, data.unseen, data.name, data.meta)


# ---------------------------------------------------------------------------------------------
# Padded views


class Orders(NamedTuple):
    """Per-client random permutations for a round: ``local[e, starts[i] + j]`` is the j-th example
    (a local index into client i's data) that client i visits in epoch e.

    local: (E, total) long over the concatenated examples of the K clients; starts: (K + 1,) long.
    """

    local: Tensor
    starts: Tensor
    limit: Tensor | None = None  # (K,) long: client i stops after limit[i] local steps (systems layer)

    def take(self, positions: list[int] | Tensor) -> Orders:
        """The orders of the clients at ``positions`` (in that order) alone: what a process holding only those
        clients needs to run exactly their batches of the round (a Flower node, a distributed rank)."""
        pos = torch.as_tensor(positions, dtype=torch.long).cpu()
        first = self.starts[pos]
        sizes = self.starts[pos + 1] - first  # (k,)
        starts = torch.zeros(len(pos) + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(sizes, 0)
        # column j of the result is column first[i] + (j - starts[i]) of ``local``, for the i whose slice holds j
        cols = torch.arange(int(starts[-1])) + torch.repeat_interleave(first - starts[:-1], sizes)
        local = self.local.index_select(1, cols)
        return Orders(local, starts, None if self.limit is None else self.limit[pos])


def epoch_orders(counts: Tensor, epochs: int, generator: torch.Generator) -> Orders:
    """Independent uniform permutations of range(counts[i]) for each client and epoch.

    Drawn client by client in a fixed order (``torch.randperm`` is cheaper than one big sort here); the result
    depends only on the generator and the counts, never on how clients are later grouped into batched calls.
    """
    counts = counts.cpu().long()
    k = counts.numel()
    starts = torch.zeros(k + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(counts, 0)
    sizes = counts.tolist()
    rows = [
        torch.cat([torch.randperm(n, generator=generator) for n in sizes]) if k else torch.zeros(0, dtype=torch.long)
        for _ in range(epochs)
    ]
    return Orders(torch.stack(rows), starts)


def steps_per_epoch(counts: Tensor, batch_size: int) -> Tensor:
    return (counts + batch_size - 1) // batch_size


def usable_counts(counts: Tensor, batch_size: int, drop_last: bool) -> Tensor:
    """The examples a client trains on per epoch: all of them, or with ``drop_last`` (``run.drop_last``, as a
    ``DataLoader(drop_last=True)``) only its full batches (a client with fewer examples than a batch trains on
    none)."""
    return (counts // batch_size) * batch_size if drop_last else counts


def _layout(split: Split, clients: Tensor, orders: Orders, rows: Tensor, batch_size: int, steps: int | None,
            drop_last: bool) -> tuple[Tensor, Tensor, Tensor, int, int, int, int]:
    """The padded layout of clients ``clients[rows]``: (selected ids, their example counts, the counts they train on
    (``usable_counts``), K, epochs E, steps per epoch S, batch size B)."""
    sel = clients[rows]
    n_all = split.counts[sel].cpu()  # (K,)
    counts = usable_counts(n_all, batch_size, drop_last)
    epochs = orders.local.shape[0]
    s = int(steps_per_epoch(counts, batch_size).max()) if steps is None else steps
    if s == 1:  # a batch larger than every client's data is the client's whole data: pad only that far
        batch_size = max(1, min(batch_size, int(counts.max())))
    if s == 0:  # drop_last and no client has a full batch: one empty (dead) step keeps every shape non-empty
        s = 1
    return sel, n_all, counts, sel.numel(), epochs, s, batch_size


def _slots(split: Split, clients: Tensor, orders: Orders, rows: Tensor, batch_size: int, steps: int | None,
           drop_last: bool) -> tuple[Tensor, Tensor, int, int, int, int, int, Tensor, Tensor, Tensor]:
    """The slot layout of padded batches for clients ``clients[rows]``: (selected ids, their example counts, K,
    epochs E, steps per epoch S, batch size B, width S * B, arange(width), valid (K, W): the slot holds an
    example, local (K, E, W): each slot's example in the client's own numbering, 0 on padding)."""
    sel, n_all, counts, kk, epochs, s, batch_size = _layout(split, clients, orders, rows, batch_size, steps, drop_last)
    width = s * batch_size
    j = torch.arange(width)
    valid = j.unsqueeze(0) < counts.unsqueeze(1)  # (K, W)
    flat = orders.starts[rows].unsqueeze(1) + torch.where(valid, j.unsqueeze(0), torch.zeros_like(j))
    local = orders.local[:, flat]  # (E, K, W)
    local = torch.where(valid.unsqueeze(0), local, torch.zeros_like(local)).permute(1, 0, 2)  # (K, E, W)
    return sel, n_all, kk, epochs, s, batch_size, width, j, valid, local


def _live_counts(n_live: Tensor, kk: int, steps: int) -> tuple[int, ...]:
    """The clients live at each of ``steps`` steps (those with more live steps than the step's index), for ``n_live``
    (K,) each client's live steps."""
    hist = torch.bincount(n_live.clamp_max(steps), minlength=steps + 1)
    return tuple((kk - torch.cumsum(hist, 0)[:steps]).tolist())


def _check_sorted(n_live: Tensor) -> None:
    if bool((n_live[1:] > n_live[:-1]).any()):
        raise ValueError("client_batches: the rows must be sorted by their live steps, most first (the clients live "
                         "at a step are then a prefix)")


def _one_epoch_rows(orders: Orders, rows: Tensor, offsets: Tensor, counts: Tensor, live_counts: tuple[int, ...],
                    batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``client_batches``' step-major rows for one epoch a round, built for the live batches only: (slots (N, B)
    global example ids, filled (N, B) bool, each row's client (N,)).  In one epoch a client's live steps are its
    first ones, so row (step t, client k) holds the examples at positions t*B .. t*B + B - 1 of k's order (its
    first example on padding, not filled): the rows the general path picks from the padded (K, S, B) layout."""
    lc = torch.tensor(live_counts, dtype=torch.long)
    n = int(lc.sum())
    step = torch.repeat_interleave(torch.arange(len(live_counts)), lc, output_size=n)  # (N,) each row's step
    client = torch.arange(n) - torch.repeat_interleave(torch.cumsum(lc, 0) - lc, lc, output_size=n)  # (N,)
    w = step.unsqueeze(1) * batch_size + torch.arange(batch_size)  # (N, B): positions in the client's order
    filled = w < counts[client].unsqueeze(1)
    flat = orders.starts[rows][client].unsqueeze(1) + torch.where(filled, w, torch.zeros_like(w))
    local = torch.where(filled, orders.local[0][flat], torch.zeros_like(flat))
    return offsets[client].unsqueeze(1) + local, filled, client


class ClientData(NamedTuple):
    """``client_batches``' result: the step-major batches of K clients and, where asked, their first epochs."""

    x: Tensor  # (N, B, ...)
    y: Tensor  # (N, B)
    mask: Tensor  # (N, B) float
    n: Tensor  # (K,) float: the clients' training examples
    live: tuple[int, ...]  # the clients live at every step (a prefix)
    pos: Tensor | None = None  # (N, B) long: each slot's example's index in ``first`` (0 on padding)
    #: x0 (N0, ...), y0 (N0,), owner (N0,) long, mask0 (N0,) float: packed (x0 may be a view of ``x``)
    first: tuple[Tensor, Tensor, Tensor, Tensor] | None = None


def _first_epoch_pos(kk: int, epochs: int, width: int, j: Tensor, valid: Tensor, local: Tensor) -> Tensor:
    """(K, E, W): each slot's position in its client's first-epoch order (the index space of ``Batches.pos``).
    With ``drop_last`` (one epoch a round, ``RunConfig``; FedRep's head epochs come before it) an example of a
    later epoch may be missing from the first, dropped from its tail: its position is 0."""
    if epochs == 1:
        return j.view(1, 1, -1).expand(kk, 1, width)
    ids = max(width, int(local.max()) + 1 if local.numel() else 0)  # the examples' own numbers (drop_last: > width)
    inv0 = torch.zeros(kk, ids + 1, dtype=torch.long)  # the last column absorbs the padding slots
    target = torch.where(valid, local[:, 0], torch.full_like(local[:, 0], ids))
    inv0.scatter_(1, target, j.unsqueeze(0).expand(kk, width).contiguous())  # the inverse permutation of epoch 0
    pos = torch.gather(inv0, 1, local.reshape(kk, -1)).reshape(kk, epochs, width)
    return torch.where(valid.unsqueeze(1), pos, j.view(1, 1, -1).expand_as(pos))


def client_batches(split: Split, clients: Tensor, orders: Orders, rows: Tensor, batch_size: int,
                   drop_last: bool = False, first_epoch: bool = False) -> ClientData:
    """The ``stacked`` executor's batches of clients ``clients[rows]`` (sorted by their live steps, most first):
    (x (N, B, ...), y (N, B), mask (N, B) float, n (K,) float, live).  Row blocks in step-major order: step s holds
    the batches of the ``live[s]`` clients live at s (a prefix of ``rows``), each client's live steps (non-empty,
    within its straggler limit) in its own order.  Only those batches are gathered: no padded step is built.
    ``first_epoch``: also every client's first epoch whole (all the examples its epochs cover, straggler or not:
    FedEM's E-step), packed client after client, each example's client (0..K-1, in ``rows``' order) and whether it
    is one (1.0; 0.0 on padding), and each slot's example's index there (``ClientData.first``, ``.pos``).  Where
    the batches already hold every example once (one epoch, no straggler), the first epoch is a view of them."""
    dev = split.x.device
    sel, n_all, counts, kk, epochs, s, batch_size = _layout(split, clients, orders, rows, batch_size, None, drop_last)

    def gathered(slots: Tensor, filled: Tensor, live_counts: tuple[int, ...]) -> ClientData:
        flat = to_device(slots.reshape(-1), dev)
        x = split.x.index_select(0, flat).reshape(-1, batch_size, *split.x.shape[1:])
        y = split.y.index_select(0, flat).reshape(-1, batch_size)
        return ClientData(x, y, to_device(filled.to(torch.float32), dev), to_device(n_all.to(torch.float32), dev),
                          live_counts)

    if epochs == 1:  # each client's live steps are its first ones (within its straggler limit)
        nonempty = steps_per_epoch(counts, batch_size).clamp_max(s)  # (K,)
        n_live = nonempty if orders.limit is None else torch.minimum(nonempty, orders.limit[rows].cpu())
        _check_sorted(n_live)
        steps = max(int(n_live.max()), 1) if kk else 1
        live_counts = _live_counts(n_live, kk, steps)
        if not first_epoch or bool((n_live == nonempty).all()):
            slots, filled, owner = _one_epoch_rows(orders, rows, split.offsets[sel].cpu(), counts, live_counts,
                                                   batch_size)
            out = gathered(slots, filled, live_counts)
            if not first_epoch:
                return out
            # the batches are the first epoch: a view
            nb = out.x.shape[0]
            return out._replace(pos=torch.arange(nb * batch_size, device=dev).reshape(nb, batch_size),
                                first=(out.x.reshape(nb * batch_size, *out.x.shape[2:]), out.y.reshape(-1),
                                       to_device(owner.repeat_interleave(batch_size), dev), out.mask.reshape(-1)))
    # several epochs (padding between them), or a first epoch that stragglers cut short: every client's padded
    # steps, its live ones picked
    sel, n_all, kk, epochs, s, batch_size, width, j, valid, local = _slots(split, clients, orders, rows, batch_size,
                                                                           None, drop_last)
    slots = (split.offsets[sel].cpu().view(kk, 1, 1) + local).reshape(kk, epochs * s, batch_size)  # global ids
    filled = valid.unsqueeze(1).expand(kk, epochs, width).reshape(kk, epochs * s, batch_size)
    nonempty = filled.any(-1)  # (K, E*S)
    limit = torch.full((kk,), epochs * s, dtype=torch.long) if orders.limit is None else orders.limit[rows].cpu()
    live = nonempty & (torch.cumsum(nonempty.to(torch.long), 1) <= limit.unsqueeze(1))
    n_live = live.sum(1)
    _check_sorted(n_live)
    steps = max(int(n_live.max()), 1) if kk else 1
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :steps]  # each client's live steps first
    pick = torch.gather(live, 1, order).T  # (L, K): step-major; the live clients of a step are a prefix
    slots = torch.gather(slots, 1, order.unsqueeze(-1).expand(kk, steps, batch_size)).transpose(0, 1)[pick]
    filled = torch.gather(filled, 1, order.unsqueeze(-1).expand(kk, steps, batch_size)).transpose(0, 1)[pick]
    out = gathered(slots, filled, _live_counts(n_live, kk, steps))
    if not first_epoch:
        return out
    # the first epoch packed: client k's examples at [start_k, start_k + count_k) in its epoch-0 order
    start = torch.cumsum(valid.sum(1), 0) - valid.sum(1)  # (K,)
    pos = _first_epoch_pos(kk, epochs, width, j, valid, local)  # (K, E, W) within the client's first epoch
    pos = torch.where(valid.unsqueeze(1), pos + start.view(kk, 1, 1), torch.zeros_like(pos))
    pos = pos.reshape(kk, epochs * s, batch_size)
    pos = torch.gather(pos, 1, order.unsqueeze(-1).expand(kk, steps, batch_size)).transpose(0, 1)[pick]
    first = to_device((split.offsets[sel].cpu().view(kk, 1) + local[:, 0])[valid], dev)  # (N0,) global ids, packed
    owner = to_device(torch.arange(kk).unsqueeze(1).expand(kk, width)[valid], dev)
    return out._replace(pos=to_device(pos, dev), first=(split.x.index_select(0, first), split.y.index_select(0, first),
                                                        owner, torch.ones(len(owner), device=dev)))


def round_batches(
    split: Split, clients: Tensor, orders: Orders, rows: Tensor, batch_size: int, steps: int | None = None,
    drop_last: bool = False, tables_on_host: bool = False,
) -> Batches:
    """Padded training batches for clients ``clients[rows]``: x (K, E*S, B, ...), masks, positions.

    ``orders`` are the epoch permutations of all of ``clients`` (``epoch_orders``); ``rows`` selects
    the clients of this batched call.  ``steps`` S is the number of steps per epoch (default: enough
    for the largest selected client).  ``drop_last``: each epoch's last partial batch is left out (the examples
    at the end of that epoch's permutation: random ones, as a shuffling ``DataLoader(drop_last=True)`` drops).
    x and y are gathered where the split's examples are (a device-resident federation's: on its device); the other
    fields are built there too, or with ``tables_on_host`` left on the host, where the caller reads them without
    waiting for the device (``executors.TrainBatches``) before it moves them.
    """
    dev = split.x.device
    tdev = torch.device("cpu") if tables_on_host else dev
    sel, n_all, kk, epochs, s, batch_size, width, j, valid, local = _slots(split, clients, orders, rows, batch_size,
                                                                           steps, drop_last)
    pos = _first_epoch_pos(kk, epochs, width, j, valid, local)  # each example's place in the first epoch's order
    gidx = to_device((split.offsets[sel].cpu().view(kk, 1, 1) + local).reshape(-1), dev)
    x = split.x.index_select(0, gidx).reshape(kk, epochs * s, batch_size, *split.x.shape[1:])
    y = split.y.index_select(0, gidx).reshape(kk, epochs * s, batch_size)
    mask = valid.unsqueeze(1).expand(kk, epochs, width).reshape(kk, epochs * s, batch_size)
    out = Batches(
        x=x,
        y=y,
        mask=to_device(mask.to(torch.float32), tdev),
        pos=to_device(pos.reshape(kk, epochs * s, batch_size), tdev),
        n=to_device(n_all.to(torch.float32), tdev),
        limit=to_device(torch.full((kk,), epochs * s, dtype=torch.long) if orders.limit is None
                        else orders.limit[rows], tdev),
        idx=to_device(local.reshape(kk, epochs * s, batch_size), tdev),
    )
    return out


def ragged_batches(split: Split, clients: Tensor, orders: Orders, row: int, batch_size: int,
                   drop_last: bool = False) -> Batches:
    """One client's batches without padding (the loop runner): x, y, mask, pos are lists of (b_s, ...)
    tensors whose last batch of each epoch holds only the remaining examples, as a DataLoader gives.
    Numerically identical to the padded batches (padding rows have zero weight)."""
    b = round_batches(split, clients, orders, torch.tensor([row]), batch_size, drop_last=drop_last, tables_on_host=True)
    n = int(usable_counts(b.n[:1].long().cpu(), batch_size, drop_last)[0])
    steps = int(steps_per_epoch(torch.tensor(n), batch_size))
    if steps == 0:  # drop_last and fewer examples than a batch: one masked step that is never live (limit 0)
        one = [[t[0, 0, :1]] for t in (b.x, b.y, b.mask, b.pos, b.idx)]  # type: ignore[index]
        return Batches(one[0], one[1], one[2], one[3], b.n[0], torch.zeros((), dtype=torch.long),  # type: ignore[arg-type]
                       one[4])  # type: ignore[arg-type]
    epochs = orders.local.shape[0]
    last = n - (steps - 1) * batch_size
    k = epochs * steps
    keep = [last if (s % steps) == steps - 1 else batch_size for s in range(k)]
    cut = [t[0, s, : keep[s]] for t in (b.x, b.y, b.mask, b.pos, b.idx) for s in range(k)]  # type: ignore[index]
    limit = b.limit[0] if b.limit is not None else None
    return Batches(cut[:k], cut[k : 2 * k], cut[2 * k : 3 * k], cut[3 * k : 4 * k], b.n[0], limit,  # type: ignore[arg-type]
                   cut[4 * k :])  # type: ignore[arg-type]


def padded(split: Split, clients: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """All examples of ``clients`` padded: x (K, N_max, ...), y (K, N_max), mask (K, N_max) float."""
    dev = split.x.device
    counts = split.counts[clients].cpu()
    nmax = max(int(counts.max()), 1) if counts.numel() else 1
    j = torch.arange(nmax)
    valid = j.unsqueeze(0) < counts.unsqueeze(1)
    starts = split.offsets[clients].cpu()
    k = len(clients)
    if split.x.shape[0] == 0:
        x = torch.zeros(len(clients), nmax, *split.x.shape[1:], dtype=split.x.dtype, device=dev)
        y = torch.zeros(len(clients), nmax, dtype=torch.long, device=dev)
    elif k and split.x.is_contiguous() and split.y.is_contiguous() and bool((counts == nmax).all()) \
            and bool((starts == starts[0] + nmax * torch.arange(k)).all()):
        # clients of one size stored one after the other (a federation's equal test sets): a view, no copy
        x = split.x.narrow(0, int(starts[0]), k * nmax).view(k, nmax, *split.x.shape[1:])
        y = split.y.narrow(0, int(starts[0]), k * nmax).view(k, nmax)
    else:
        gidx = to_device(starts.unsqueeze(1) + torch.where(valid, j.unsqueeze(0), torch.zeros_like(j)), dev)
        flat = gidx.reshape(-1)  # index_select: 2-3x the rate of advanced indexing for these row gathers (measured)
        x = split.x.index_select(0, flat).reshape(len(clients), nmax, *split.x.shape[1:])
        y = split.y.index_select(0, flat).reshape(len(clients), nmax)
    return x, y, to_device(valid.to(torch.float32), dev)


def federate(
    x: Tensor,
    y: Tensor,
    parts: list[Any],
    num_classes: int,
    rng: Any,
    test_frac: float = 0.2,
    val_frac: float = 0.0,
    unseen_frac: float = 0.0,
    name: str = "data",
    meta: dict[str, Any] | None = None,
) -> FederatedData:
    """Turn per-client index arrays over (x, y) into a FederatedData.

    Each client's examples are split at random into train / val / test (``test_frac``, ``val_frac``);
    the last ``round(unseen_frac * C)`` clients (after a random shuffle of client order) become unseen
    clients.  Clients left without training examples are dropped.
    """
    import numpy as np

    from .partition import train_test_split

    order = rng.permutation(len(parts))
    parts = [parts[i] for i in order]
    tr, va, te = train_test_split(parts, test_frac, rng, val_frac) if test_frac > 0 else (parts, [], [])
    keep = [i for i in range(len(parts)) if len(tr[i]) > 0]

    def pairs(idx_lists: list[Any]) -> list[tuple[Tensor, Tensor]]:
        out = []
        for i in keep:
            idx = torch.as_tensor(np.asarray(idx_lists[i], dtype=np.int64))
            out.append((x[idx], y[idx]))
        return out

    return from_clients(pairs(tr), pairs(te), num_classes, int(round(unseen_frac * len(keep))),
                        pairs(va) if val_frac else None, name, meta)


def from_clients(
    train: list[tuple[Tensor, Tensor]],
    test: list[tuple[Tensor, Tensor]],
    num_classes: int,
    n_unseen: int = 0,
    val: list[tuple[Tensor, Tensor]] | None = None,
    name: str = "data",
    meta: dict[str, Any] | None = None,
) -> FederatedData:
    """Per-client (x, y) pairs -> FederatedData; the last ``n_unseen`` clients are held out (unseen)."""
    k = len(train)
    if not 0 <= n_unseen < k:
        raise DataError(f"{name}: {n_unseen} unseen clients out of {k} leaves no client to train")
    groups: list[ClientGroup | None] = []
    for ids in (range(0, k - n_unseen), range(k - n_unseen, k)):
        if len(ids) == 0:
            groups.append(None)
            continue

        def split(lst: list[tuple[Tensor, Tensor]], ids: range = ids) -> Split:
            ys = [lst[i][1] if num_classes == 0 else lst[i][1].long() for i in ids]
            return Split.from_lists([lst[i][0] for i in ids], ys)

        groups.append(ClientGroup(train=split(train), test=split(test), val=None if val is None else split(val)))
    return FederatedData(seen=groups[0], num_classes=num_classes, unseen=groups[1], name=name,  # type: ignore[arg-type]
                         meta=meta or {})


def tasks_to_federation(xs: list[np.ndarray], ys: list[np.ndarray], num_classes: int, name: str,
                        test_frac: float = 0.25, standardize: bool = True, seed: int = 0,
                        unseen_frac: float = 0.0) -> FederatedData:
    """Per-task random train/test split (MOCHA: 75/25), optional per-task z-scoring (train statistics)."""
    rng = np.random.default_rng(seed)
    parts: list[tuple[np.ndarray, ...]] = []
    for t, (x, y) in enumerate(zip(xs, ys, strict=True)):
        x = np.nan_to_num(np.asarray(x, dtype=np.float64))
        y = np.asarray(y).astype(np.int64).ravel()
        if x.ndim != 2 or x.shape[0] != y.shape[0]:
            raise DataError(f"{name}: task {t} has features {x.shape} and {y.shape[0]} labels")
        perm = rng.permutation(len(y))
        n_tr = int(np.ceil((1 - test_frac) * len(y)))
        tr, te = perm[:n_tr], perm[n_tr:]
        if standardize:
            mu, sd = x[tr].mean(0), x[tr].std(0)
            sd[sd == 0] = 1.0
            x = (x - mu) / sd
        parts.append((x[tr], y[tr], x[te], y[te]))
    def pairs(i: int, j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.from_numpy(p[i]).float(), torch.from_numpy(p[j])) for p in parts]

    return from_clients(pairs(0, 1), pairs(2, 3), num_classes, int(round(unseen_frac * len(parts))), None, name,
                        {"input": "tabular"})


def data_digest(data: FederatedData) -> str:
    """SHA-256 of a federation's examples: every split's features, labels and client offsets, seen and unseen, and the
    number of classes.  A checkpoint keeps it, so that a run is never resumed over other data (a relative
    ``data.path`` read from another folder, a file changed since)."""
    import hashlib

    h = hashlib.sha256(f"classes {data.num_classes}".encode())
    for gname, group in (("seen", data.seen), ("unseen", data.unseen)):
        if group is None:
            continue
        for sname, split in (("train", group.train), ("test", group.test), ("val", group.val)):
            if split is None:
                continue
            for tname, t in (("x", split.x), ("y", split.y), ("offsets", split.offsets)):
                t = t.detach().cpu().contiguous()
                h.update(f"|{gname}.{sname}.{tname}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
