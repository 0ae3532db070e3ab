"""Asynchronous federated learning on the systems clock: FedAsync and FedBuff (the ``[async]`` table).

* FedAsync: Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", OPT workshop (NeurIPS) 2020, Algorithm 1:
  every arriving update x_new is mixed into the server model at once, x <- (1 - alpha_t) x + alpha_t x_new with
  alpha_t = alpha s(t - tau), tau the server version the client started from and s a staleness function
  (Section 5.2): constant s = 1, polynomial s_a(t - tau) = (t - tau + 1)^(-a), hinge s_{a,b}(t - tau) = 1 if
  t - tau <= b else 1 / (a (t - tau - b) + 1).
* FedBuff: Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated Learning with Buffered Asynchronous
  Aggregation", AISTATS 2022, Algorithm 1: the server keeps a buffer of the clients' changes Delta_i = y_i - x_{tau_i},
  each weighted by s(t - tau_i) (the paper's s(tau) = 1 / sqrt(1 + tau): ``polynomial`` with a = 0.5), and after K
  of them steps x <- x + eta_g * mean_i s_i Delta_i.  Deviation: the mean weights the buffered clients by their
  sample counts (the engine's FedAvg weights; the paper averages them uniformly: equal when clients are equal).

The simulation is event-ordered on the systems clock (``fedmtl.engine.systems``): ``concurrency`` clients train at
once; a client dispatched at simulated time t0 finishes at t0 + (its full local work at its drawn device speed +
the payload down and its update up on the network model), the server handles arrivals in time order (ties by
dispatch order), and each freed slot is given at once to a client drawn uniformly from the idle ones.  A client
whose update waits in FedBuff's buffer is not drawn again before the buffer is applied.  A dropped client
(``[systems] drop_prob``, ``never_respond``) never trains and frees its slot when its reply would have come.
Clients do all their local steps (no deadline: an asynchronous server has no round to cut short).

One engine "round" is one server step (one arrival for FedAsync, K for FedBuff): ``run.rounds`` counts server
steps, the metrics carry ``est_time_s``, the simulated clock.  Training is exact and batched: a client's update
depends only on the model version it was sent, so the clients dispatched at one version train together, in one
executor call (``Engine.train``), just before the server model changes (their arrival times are known without
training them).  Each server step ends with the synchronous round's books (``Engine.settle``).  Each
client keeps its own state (Ditto's personal model, FedEM's pi) as it would synchronously; an evaluation while a
client is in flight sees the state it will return with.

Any method whose clients send models in the coordinates of the payload (``Algorithm.runs_async``: FedAvg, FedProx,
FedAvg+, FedLC, Ditto, FedPer, FedRep, FedBABU, LG-FedAvg, FedRoD, FedEM, GPFL) runs asynchronously, personalized ones
included: FedBuff aggregates, with the method's own ``aggregate``, the buffered updates rebased on the current
payload, x_now + s_i (y_i - x_{tau_i}); FedAsync mixes the method's aggregate of the one arriving update into the
server state.  With a buffer of every client, everyone dispatched together and no staleness, FedBuff is the
synchronous method (tested).  Deterministic given the seed; the in-flight clients are checkpointed, so a resumed
run repeats an uninterrupted one.  Simulation only (not over Flower or torchrun).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm
from ..data.federated import Orders
from ..tree import Tree
from .clients import Clients, LocalClients, RoundPlan, TrainOut
from .sampling import clients_per_round
from .spec import RunSpec


class EngineState(Protocol):
    """What this module reads and writes of ``round.EngineState`` (a protocol: ``round`` imports this module)."""

    server: Any
    round: int
    asynchronous: Any


class Engine(Protocol):
    """The public steps of ``round.Engine`` this module schedules (a protocol, for the same reason)."""

    spec: RunSpec
    payload_bytes: float

    @property
    def num_clients(self) -> int: ...

    def counts(self, ids: Tensor) -> Tensor: ...

    def step_budget(self, counts: Tensor) -> np.ndarray: ...

    def estimated_seconds(self, steps: float, nbytes: float) -> float: ...

    def local_lr(self, r: int) -> float: ...

    def payload(self, server: Tree) -> Tree: ...

    def batch_orders(self, counts: Tensor, r: int) -> Orders: ...

    def train(self, plan: RoundPlan) -> TrainOut | None: ...

    def aggregate(self, server: Tree, updates: Tree, weights: Tensor, ids: Tensor) -> Tree: ...

    def settle(self, state: Any, *, lr: float, ids: Tensor, bad: Tensor, dropped: int, excluded: int, loss: float,
               clock: float) -> dict[str, Any]: ...


log = logging.getLogger("fedmtl")

FIELDS = ("ids", "version", "dispatch", "arrival", "dropped", "trained", "ok", "loss", "buffered")


@dataclass
class AsyncState:
    """The clients in flight (or waiting in the buffer), one entry each, and the clock.  ``held`` holds each trained
    entry's update (FedAsync) or its change from the payload it was sent (FedBuff), stacked (P, ...) in the update's
    structure."""

    clock: float
    version: int
    dispatched: int
    cols: dict[str, np.ndarray]
    held: Tree | None

    @classmethod
    def empty(cls) -> AsyncState:
        cols = {"ids": np.zeros(0, np.int64), "version": np.zeros(0, np.int64), "dispatch": np.zeros(0, np.int64),
                "arrival": np.zeros(0), "dropped": np.zeros(0, bool), "trained": np.zeros(0, bool),
                "ok": np.zeros(0, bool), "loss": np.zeros(0), "buffered": np.zeros(0, bool)}
        return cls(0.0, 0, 0, cols, None)

    def __len__(self) -> int:
        return len(self.cols["ids"])

    def named(self) -> dict[str, Tensor]:
        """Flat named tensors for a checkpoint (no pickle)."""
        out = {"clock": torch.tensor(self.clock, dtype=torch.float64),
               "version": torch.tensor(self.version), "dispatched": torch.tensor(self.dispatched)}
        out.update({f"col.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.cols.items()})
        if self.held is not None:
            out.update({f"held{k}": v.detach().cpu() for k, v in T.to_named(self.held).items()})
        return out

    @classmethod
    def of(cls, named: dict[str, Tensor], like: Tree, device: torch.device) -> AsyncState:
        """Read back ``named`` (a checkpoint's); ``like``: one update, for the structure of ``held``."""
        try:
            cols = {k: named[f"col.{k}"].numpy().copy() for k in FIELDS}
            held_named = {k[len("held"):]: v for k, v in named.items() if k.startswith("held")}
            held = None
            if held_named:
                template = T.tmap(lambda x: x.unsqueeze(0), like)
                held = T.from_named(held_named, template, device, leading=True)
            st = cls(float(named["clock"]), int(named["version"]), int(named["dispatched"]), cols, held)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"checkpoint: malformed asynchronous state ({e})") from e
        if len({len(v) for v in cols.values()}) != 1 or (held is not None and
                                                        any(x.shape[0] != len(st) for x in T.leaves(held))):
            raise ValueError("checkpoint: the asynchronous state's entries disagree in number")
        return st

    def keep(self, mask: np.ndarray) -> None:
        self.cols = {k: v[mask] for k, v in self.cols.items()}
        if self.held is not None:
            idx = torch.from_numpy(np.nonzero(mask)[0])
            self.held = T.tmap(lambda x: x.index_select(0, idx.to(x.device)), self.held)

    def append(self, **values: Any) -> None:
        for k in FIELDS:
            self.cols[k] = np.concatenate([self.cols[k], np.asarray([values[k]], dtype=self.cols[k].dtype)])
        if self.held is not None:
            self.held = T.tmap(lambda x: torch.cat([x, x.new_zeros((1, *x.shape[1:]))]), self.held)


