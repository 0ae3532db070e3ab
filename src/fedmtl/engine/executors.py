"""Executors: run one per-client function over a set of clients and return the clients' stacked outputs.

That is all an executor does; the round loop (``engine.round``) decides what runs where.

* ``vmap``: the clients as one batched computation (``torch.func.vmap``).  For training, clients are
  grouped into buckets of similar step counts (powers of two; ``bucketing = "none"`` pads everyone to the
  largest), each bucket one vmap call at most ``chunk_size`` clients wide.  Padded steps are exact no-ops
  (``optim.masked_steps``), so the grouping never changes the result.
* ``loop``: one client at a time over the same function, with unpadded (ragged) batches as a DataLoader
  gives; the reference in tests, readable tracebacks, and the faster path for compute-bound models on CPU.
* ``stacked``: the clients as one eager computation on stacked tensors, no transform: the function's clients form
  (``clients``: the algorithm's ``client_update_clients``) runs once on all of them (``ClientBatches``), each local
  step on the clients still live (a prefix), updating their stacked parameters in place.  For methods with a clients
  form (``Algorithm.clients_form``) on models with one (``models.stacking.supports_clients``); a round's sequential
  steps are then the largest client's, with no padding computed.
* ``flower`` (``fedmtl.flower.executor``) sends the function's inputs to SuperNodes, which run it with one
  of the above.

``auto`` (``make_executor``) picks ``stacked`` for models with a clients form (methods without one fall back to
``vmap``, or to ``loop`` for recurrent layers on a GPU) except on a CPU for models that declare
``prefer_loop_on_cpu`` (convolutions, recurrent layers), which loop there, and ``vmap`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.func import vmap

from .. import tree as T
from ..data.federated import (
    Orders,
    Split,
    client_batches,
    ragged_batches,
    round_batches,
    steps_per_epoch,
    usable_counts,
)
from ..hostsync import to_device
from ..models.base import Model
from ..models.stacking import closed_form_clients, supports_clients, verify_clients
from ..optim import Batches, ClientBatches, with_all_live

ExecutorName = Literal["auto", "stacked", "vmap", "loop"]


class TrainBatches:
    """The training batches of a round's clients: rows ``rows`` of ``split`` visiting their examples in
    ``orders``; built per bucket (padded) or per client (ragged) and moved to ``device`` only then."""

    def __init__(self, split: Split, rows: Tensor, orders: Orders, batch_size: int, device: torch.device,
                 drop_last: bool = False):
        self.split, self.rows, self.orders, self.batch_size, self.device = split, rows, orders, batch_size, device
        self.drop_last = drop_last
        self.counts = usable_counts(split.counts[rows], batch_size, drop_last)  # what the steps cover: bucketing's key

    def padded(self, pos: Tensor) -> Batches:
        """The clients at ``pos`` padded to one shape, with the steps live for all of them (``Batches.all_live``)
        read on the host before the batches move to the device."""
        b = round_batches(self.split, self.rows, self.orders, pos, self.batch_size, drop_last=self.drop_last,
                          tables_on_host=True)
        return T.to(with_all_live(b), self.device)

    def ragged(self, i: int) -> Batches:
        """Client ``i``'s batches unpadded, its live steps (``Batches.all_live``) read on the host: the loop over its
        steps branches on them without waiting for the device."""
        b = ragged_batches(self.split, self.rows, self.orders, i, self.batch_size, self.drop_last)
        live = torch.ones(len(b.x), dtype=torch.bool)
        if b.limit is not None:
            live &= torch.arange(len(b.x)) < b.limit
        return T.to(b._replace(all_live=tuple(live.tolist())), self.device)

    def live_counts(self) -> Tensor:
        """(K,) the live steps of every client: its epochs' batches, within its straggler limit."""
        epochs = self.orders.local.shape[0]
        steps = steps_per_epoch(self.counts, self.batch_size) * epochs
        if self.orders.limit is not None:
            steps = torch.minimum(steps, self.orders.limit.cpu())
        return steps

    def clients(self, pos: Tensor, transform: Callable[[Tensor], Tensor] | None,
                workspace: tuple[Workspace, Workspace] | None = None, first_epoch: bool = False) -> ClientBatches:
        """The ``stacked`` executor's batches of the clients at ``pos`` (sorted by live steps, most first;
        ``data.federated.client_batches``; with their first epochs where asked), features through ``transform``
        (into ``workspace`` where the transform can write into storage it is given: ``ImageNormalize.into``), on
        the device: the features travel in their stored dtype (where the federation is not resident there,
        ``engine.resident``) and are converted there."""
        d = client_batches(self.split, self.rows, self.orders, pos, self.batch_size, self.drop_last, first_epoch)

        def features(x: Tensor, ws: Workspace | None) -> Tensor:  # (N, B, ...) through the transform, on the device
            x = to_device(x, self.device)  # in the stored dtype (uint8 images): converted on the device, not the host
            if transform is None:
                return x
            into = getattr(transform, "into", None)
            if into is not None and ws is not None:
                flat = into(x.reshape(-1, *x.shape[2:]), ws.take(x.numel(), x.device))
            else:
                flat = transform(x.reshape(-1, *x.shape[2:]))
            return flat.reshape(x.shape[0], x.shape[1], *flat.shape[1:])

        x = features(d.x, None if workspace is None else workspace[0])
        first = None
        if d.first is not None:
            x0 = d.first[0]
            if x0.data_ptr() == d.x.data_ptr() and x0.numel() == d.x.numel():  # the batches themselves
                x0 = x.reshape(-1, *x.shape[2:])
            else:
                x0 = features(x0.unsqueeze(0), None if workspace is None else workspace[1]).squeeze(0)
            first = (x0, *d.first[1:])
        return ClientBatches(*T.to((x, d.y, d.mask, d.n), self.device), d.live, T.to(d.pos, self.device),
                             T.to(first, self.device))


