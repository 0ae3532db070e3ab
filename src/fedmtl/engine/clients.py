"""The clients a round loop talks to: ``Clients`` (the interface) and ``LocalClients`` (clients held in this
process: their data, their ``ClientStore`` and a local executor); what a round asks of them (``RoundPlan``) and what
they answer (``TrainOut``).

In a simulation one ``LocalClients`` holds the whole federation.  On a Flower SuperNode one holds that node's
share of it (``global_ids``), and ``fedmtl.flower.executor.FlowerClients`` implements the same interface on
the server by sending messages to the nodes.  Client state never leaves the process that holds the client.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm, Context
from ..data.federated import FederatedData, Orders, padded, round_batches
from ..hostsync import host_sync, to_device
from ..models.base import Model
from ..schema import type_hints
from ..tree import Tree
from .evaluation import chunks, per_client, scores
from .executors import Executor, TrainBatches
from .store import ClientStore, StoreKind

log = logging.getLogger("fedmtl")


class TrainOut(NamedTuple):
    """A round's client results, stacked over the K clients in the order they were asked."""

    updates: Tree  # (K, ...) what each client sends (zeros where it failed)
    losses: Tensor  # (K,) training loss (NaN where it failed), on the host (read in the round's one wait)
    ok: Tensor  # (K,) bool, on the host: update, new state and loss finite (the new state was kept)
    failed: Tensor  # (K,) bool: no usable reply (raised, timed out, malformed); remote executors only
    #: the distributed executor's summed round: ``updates`` are then a zero-copy view, the weighted mean already
    #: combined across ranks, and ``aggregate`` must read them through this combiner (``engine.distributed``)
    combine: Any = None


class RoundPlan(NamedTuple):
    """What a round asks of its clients, before any of them runs (``Engine.plan``; an asynchronous server step asks
    the clients it dispatched the same way)."""

    round: int  # the round the clients train in (an asynchronous step: the server version); their states keep it
    ids: Tensor  # (K,) the clients that train (sampled, not dropped), sorted
    counts: Tensor  # (K,) their training examples
    orders: Orders | None  # their batch orders (None when nobody trains)
    lr: float  # the clients' learning rate
    payload: Tree  # what the server sends them
    n_sampled: int  # clients sampled, the dropped ones included
    n_dropped: int  # sampled clients the systems model dropped (they never train)
    est_seconds: float  # the round's estimated wall-clock time (``fedmtl.engine.systems``)


