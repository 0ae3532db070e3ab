"""The federated dataset: every client's train / validation / test split stored once, flat.

Examples of all clients are stored client-major in one tensor per split with per-client offsets
(``Split``).  Padded ``(K, S, B, ...)`` batch tensors plus masks are built only for the clients of a
round (``round_batches``), and padded ``(K, N_max, ...)`` evaluation views only for a chunk of
clients at a time (``padded``).  Optional *unseen* clients (``FederatedData.unseen``) never take part
in training; they are evaluated after fitting whatever local state the algorithm needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..optim import Batches


class DataError(ValueError):
    """Malformed federated data (shapes, labels, empty clients)."""


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
        if len(xs) != len(ys):
            raise DataError(f"{len(xs)} feature arrays but {len(ys)} label arrays")
        counts = torch.tensor([len(x) for x in xs], dtype=torch.long)
        offsets = torch.zeros(len(xs) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(counts, 0)
        return Split(torch.cat(xs), torch.cat([y.long() for y in ys]), offsets)

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
        if self.y.numel():
            lo, hi = int(self.y.min()), int(self.y.max())
            if lo < 0 or hi >= num_classes:
                raise DataError(f"{name}: labels must lie in [0, {num_classes - 1}], found values in [{lo}, {hi}]")
        if self.x.is_floating_point() and self.x.numel() and not bool(torch.isfinite(self.x).all()):
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

    def to(self, device: torch.device | str) -> ClientGroup:
        val = None if self.val is None else self.val.to(device)
        return ClientGroup(self.train.to(device), self.test.to(device), val)


@dataclass(frozen=True)
class FederatedData:
    """Seen clients (trained on) and optional unseen clients (held out of training)."""

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

    def validate(self) -> None:
        if self.num_classes < 2:
            raise DataError(f"num_classes must be >= 2, got {self.num_classes}")
        self.seen.validate(f"{self.name}.seen", self.num_classes, self.feature_shape)
        if self.unseen is not None:
            self.unseen.validate(f"{self.name}.unseen", self.num_classes, self.feature_shape)

    def to(self, device: torch.device | str) -> FederatedData:
        return FederatedData(
            self.seen.to(device), self.num_classes, None if self.unseen is None else self.unseen.to(device),
            self.name, self.meta,
        )

    def group(self, which: str) -> ClientGroup:
        g = self.seen if which == "seen" else self.unseen
        if g is None:
            raise KeyError(f"no {which} clients")
        return g


def describe(data: FederatedData) -> str:
    """Clients and examples per client of every split (what LEAF reports for its datasets)."""
    lines = [f"{data.name}: {data.num_classes} classes, features {data.feature_shape} ({data.seen.train.x.dtype})"]
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


def epoch_orders(counts: Tensor, epochs: int, generator: torch.Generator) -> Orders:
    """Independent uniform permutations of range(counts[i]) for each client and epoch.

    Drawn client by client in a fixed order (``torch.randperm`` is cheaper than one big sort here:
    0.7 ms for 300 clients on 2 cores); the result depends only on the generator and the counts,
    never on how clients are later grouped into batched calls.
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