def check(spec: RunSpec, alg: Algorithm, clients: Clients, num_clients: int) -> None:
    """Refuse, before any work, what the asynchronous modes do not run (``ValueError`` naming the key)."""
    cfg = spec.asynchronous
    if not alg.runs_async:
        from ..registry import ALGORITHMS

        able = sorted(n for n, c in ALGORITHMS.items() if c.runs_async)
        raise ValueError(f"[async] mode = {cfg.mode!r}: {alg.name} does not run asynchronously (its clients do not "
                         f"send models in the coordinates of the broadcast); the methods that do: {able}")
    if not isinstance(clients, LocalClients):
        raise ValueError(f"[async] mode = {cfg.mode!r} runs in the simulator only (not over Flower or torchrun)")
    for table, on in (("privacy", spec.privacy.enabled), ("robust", not spec.robust.is_plain),
                      ("attack", spec.attack.active), ("server_opt", spec.server_opt.enabled)):
        if on:
            raise ValueError(f"[async] mode = {cfg.mode!r} does not combine with [{table}] (they act on a synchronous "
                             "round's updates)")
    if cfg.mode == "fedbuff" and cfg.buffer_size > concurrency(spec, num_clients):
        raise ValueError(f"[async] buffer_size = {cfg.buffer_size} exceeds the concurrency "
                         f"{concurrency(spec, num_clients)}: the buffer would never fill")