class Clients(Protocol):
    """What the round loop needs from the clients, wherever they run."""

    @property
    def groups(self) -> tuple[str, ...]:
        """The client groups it evaluates ("seen", and "unseen" where there are any)."""
        ...

    def start(self, ctx: Context, server0: Tree, resume: dict[str, Any] | None = None, round_idx: int = 0) -> None: ...

    def train(self, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut: ...

    def evaluate(self, group: str, payload: Tree, server: Tree, ids: Tensor, adapt: Orders | None,
                 lr: float) -> dict[str, Any]: ...

    def gossip(self, fn: Callable[[Tree, Tree], tuple[Tree, Tree]], server: Tree, round_idx: int) -> Tree: ...

    def state_dict(self) -> dict[str, Any]: ...

    def commit(self) -> None: ...

    def close(self) -> None: ...


class LocalClients:
    """Clients held in this process.

    ``data`` holds their examples (seen clients, and unseen ones in a simulation); ``global_ids`` (sorted) are
    the federation-wide ids of ``data``'s seen clients (default 0..N-1).  Data stays on the CPU; a round moves
    only its batches and its clients' states to ``device``.
    """

    def __init__(self, alg: Algorithm, data: FederatedData, executor: Executor, device: torch.device,
                 batch_size: int, eval_chunk_elems: int = 2**26, store: StoreKind = "memory",
                 store_dir: str | Path | None = None, journal: bool = False, global_ids: Tensor | None = None,
                 drop_last: bool = False):
        # the stacked executor serves the algorithms that have a clients form; the others its fallback (vmap)
        executor = executor.for_algorithm(alg)
        self.alg, self.data, self.executor, self.device = alg, data, executor, device
        self.batch_size, self.eval_chunk_elems, self.drop_last = batch_size, eval_chunk_elems, drop_last
        self.store_kind, self.store_dir, self.journal = store, store_dir, journal
        self.global_ids = None if global_ids is None else global_ids.to(torch.long).cpu()
        if self.global_ids is not None and bool((self.global_ids[1:] <= self.global_ids[:-1]).any()):
            raise ValueError("global_ids must be sorted and distinct")
        self.groups = ("seen",) if data.unseen is None else ("seen", "unseen")
        self.store: ClientStore | None = None
        self.ctx: Context | None = None

    # ------------------------------------------------------------------------------------------ set-up
    def start(self, ctx: Context, server0: Tree, resume: dict[str, Any] | None = None, round_idx: int = 0) -> None:
        """Open the store; its never-written rows are ``alg.init_clients(ctx, server0, ids)``."""
        self.ctx = ctx
        alg = self.alg

        def init(rows: Tensor) -> Tree:
            return T.to(alg.init_clients(ctx, server0, self.to_global(rows)), "cpu")

        kind = self.store_kind if T.leaves(init(torch.zeros(1, dtype=torch.long))) else "memory"
        self.store = ClientStore(self.data.seen.num_clients, init, kind,
                                 None if self.store_dir is None else Path(self.store_dir), self.journal,
                                 resume=resume is not None)
        if resume is not None:
            self.store.load_state_dict(resume, round_idx)

    def to_global(self, rows: Tensor) -> Tensor:
        return rows if self.global_ids is None else self.global_ids[rows.cpu()]

    def rows_of(self, ids: Tensor) -> Tensor:
        """Local rows of the federation-wide client ids ``ids`` (an error for clients held elsewhere)."""
        ids = ids.to(torch.long).cpu()
        if self.global_ids is None:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.data.seen.num_clients):
                raise KeyError(f"client ids {ids[:5].tolist()}... are not all held here")
            return ids
        rows = torch.searchsorted(self.global_ids, ids).clamp_max(len(self.global_ids) - 1)
        if not bool((self.global_ids[rows] == ids).all()):
            missing = ids[self.global_ids[rows] != ids][:5].tolist()
            raise KeyError(f"clients {missing} are not held here (this process holds "
                           f"{self.global_ids[:8].tolist()}...)")
        return rows

    def _update(self, payload: Tree, state: Tree, batches: Any, lr: float) -> Any:
        return self.alg.client_update(self.ctx, payload, state, batches, lr)  # type: ignore[arg-type]

    def _update_fields(self, payload: Tree, state_fields: tuple[Tree, dict[str, Tensor]], batches: Any,
                       lr: float) -> Any:
        """``_update`` with the algorithm's real-valued fields of this client's replica (``train_together``: trials
        of a search that differ in them): ``state_fields`` is (the client state, {field: value})."""
        state, fields = state_fields
        alg = with_fields(self.alg, fields, payload)
        return alg.client_update(self.ctx, payload, state, batches, lr)  # type: ignore[arg-type]

    def _update_clients(self, payload: Tree, states: Tree, batches: Any, lr: float) -> Any:
        """``_update``'s clients form (K clients at once: ``Algorithm.client_update_clients``), which the stacked
        executor runs."""
        return self.alg.client_update_clients(self.ctx, payload, states, batches, lr)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------ training
    def train(self, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut:
        """Run ``client_update`` for clients ``ids``; write back the new states of those whose results are finite."""
        assert self.store is not None, "start() first"
        rows = self.rows_of(ids)
        states = T.to(self.store.read(rows), self.device)
        batches = TrainBatches(self.data.seen.train, rows, orders, self.batch_size, self.device, self.drop_last)
        try:
            updates, new_states, losses = self.executor.train(self._update, payload, states, batches, lr,
                                                              clients=self._update_clients)
        except Exception as e:
            name_failure(e, self.alg.name, round_idx, ids, "client_update", self.executor.name)
            raise
        return self.accept(rows, updates, new_states, losses, round_idx)

    def accept(self, rows: Tensor, updates: Tree, new_states: Tree, losses: Tensor, round_idx: int) -> TrainOut:
        """Check the results of clients ``rows`` and keep the new states of those whose results are finite."""
        assert self.store is not None
        ok = torch.isfinite(losses)
        if T.leaves(updates):
            ok &= T.all_finite_rows(updates)
        if T.leaves(new_states):
            ok &= T.all_finite_rows(new_states)
        with host_sync("the round's screen"):  # one device-to-host copy of the flags and losses (fedmtl.hostsync)
            screen = torch.stack([ok.to(torch.float64), losses.detach().to(torch.float64)]).cpu()
        ok, losses = screen[0] > 0, screen[1].to(losses.dtype)
        keep = torch.nonzero(ok).flatten()  # on the host: no wait
        if T.leaves(new_states) and keep.numel():
            dev = T.leaves(new_states)[0].device
            with host_sync("client states to the host store"):
                self.store.write(rows[keep], T.take(new_states, to_device(keep, dev)), round_idx)
        return TrainOut(updates, losses, ok, torch.zeros_like(ok))

    def gossip(self, fn: Callable[[Tree, Tree], tuple[Tree, Tree]], server: Tree, round_idx: int) -> Tree:
        """``fn(server, all states) -> (server, all states)`` over the whole population (decentralized methods)."""
        assert self.store is not None
        try:
            server, states = fn(server, T.to(self.store.read_all(), self.device))
        except Exception as e:
            name_failure(e, self.alg.name, round_idx, None, "sync (gossip)", "the whole population")
            raise
        self.store.write_all(states, round_idx)
        return server

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, group: str, payload: Tree, server: Tree, ids: Tensor, adapt: Orders | None,
                 lr: float) -> dict[str, Any]:
        """Per-client scores of clients ``ids`` of ``group`` ("seen": federation-wide ids; "unseen": indices
        into the unseen clients) on each of their splits, predicting with ``alg.personalize``.  ``adapt``:
        the adaptation orders of ``ids`` (for algorithms that adapt, and for unseen clients)."""
        try:
            return evaluate_together([self], group, [payload], [server], ids, [adapt], lr)[0]
        except Exception as e:
            name_failure(e, self.alg.name, None, ids, f"evaluation of the {group} clients (personalize, predict)",
                         self.executor.name)
            raise

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        assert self.store is not None
        return self.store.state_dict()

    def commit(self) -> None:
        if self.store is not None:
            self.store.commit()

    def read(self, ids: Tensor) -> Tree:
        """Client states of federation-wide ids ``ids`` (stacked), e.g. Ditto's personal models after a run."""
        assert self.store is not None
        return self.store.read(self.rows_of(ids))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def name_failure(exc: BaseException, algorithm: str, round_idx: int | None, ids: Tensor | None, stage: str,
                 executor: str) -> None:
    """Add to ``exc`` (raised inside a client's function) a note naming the algorithm, round, client(s) and stage;
    the exception itself, its type and message, are kept (fedjax's debug backend names the failing client)."""
    if getattr(exc, "fedmtl_named", False):
        return
    rows = getattr(exc, "fedmtl_rows", None)
    who = f"every client ({executor})"
    if ids is not None:
        failed = sorted(ids.tolist() if rows is None else ids[torch.as_tensor(rows, dtype=torch.long)].tolist())
        shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
        who = f"client {failed[0]} ({executor} executor)" if len(failed) == 1 else (
            f"one of clients [{shown}] (one batched {executor} call; run.runner = 'loop' names the client)")
    when = "" if round_idx is None else f", round {round_idx + 1}"
    exc.add_note(f"fedmtl: raised in {algorithm}'s {stage}{when}, {who}")
    exc.fedmtl_named = True  # type: ignore[attr-defined]