def round_batches(
    split: Split, clients: Tensor, orders: Orders, rows: Tensor, batch_size: int, steps: int | None = None
) -> Batches:
    """Padded training batches for clients ``clients[rows]``: x (K, E*S, B, ...), masks, positions.

    ``orders`` are the epoch permutations of all of ``clients`` (``epoch_orders``); ``rows`` selects
    the clients of this batched call.  ``steps`` S is the number of steps per epoch (default: enough
    for the largest selected client).
    """
    dev = split.x.device
    sel = clients[rows]
    counts = split.counts[sel].cpu()  # (K,)
    kk = sel.numel()
    epochs = orders.local.shape[0]
    s = int(steps_per_epoch(counts, batch_size).max()) if steps is None else steps
    if s == 1:  # a batch larger than every client's data is the client's whole data: pad only that far
        batch_size = max(1, min(batch_size, int(counts.max())))
    width = s * batch_size
    j = torch.arange(width)
    valid = j.unsqueeze(0) < counts.unsqueeze(1)  # (K, W)
    flat = orders.starts[rows].unsqueeze(1) + torch.where(valid, j.unsqueeze(0), torch.zeros_like(j))
    local = orders.local[:, flat]  # (E, K, W)
    local = torch.where(valid.unsqueeze(0), local, torch.zeros_like(local)).permute(1, 0, 2)  # (K, E, W)
    if epochs == 1:
        pos = j.view(1, 1, -1).expand(kk, 1, width)
    else:  # position of each example in the first epoch's order (inverse permutation of epoch 0)
        inv0 = torch.zeros(kk, width + 1, dtype=torch.long)  # column `width` absorbs the padding slots
        target = torch.where(valid, local[:, 0], torch.full_like(local[:, 0], width))
        inv0.scatter_(1, target, j.unsqueeze(0).expand(kk, width).contiguous())
        pos = torch.gather(inv0, 1, local.reshape(kk, -1)).reshape(kk, epochs, width)
        pos = torch.where(valid.unsqueeze(1), pos, j.view(1, 1, -1).expand_as(pos))
    gidx = (split.offsets[sel].cpu().view(kk, 1, 1) + local).reshape(-1).to(dev)
    x = split.x.index_select(0, gidx).reshape(kk, epochs * s, batch_size, *split.x.shape[1:])
    y = split.y.index_select(0, gidx).reshape(kk, epochs * s, batch_size)
    mask = valid.unsqueeze(1).expand(kk, epochs, width).reshape(kk, epochs * s, batch_size)
    out = Batches(
        x=x,
        y=y,
        mask=mask.to(dev, torch.float32),
        pos=pos.reshape(kk, epochs * s, batch_size).to(dev),
        n=counts.to(dev, torch.float32),
        limit=(torch.full((kk,), epochs * s, dtype=torch.long) if orders.limit is None else orders.limit[rows]).to(dev),
    )
    return out


def ragged_batches(split: Split, clients: Tensor, orders: Orders, row: int, batch_size: int) -> Batches:
    """One client's batches without padding (the loop runner): x, y, mask, pos are lists of (b_s, ...)
    tensors whose last batch of each epoch holds only the remaining examples, as a DataLoader gives.
    Numerically identical to the padded batches (padding rows have zero weight)."""
    b = round_batches(split, clients, orders, torch.tensor([row]), batch_size)
    n = int(b.n[0])
    steps = int(steps_per_epoch(torch.tensor(n), batch_size))
    epochs = orders.local.shape[0]
    last = n - (steps - 1) * batch_size
    k = epochs * steps
    keep = [last if (s % steps) == steps - 1 else batch_size for s in range(k)]
    cut = [t[0, s, : keep[s]] for t in (b.x, b.y, b.mask, b.pos) for s in range(k)]
    limit = b.limit[0] if b.limit is not None else None
    return Batches(cut[:k], cut[k : 2 * k], cut[2 * k : 3 * k], cut[3 * k :], b.n[0], limit)  # type: ignore[arg-type]


def padded(split: Split, clients: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """All examples of ``clients`` padded: x (K, N_max, ...), y (K, N_max), mask (K, N_max) float."""
    dev = split.x.device
    counts = split.counts[clients].cpu()
    nmax = max(int(counts.max()), 1) if counts.numel() else 1
    j = torch.arange(nmax)
    valid = j.unsqueeze(0) < counts.unsqueeze(1)
    gidx = split.offsets[clients].cpu().unsqueeze(1) + torch.where(valid, j.unsqueeze(0), torch.zeros_like(j))
    gidx = gidx.to(dev)
    if split.x.shape[0] == 0:
        x = torch.zeros(len(clients), nmax, *split.x.shape[1:], dtype=split.x.dtype, device=dev)
        y = torch.zeros(len(clients), nmax, dtype=torch.long, device=dev)
    else:
        x = split.x[gidx.reshape(-1)].reshape(len(clients), nmax, *split.x.shape[1:])
        y = split.y[gidx.reshape(-1)].reshape(len(clients), nmax)
    return x, y, valid.to(dev, torch.float32)


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
            return Split.from_lists([lst[i][0] for i in ids], [lst[i][1] for i in ids])

        groups.append(ClientGroup(train=split(train), test=split(test), val=None if val is None else split(val)))
    return FederatedData(seen=groups[0], num_classes=num_classes, unseen=groups[1], name=name,  # type: ignore[arg-type]
                         meta=meta or {})