def concurrency(spec: RunSpec, num_clients: int) -> int:
    """Clients training at once: ``[async] concurrency``, or the run's clients per round."""
    c = spec.asynchronous.concurrency or clients_per_round(spec.run, num_clients)
    return min(c, num_clients)


def _dispatch(engine: Engine, st: AsyncState) -> None:
    """Give the free slots to idle clients drawn uniformly (each draw from the run's seed and the dispatch count),
    with their arrival times on the systems clock."""
    spec, n = engine.spec, engine.num_clients
    seed = spec.run.seed
    while int((~st.cols["buffered"]).sum()) < concurrency(spec, n):
        idle = np.setdiff1d(np.arange(n), st.cols["ids"], assume_unique=True)
        if idle.size == 0:
            return
        d = st.dispatched
        rng = np.random.default_rng(np.random.SeedSequence([seed, d, 17]))
        cid = int(idle[rng.integers(idle.size)])
        budget = float(engine.step_budget(engine.counts(torch.tensor([cid])))[0])
        draw = spec.systems.draw(seed, d, np.asarray([cid]))
        seconds = engine.estimated_seconds(budget / float(draw.speed[0]), engine.payload_bytes)
        st.append(ids=cid, version=st.version, dispatch=d, arrival=st.clock + seconds, dropped=bool(draw.dropped[0]),
                  trained=False, ok=False, loss=math.nan, buffered=False)
        st.dispatched += 1


def _train(engine: Engine, st: AsyncState, server: Tree, lr: float, step_idx: int) -> None:
    """Train every entry dispatched at the current version, in one executor call, and hold its update (FedAsync) or
    its change from the payload (FedBuff)."""
    todo = np.nonzero(~st.cols["trained"] & ~st.cols["dropped"])[0]
    if todo.size == 0:
        return
    order = todo[np.argsort(st.cols["ids"][todo])]  # the executors take sorted ids
    ids = torch.from_numpy(st.cols["ids"][order].copy())
    counts = engine.counts(ids)
    payload = engine.payload(server)
    orders = engine.batch_orders(counts, step_idx)  # one call per server step: the synchronous round's stream
    out = engine.train(RoundPlan(st.version, ids, counts, orders, lr, payload, len(ids), 0, 0.0))
    assert out is not None  # somebody trains
    ok = (out.ok & ~out.failed).cpu().numpy()
    upd = out.updates
    if engine.spec.asynchronous.mode == "fedbuff":
        upd = T.tmap(lambda u, p: u - p.unsqueeze(0).to(u.dtype), upd, _part(payload, upd))  # Delta_i = y_i - x_tau_i
    if st.held is None:
        st.held = T.tmap(lambda u: torch.zeros((len(st), *u.shape[1:]), dtype=u.dtype, device=u.device), upd)
    rows = torch.from_numpy(order)
    st.held = T.tmap(lambda h, u: h.index_copy(0, rows.to(h.device), u.to(h.dtype)), st.held, upd)
    st.cols["trained"][order] = True
    st.cols["ok"][order] = ok
    st.cols["loss"][order] = out.losses.detach().cpu().double().numpy()