def concat_orders(orders: list[Orders]) -> Orders:
    """The batch orders of several client lists as one list's (their clients one after the other)."""
    offsets = [0]
    for o in orders:
        offsets.append(offsets[-1] + int(o.starts[-1]))
    starts = torch.cat([orders[0].starts[:1]] + [o.starts[1:] + off for o, off in zip(orders, offsets, strict=False)])
    limits = [o.limit for o in orders]
    limit = None if any(x is None for x in limits) else torch.cat(limits)  # type: ignore[arg-type]
    return Orders(torch.cat([o.local for o in orders], dim=1), starts, limit)


def real_fields(cls: type[Algorithm]) -> list[str]:
    """The init fields of an algorithm class declared ``float`` (plain or ``Annotated``): the values batched
    replicas can carry per client (``with_fields``; ``fedmtl tune --batch-trials``)."""
    hints = type_hints(cls)

    def real(tp: Any) -> bool:
        return (typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp) is float

    return [f.name for f in dataclasses.fields(cls) if f.init and real(hints.get(f.name))]


def differing_fields(algs: list[Algorithm]) -> dict[str, list[float]]:
    """The fields in which algorithms of one class differ, {field: each one's value}; ``ValueError`` where they
    differ in class or in a field that is not a real number (those cannot be carried by batched replicas)."""
    first = algs[0]
    if any(type(a) is not type(first) for a in algs):
        raise ValueError("train_together: the replicas must run one algorithm")
    real = real_fields(type(first))
    out: dict[str, list[float]] = {}
    for f in dataclasses.fields(first):
        values = [getattr(a, f.name) for a in algs]
        if not f.init or all(v == values[0] for v in values):
            continue
        if f.name not in real or not all(isinstance(v, float | int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"train_together: the replicas differ in algorithm.{f.name} = {values}, which is not "
                             "a real-valued field (only those are carried per replica)")
        out[f.name] = [float(v) for v in values]
    return out


def with_fields(alg: Algorithm, fields: dict[str, Tensor], like: Tree) -> Algorithm:
    """``alg`` with ``fields`` set to one client's values: where they are plain 0-d tensors (the loop executor),
    ``dataclasses.replace`` with their float values, which is the replica's own algorithm exactly; inside a vmap
    (batched values) a copy holding the values as tensors of ``like``'s floating dtype, which the algorithm's
    arithmetic carries per client (a field used in Python control flow fails there: ``train_together`` then runs
    the replicas apart).  ``__post_init__`` does not run on that copy: it only checks values (every built-in), and
    each replica's own algorithm was checked with its own."""
    if not fields:
        return alg
    try:
        return dataclasses.replace(alg, **{k: float(v) for k, v in fields.items()})
    except RuntimeError:  # batched values (inside vmap): float() is refused
        pass
    dtype = next((x.dtype for x in T.leaves(like) if x.is_floating_point()), torch.get_default_dtype())
    copy = object.__new__(type(alg))
    copy.__dict__.update(alg.__dict__)
    for k, v in fields.items():
        object.__setattr__(copy, k, v.to(dtype))
    return copy


#: (algorithm class, fields) that failed to run batched: their replicas train apart from then on
_APART: set[tuple[type, tuple[str, ...]]] = set()


#: the share of the device's memory (the host's RAM on a CPU, a GPU's total memory: fixed, so that a run takes the
#: same path every round and on every call, whatever else holds memory) that one payload copy per client may take
#: in a batched round of several replicas; above it the replicas train one after the other, each replica's clients
#: sharing its one payload (pFedHN's payload is its hypernetwork: 64 MB on the Fashion-MNIST MLP, so 50 clients x 5
#: seeds would hold 16 GB)
PAYLOAD_COPIES_SHARE = 0.5


def payload_copies_fit(payload: Tree, clients: int, device: torch.device) -> bool:
    """Whether ``clients`` copies of ``payload`` (``train_together``'s layout) fit ``PAYLOAD_COPIES_SHARE`` of the
    memory of ``device``."""
    from ..machine import physical_memory

    nbytes = sum(t.numel() * t.element_size() for t in T.leaves(payload)) * clients
    room = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else physical_memory()
    return nbytes <= PAYLOAD_COPIES_SHARE * room


def train_together(members: list[LocalClients], payloads: list[Tree], ids: list[Tensor], orders: list[Orders],
                   lr: float | list[float], round_idx: int) -> list[TrainOut]:
    """One round of several replicas of a run (``fedmtl.runs.seeds``) as one batched computation: replica i's
    clients ``ids[i]`` train from ``payloads[i]`` in ``orders[i]`` with their states in ``members[i]``'s store.
    The replicas share the data and the executor (``members[0]``'s) and run one algorithm; every client's result is
    what ``members[i].train`` alone gives it.  ``lr``: the replicas' rate, or each replica's own (trials of a search
    that differ in ``optim.lr``, ``fedmtl.runs.tune``): a rate per client then goes to the executor, and the
    results agree with ``members[i].train`` alone to rounding (``optim.local_sgd`` with a tensor rate).  Replicas
    whose algorithms differ in real-valued fields (trials over ``algorithm.mu``, ``algorithm.lam``, ...) carry
    each client's values with its state (``with_fields``): exact on the loop executor, to rounding under vmap; an
    algorithm whose update cannot take them batched (a field in Python control flow) trains its replicas apart,
    with one warning; so do replicas whose payload copies, one per client, would not fit the device
    (``payload_copies_fit``)."""
    first = members[0]
    if any(m.data is not first.data for m in members):
        raise ValueError("train_together: the replicas must share one FederatedData")
    fields = differing_fields([m.alg for m in members])
    key = (type(first.alg), tuple(fields))
    if (fields and key in _APART) or not payload_copies_fit(payloads[0], sum(len(i) for i in ids), first.device):
        lrs = lr if isinstance(lr, list) else [lr] * len(members)
        return [m.train(p, i, o, r, round_idx) for m, p, i, o, r in zip(members, payloads, ids, orders, lrs,
                                                                          strict=True)]
    rows = [m.rows_of(i) for m, i in zip(members, ids, strict=True)]
    states = [T.to(m.store.read(r), m.device) for m, r in zip(members, rows, strict=True)]  # type: ignore[union-attr]
    sizes = [len(r) for r in rows]
    replica = to_device(torch.repeat_interleave(torch.arange(len(members)), torch.tensor(sizes)), first.device)
    payload = T.take(T.stack(payloads), replica)  # each client's own replica's payload
    stacked = T.tmap(lambda *xs: torch.cat(xs), *states) if T.leaves(states[0]) else states[0]
    all_rows = torch.cat(rows)
    batches = TrainBatches(first.data.seen.train, all_rows, concat_orders(orders), first.batch_size, first.device,
                           first.drop_last)
    rate: float | Tensor = lr if not isinstance(lr, list) else lr[0] if len(set(lr)) == 1 else \
        to_device(torch.repeat_interleave(torch.tensor(lr, dtype=torch.float64), torch.tensor(sizes)), first.device)
    if not fields:
        updates, new_states, losses = first.executor.train(first._update, payload, stacked, batches, rate,
                                                           payload_rows=True)
    else:
        values = {k: to_device(torch.repeat_interleave(torch.tensor(v, dtype=torch.float64), torch.tensor(sizes)),
                               first.device) for k, v in fields.items()}
        try:
            updates, new_states, losses = first.executor.train(first._update_fields, payload, (stacked, values),
                                                               batches, rate, payload_rows=True)
        except Exception as e:  # noqa: BLE001 (run apart: a genuine error is raised again there)
            _APART.add(key)
            log.warning("%s: the replicas' algorithm.%s cannot be carried batched (%s: %s); they train one after "
                        "the other", first.alg.name, ", algorithm.".join(fields), type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return train_together(members, payloads, ids, orders, lr, round_idx)
    outs, at = [], 0
    for m, r, k in zip(members, rows, sizes, strict=True):
        seg = torch.arange(at, at + k, device=losses.device)
        outs.append(m.accept(r, T.take(updates, seg), T.take(new_states, seg), losses[at:at + k], round_idx))
        at += k
    return outs


def eval_elems(model: Model, data: FederatedData) -> tuple[int, int]:
    """(elements per example, per client) that evaluation holds, which ``run.eval_chunk_elems`` bounds for each chunk
    of clients: an example's peak activations (``Model.activation_elems``, measured once on two of the data's
    examples; at least its features), and a client's own model (the model's parameters)."""
    per_ex = int(np.prod(data.feature_shape)) or 1
    x = data.seen.train.x
    if len(x) < 2 and data.unseen is not None:
        x = data.unseen.train.x
    if len(x) >= 2:
        per_ex = max(per_ex, model.activation_elems(x[:2]))
    return per_ex, sum(p.numel() for p in model.module.parameters())


def evaluate_together(members: list[LocalClients], group: str, payloads: list[Tree], servers: list[Tree], ids: Tensor,
                      adapts: list[Orders | None], lr: float) -> list[dict[str, Any]]:
    """``LocalClients.evaluate`` of the same clients ``ids`` for several replicas of a run (their own stores,
    payloads and adaptation orders, one shared dataset): each chunk of evaluation data is gathered (padded) once
    and every replica predicts on it.  (A vmap over the replicas inside the vmap over clients is slower than this
    loop: torch's batching rule copies the shared inputs once per replica.)"""
    first = members[0]
    assert all(m.store is not None and m.ctx is not None for m in members), "start() first"
    alg, ctx, seen = first.alg, first.ctx, group == "seen"
    assert ctx is not None
    grp = first.data.group(group)
    rows = first.rows_of(ids) if seen else ids.to(torch.long).cpu()
    splits = grp.splits()
    cmax = torch.stack([s.counts[rows] for s in splits.values()]).max(0).values
    per_ex, per_model = eval_elems(ctx.model, first.data)
    res = [{k: (torch.zeros(len(rows), dtype=torch.float64), torch.zeros(len(rows), dtype=torch.float64))
            for k in splits} for _ in members]
    executor = first.executor

    def personalize(p: Tree, s: Tree, b: Any) -> Tree:
        try:
            return alg.personalize(ctx, p, s, b, lr, seen)
        except (AttributeError, TypeError) as e:
            if b is None and "NoneType" in str(e):  # a personalize that reads the training batches it was not given
                raise type(e)(f"{alg.name}.personalize: {e} -- it got batches=None; a method whose personalize uses "
                              "the client's training batches (fine-tuning, EM steps) must declare "
                              "needs_adaptation = True") from e
            raise

    def predict(_: Any, es: Tree, x: Tensor) -> Tensor:
        return alg.predict_log_proba(ctx, es, x)

    for pos in chunks(cmax, per_ex, first.eval_chunk_elems, per_model):
        r = rows[pos]
        eval_states = []
        for m, payload, server, adapt in zip(members, payloads, servers, adapts, strict=True):
            states = m.store.read(r) if seen else alg.init_clients(ctx, server, ids[pos])  # type: ignore[union-attr]
            states = T.to(states, m.device)
            b = None if adapt is None else T.to(round_batches(grp.train, rows, adapt, pos, m.batch_size), m.device)
            if not T.leaves(states) and b is None:  # one state for every client: a global model
                eval_states.append(T.broadcast(personalize(payload, states, None), len(pos)))
            else:
                eval_states.append(executor.map(personalize, payload, states, b))
        for name, split in splits.items():
            x, y, mask = (t.to(first.device) for t in padded(split, r))
            per_rep = [executor.map(predict, None, es, x) for es in eval_states]
            for i, lp in enumerate(per_rep):
                c, l = scores(lp, y, mask)
                res[i][name][0][pos] = c.double().cpu()
                res[i][name][1][pos] = l.double().cpu()
    return [{name: per_client(c, l, splits[name].counts[rows], ids) for name, (c, l) in ri.items()} for ri in res]