class Workspace:
    """One float32 buffer reused for the features of successive batched calls (grown when a call needs more): a
    round's converted batches then cost no fresh allocation (whose first touch the kernel pays page by page).  The
    features of a call are dead when the next call takes the buffer (a client function's outputs never alias
    its batches)."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None

    def take(self, numel: int, device: torch.device) -> Tensor:
        if self.buffer is None or self.buffer.numel() < numel or self.buffer.device != device:
            self.buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self.buffer


def _in_dims(*args: Any) -> tuple[Any, ...]:
    return tuple(T.batch_dims(a) for a in args)


class Executor:
    """Runs ``fn`` for each of K clients; outputs stacked along a leading K axis."""

    name = "executor"

    def train(self, fn: Callable[..., Any], payload: Any, states: Any, batches: TrainBatches, lr: float | Tensor,
              payload_rows: bool = False, clients: Callable[..., Any] | None = None) -> Any:
        """``fn(payload, state, batches, lr)`` for every client; ``states`` stacked (K, ...).  ``payload_rows``:
        the payload is stacked too, one row per client (replicas of a run with several seeds, each client
        training from its own replica's model).  ``clients``: ``fn``'s clients form, ``clients(payload, states,
        client_batches, lr)`` for K clients at once (``Algorithm.client_update_clients``), which only the stacked
        executor runs.  ``lr``: one rate, or a (K,) tensor of rates, one per client (replicas of different runs
        batched together, ``clients.train_together``: the vmap executor maps it with the clients, the loop executor
        gives each client its own as a float, the stacked executor leaves such a call to its fallback)."""
        raise NotImplementedError

    def map(self, fn: Callable[..., Any], shared: Any, *stacked: Any) -> Any:
        """``fn(shared, *row_k)`` for every row k of the stacked arguments (``None`` arguments pass through)."""
        raise NotImplementedError

    def for_algorithm(self, alg: Any) -> Executor:
        """The executor that trains ``alg``'s clients (this one; the stacked executor may hand over to vmap)."""
        return self


class VmapExecutor(Executor):
    name = "vmap"

    def __init__(self, chunk_size: int = 0, bucketing: Literal["steps", "none"] = "steps"):
        self.chunk_size, self.bucketing = chunk_size, bucketing
        self._train_fns: dict[tuple[Callable[..., Any], bool, Any, bool], Callable[..., Any]] = {}

    def buckets(self, counts: Tensor, batch_size: int) -> list[Tensor]:
        """Positions (into the K clients) grouped into vmap calls."""
        steps = steps_per_epoch(counts, batch_size)
        if self.bucketing == "steps":
            key = torch.ceil(torch.log2(steps.double().clamp_min(1))).long()
        else:
            key = torch.zeros_like(steps)
        groups: list[Tensor] = []
        for v in torch.unique(key):
            pos = torch.nonzero(key == v).flatten()
            pos = pos[torch.argsort(counts[pos], stable=True)]
            groups += list(torch.split(pos, self.chunk_size or len(pos)))
        return groups

    def train(self, fn: Callable[..., Any], payload: Any, states: Any, batches: TrainBatches, lr: float | Tensor,
              payload_rows: bool = False, clients: Callable[..., Any] | None = None) -> Any:
        outs, where = [], []
        for pos in self.buckets(batches.counts, batches.batch_size):
            # the steps live for the whole bucket skip local_sgd's dead-step masking (``Batches.all_live``)
            p, b = to_device(pos, batches.device), batches.padded(pos)
            dims = T.batch_dims(b)  # 0 on the tensors, None on the flags and on fields left None
            rows_lr = isinstance(lr, Tensor)  # a rate per client (replicas with rates of their own, batched)
            key = (fn, payload_rows, dims, rows_lr)
            vfn = self._train_fns.get(key)
            if vfn is None:
                vfn = self._train_fns[key] = vmap(fn, in_dims=(0 if payload_rows else None, 0, dims,
                                                               0 if rows_lr else None), randomness="error")
            try:
                outs.append(vfn(T.take(payload, p) if payload_rows else payload, T.take(states, p), b,
                                lr[p] if isinstance(lr, Tensor) else lr))
            except Exception as e:
                failed_at(e, pos.tolist())
                raise
            where.append(pos)
        if len(outs) == 1:
            inverse = to_device(torch.argsort(where[0]), batches.device)
            return T.tmap(lambda x: x[inverse], outs[0])
        k = len(batches.counts)
        dst = [to_device(w, batches.device) for w in where]

        def place(*xs: Tensor) -> Tensor:  # each bucket's rows copied once into their clients' positions
            out = xs[0].new_empty((k, *xs[0].shape[1:]))
            for d, x in zip(dst, xs, strict=True):
                out.index_copy_(0, d, x)
            return out

        return T.tmap(place, *outs)

    def map(self, fn: Callable[..., Any], shared: Any, *stacked: Any) -> Any:
        return vmap(fn, in_dims=(None, *_in_dims(*stacked)), randomness="error")(shared, *stacked)


def failed_at(exc: BaseException, rows: list[int]) -> None:
    """Record on ``exc`` the rows of the call whose client function raised it (the innermost executor that knows
    them first: a loop names one row, a batched call its rows); ``LocalClients`` turns them into client ids."""
    if not hasattr(exc, "fedmtl_rows"):
        exc.fedmtl_rows = rows  # type: ignore[attr-defined]


class LoopExecutor(Executor):
    name = "loop"

    def train(self, fn: Callable[..., Any], payload: Any, states: Any, batches: TrainBatches, lr: float | Tensor,
              payload_rows: bool = False, clients: Callable[..., Any] | None = None) -> Any:
        result = None
        for i in range(len(batches.rows)):  # written straight into a preallocated stack
            try:
                out = fn(T.take(payload, i) if payload_rows else payload, T.take(states, i), batches.ragged(i),
                         float(lr[i]) if isinstance(lr, Tensor) else lr)
            except Exception as e:
                failed_at(e, [i])
                raise
            if result is None:
                result = T.tmap(lambda x: x.new_empty((len(batches.rows), *x.shape)), out)
            for dst, src in zip(T.leaves(result), T.leaves(out), strict=True):
                dst[i] = src
        return result

    def map(self, fn: Callable[..., Any], shared: Any, *stacked: Any) -> Any:
        k = next(len(x) for a in stacked if a is not None for x in T.leaves(a))
        rows = [fn(shared, *(None if a is None else T.take(a, i) for a in stacked)) for i in range(k)]
        return T.stack(rows)


class StackedExecutor(Executor):
    """All clients of a call as one eager computation on stacked tensors, no torch.func transform: each local step
    runs on the clients still live at that step (a prefix, the clients sorted by their number of steps, most first),
    updating their stacked parameters in place (``optim.local_sgd_clients``, ``models.stacking``).  Nothing is padded
    or masked and every step is one batched product per layer, so a round's sequential steps are the largest client's,
    not the sum of the step buckets'.  It runs the clients form of the function it is given (``train``'s ``clients``:
    the algorithm's ``client_update_clients``), for algorithms that have one (``Algorithm.clients_form``) and models
    that have one (``models.stacking.supports_clients``); others use ``fallback`` (vmap)."""

    name = "stacked"

    def __init__(self, model: Model, fallback: Executor, chunk_size: int = 0):
        self.model, self.fallback, self.chunk_size = model, fallback, chunk_size
        # the features of a call (and of the clients' first epochs), converted in place of the previous call's
        self.workspace = (Workspace(), Workspace())
        self.first_epoch = False  # build the clients' first epochs (``Algorithm.stacked_first_epoch``)

    def for_algorithm(self, alg: Any) -> Executor:
        """This executor where ``alg`` has a clients form, else the fallback."""
        if alg.clients_form() and supports_clients(self.model):
            self.first_epoch = bool(getattr(alg, "stacked_first_epoch", False))
            return self
        return self.fallback

    def train(self, fn: Callable[..., Any], payload: Any, states: Any, batches: TrainBatches, lr: float | Tensor,
              payload_rows: bool = False, clients: Callable[..., Any] | None = None) -> Any:
        if payload_rows or clients is None or isinstance(lr, Tensor):  # several models (merged replicas), no clients
            # form, or a rate per client
            return self.fallback.train(fn, payload, states, batches, lr, payload_rows)
        steps = batches.live_counts()
        order = torch.argsort(-steps, stable=True)  # most steps first: the live clients of every step are a prefix
        outs = []
        for pos in torch.split(order, self.chunk_size or max(len(order), 1)):
            p = to_device(pos, batches.device)
            b = batches.clients(pos, self.model.input_transform, self.workspace, self.first_epoch)
            if not self._verified(b):  # a clients form that does not reproduce the module: the fallback's path
                return self.fallback.train(fn, payload, states, batches, lr, payload_rows)
            try:
                outs.append(clients(payload, T.take(states, p), b, lr))
            except Exception as e:
                failed_at(e, pos.tolist())
                raise
        out = outs[0] if len(outs) == 1 else T.tmap(lambda *xs: torch.cat(xs), *outs)
        inverse = to_device(torch.argsort(order), batches.device)
        return T.tmap(lambda x: x.index_select(0, inverse), out)

    def _verified(self, b: ClientBatches) -> bool:
        """Whether the model's clients form may run: verified on these batches' first examples where the engine
        did not verify it on the data before (``models.stacking.verify_clients``)."""
        form = self.model.clients_form
        if form is not None and form.usable is None:
            real = b.mask.reshape(-1) > 0
            verify_clients(self.model, b.x.reshape(-1, *b.x.shape[2:])[real][:6])
        return supports_clients(self.model)

    def map(self, fn: Callable[..., Any], shared: Any, *stacked: Any) -> Any:
        return self.fallback.map(fn, shared, *stacked)


#: executor name -> its constructor from (model, chunk_size, bucketing, the stacked executor's fallback); a new
#: executor is a class and one line here
EXECUTORS: dict[str, Callable[[Model, int, Literal["steps", "none"], str], Executor]] = {
    "vmap": lambda model, chunk, bucketing, fallback: VmapExecutor(chunk, bucketing),
    "loop": lambda model, chunk, bucketing, fallback: LoopExecutor(),
    "stacked": lambda model, chunk, bucketing, fallback: StackedExecutor(
        model, EXECUTORS[fallback](model, chunk, bucketing, fallback), chunk),
}


def make_executor(name: ExecutorName, model: Model, device: torch.device, chunk_size: int = 0,
                  bucketing: Literal["steps", "none"] = "steps") -> Executor:
    """The executor ``name``.  ``auto`` decides by rule: ``stacked`` for models with the stacked closed form, for
    models with a clients form (``models.stacking.supports_clients``: verified on the data) that do not prefer the
    loop on a CPU, and on a GPU for every model with a clients form; ``loop`` for the rest of those that prefer it on
    this device (``prefer_loop_on_cpu``: convolutions and recurrent layers are compute-bound and run fastest client by
    client on a CPU; ``prefer_loop_on_cuda``: recurrent layers, whose per-client cuDNN kernel beats a vmapped
    recurrence on a GPU, though not the stacked one: ``fedmtl bench models --device cuda``, LSTM); ``vmap`` for the
    rest.  The stacked executor hands algorithms without a clients form (and evaluation) to the path the model
    would take without one."""
    cuda = device.type == "cuda"
    loop = model.prefer_loop_on_cuda if cuda else model.prefer_loop_on_cpu
    fallback = "loop" if loop else "vmap"
    chosen: str = name
    if name == "auto":
        chosen = "stacked" if supports_clients(model) and (closed_form_clients(model) or not loop or cuda) else fallback
    if chosen == "stacked" and not supports_clients(model):
        raise ValueError(f"run.runner = 'stacked': model {model.name!r} has no clients form (a closed-form "
                         "stacked gradient: linear, mlp or a converted dense user module; or a clients form "
                         "verified on the data: user modules and the built-in CNNs); use vmap or loop")
    if chosen in EXECUTORS:
        return EXECUTORS[chosen](model, chunk_size, bucketing, fallback)
    raise ValueError(f"unknown executor {name!r}; use auto, stacked, vmap or loop")