def _part(payload: Tree, like: Tree) -> Tree:
    """The entries of ``payload`` an update holds (FedBABU's update is the body of a payload with the fixed head)."""
    if isinstance(payload, dict) and isinstance(like, dict):
        return {k: payload[k] for k in like}
    return payload


def _mix(server: Tree, target: Tree, step: float) -> Tree:
    """server + step (target - server) on the floating-point leaves (the others: the target's)."""
    return T.tmap(lambda s, t: s + step * (t - s) if s.is_floating_point() else t, server, target)


def step(engine: Engine, state: EngineState) -> dict[str, Any]:
    """One server step of the asynchronous modes, its metrics row: arrivals in time order until the buffer is full
    (one for FedAsync), then the server update, then ``Engine.settle``."""
    cfg = engine.spec.asynchronous
    st: AsyncState = state.asynchronous
    v = state.round
    lr = engine.local_lr(v)
    k = 1 if cfg.mode == "fedasync" else cfg.buffer_size
    dropped = 0
    _dispatch(engine, st)
    while int(st.cols["buffered"].sum()) < k:
        flying = np.nonzero(~st.cols["buffered"])[0]
        if flying.size == 0:
            break
        first = flying[np.lexsort((st.cols["dispatch"][flying], st.cols["arrival"][flying]))[0]]
        st.clock = float(st.cols["arrival"][first])
        if st.cols["dropped"][first]:
            dropped += 1
            keep = np.ones(len(st), bool)
            keep[first] = False
            st.keep(keep)
        else:
            st.cols["buffered"][first] = True
        _dispatch(engine, st)
    _train(engine, st, state.server, lr, v)  # everything dispatched at this version, before the server changes
    buf = np.nonzero(st.cols["buffered"])[0]
    valid = st.cols["ok"][buf]
    stale = st.version - st.cols["version"][buf]
    if valid.any():
        assert st.held is not None
        use = buf[valid]
        idx = torch.from_numpy(use)
        rows = T.tmap(lambda h: h.index_select(0, idx.to(h.device)), st.held)
        ids = torch.from_numpy(st.cols["ids"][use].copy())
        weights = engine.counts(ids).to(torch.float64)
        s = cfg.weight(st.version - st.cols["version"][use])
        if cfg.mode == "fedasync":
            target = engine.aggregate(state.server, rows, weights, ids)
            state.server = _mix(state.server, target, cfg.mixing * float(s[0]))
        else:
            payload = engine.payload(state.server)
            sw = torch.from_numpy(s)
            rebased = T.tmap(lambda p, dl: p.unsqueeze(0) + sw.to(dl.dtype).to(dl.device).reshape(
                -1, *([1] * (dl.dim() - 1))) * dl, _part(payload, rows), rows)  # x_now + s_i Delta_i
            target = engine.aggregate(state.server, rebased, weights, ids)
            state.server = _mix(state.server, target, cfg.server_lr)
        st.version += 1
    arrived = torch.from_numpy(st.cols["ids"][buf])
    losses = st.cols["loss"][buf][valid]
    st.keep(~st.cols["buffered"])
    row = engine.settle(state, lr=lr, ids=arrived, bad=torch.from_numpy(~valid), dropped=dropped,
                        excluded=int((~valid).sum()), loss=float(losses.mean()) if losses.size else float("nan"),
                        clock=st.clock)
    return {**row, "staleness_mean": float(stale.mean()) if stale.size else 0.0,
            "staleness_max": int(stale.max()) if stale.size else 0}
