"""The ``distributed`` executor: one simulation spread over the ranks of a torch.distributed job.

Started by the standard launcher, ``torchrun --nproc-per-node R -m fedmtl run CONFIG --out DIR`` (add ``--nnodes``
and ``--rdzv-endpoint`` for several hosts); ``fedmtl run`` sees the launcher's environment (``launched``).
gloo on CPUs, NCCL on GPUs (one rank per GPU: rank ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``).

**Who holds which client.**  Client ``k`` (seen or unseen) belongs to rank ``k mod R`` (``owned``): round robin,
so that a dataset whose clients are ordered by size gives every rank a similar share of a round's work.  A rank
builds the data, keeps only its clients' examples (``FederatedData.subset``) and holds only their states in its
``ClientStore`` (one R-th of the population's rows).

**A round.**  Every rank runs the round loop's plan itself (sampling, systems draw, batch orders: all drawn from
the run's seed, so they agree without a message); each rank trains its sampled clients with the usual local
executor (``run.runner``: stacked, vmap or loop) and keeps their new states; the per-client results are then
gathered on every rank (``all_gather``, rows padded to the largest rank's count) in the order the one-process
round has them, and every rank runs the same update pipeline and server step on them.  The per-client updates
travel whole, for every algorithm: the server step then needs no change and sees exactly the rows a single
process sees (robust combinations, Krum and the median included; NaN/Inf screening; FedEM's responsibilities).
The DP noise seed is drawn from rank 0's CSPRNG and sent to the others, so every rank adds the same noise.

**The same numbers.**  With the loop executor a client's update does not depend on which other clients share
its process, and the gathered rows are reduced in the one-process order: a run on R ranks is bit-identical to
one process.  The batched executors (stacked, vmap) group a rank's clients differently than one process does;
matrix products of other shapes may round differently in the last bit (measured: within 1e-6, ``tests/
test_distributed.py``).

Evaluation is sharded the same way (each rank its clients of the evaluation sample), the per-client scores
gathered.  Decentralized methods' gossip gathers every rank's client states (it reads the whole population
each round anyway), mixes them identically on every rank and each rank keeps its own rows back.

**Checkpoints.**  Only rank 0 writes the run directory.  At a checkpoint the ranks send their written rows to
rank 0, which writes one checkpoint in the one-process format (rows in client order): a distributed run resumes
from it with any number of ranks, or in one process, and vice versa.  Every rank reads the checkpoint on
``--resume``: with several hosts the run directory must be on a filesystem they share.

**A lost rank.**  A collective that fails (a rank killed, a host gone) raises ``RankLost`` on the survivors
(and torchrun stops the job); a collective that waits longer than ``timeout`` seconds does too.  The run stops
with the last checkpoint intact: resume with the same command and ``--resume``.
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm, Context
from ..data.federated import FederatedData, Orders
from ..tree import Tree
from .clients import LocalClients, TrainOut

#: how long a collective waits for the other ranks before the run stops (seconds); ``--dist-timeout``
DEFAULT_TIMEOUT_S = 1800.0


class RankLost(RuntimeError):
    """A collective of a distributed run failed: another rank stopped (killed, crashed, its host gone)."""


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher setting ``RANK`` and ``WORLD_SIZE``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def owned(num_clients: int, rank: int, world: int) -> Tensor:
    """The clients rank ``rank`` of ``world`` holds: ``k`` with ``k mod world == rank`` (sorted)."""
    return torch.arange(rank, num_clients, world, dtype=torch.long)


@dataclass
class Group:
    """This process's place in the job and the collectives the engine uses.  ``device``: where this rank computes
    (``cuda:LOCAL_RANK`` under NCCL); collectives run on ``comm_device`` (the CPU for gloo)."""

    rank: int
    world: int
    backend: str
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
        """Join the job the launcher started (``init_process_group`` from its environment): NCCL for
        ``run.device = "cuda"`` (this rank's GPU: ``LOCAL_RANK``), gloo for the CPU."""
        if not launched():
            raise ValueError("the distributed executor runs under a launcher: torchrun --nproc-per-node R -m fedmtl "
                             "run CONFIG ... (RANK and WORLD_SIZE are not set)")
        cuda = device.startswith("cuda")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            if not torch.cuda.is_available():
                raise ValueError(f"run.device = {device!r} but this machine has no CUDA device")
            if local >= torch.cuda.device_count():
                raise ValueError(f"rank with LOCAL_RANK {local} but this host has {torch.cuda.device_count()} GPU(s): "
                                 "start at most one rank per GPU (torchrun --nproc-per-node)")
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        backend = "nccl" if cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), backend, dev, timeout_s)

    def close(self) -> None:
        """Tear the process group down while the interpreter is fully alive: the backend's worker threads may hold
        tensors, and freeing them during interpreter shutdown can abort the process (SIGABRT)."""
        if dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()

    # ------------------------------------------------------------------------------------------ collectives
    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RuntimeError, dist.DistError) as e:
            first = (str(e).splitlines() or [""])[0][:300]
            raise RankLost(f"rank {self.rank} of {self.world}: the ranks could not {what} ({type(e).__name__}: "
                           f"{first}); another rank stopped (killed, failed or its host gone) or waited longer than "
                           f"{self.timeout_s:g} s") from None

    def barrier(self, what: str = "meet") -> None:
        if self.world > 1:
            self._run(what, lambda: dist.barrier())

    def broadcast_int(self, value: int, what: str) -> int:
        """Rank 0's ``value`` on every rank."""
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        if self.world > 1:
            self._run(what, lambda: dist.broadcast(t, 0))
        return int(t.item())

    def shared_secret(self) -> int:
        """63 bits from rank 0's CSPRNG, the same on every rank (the DP noise seed of a round)."""
        from ..privacy import secure_seed

        return self.broadcast_int(secure_seed() if self.rank == 0 else 0, "agree on the DP noise seed")

    def counts(self, n: int, what: str) -> list[int]:
        """Every rank's ``n``."""
        t = torch.tensor([n], dtype=torch.int64, device=self.comm_device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        if self.world == 1:
            return [n]
        self._run(what, lambda: dist.all_gather(out, t))
        return [int(x.item()) for x in out]

    def gather_rows(self, rows: Tensor, counts: Sequence[int], what: str, to_all: bool = True) -> list[Tensor] | None:
        """Every rank's ``rows`` (``counts[q]`` rows on rank q, same trailing shape and dtype), padded to the largest
        count for the collective and cut back: a list by rank, on every rank (``to_all``) or on rank 0 only (the other
        ranks get None)."""
        if self.world == 1:
            return [rows]
        width = max(counts)
        dev = rows.device
        buf = torch.zeros((width, *rows.shape[1:]), dtype=rows.dtype, device=self.comm_device)
        buf[: rows.shape[0]] = rows.to(self.comm_device)
        wire = buf.view(torch.uint8) if buf.dtype == torch.bool else buf
        if to_all:
            parts = [torch.empty_like(wire) for _ in range(self.world)]
            self._run(what, lambda: dist.all_gather(parts, wire))
        else:
            parts = [torch.empty_like(wire) for _ in range(self.world)] if self.rank == 0 else []
            self._run(what, lambda: dist.gather(wire, parts if self.rank == 0 else None, dst=0))
            if self.rank != 0:
                return None
        return [(p.view(torch.bool) if rows.dtype == torch.bool else p)[:c].to(dev)
                for p, c in zip(parts, counts, strict=True)]


def partial_sum(buf: Tensor) -> Callable[[], Any]:
    """The collective adding ``buf`` across ranks in place."""
    return lambda: dist.all_reduce(buf)


def assemble(parts: list[Tensor], positions: list[Tensor], total: int) -> Tensor:
    """Rows ``parts[q]`` put at ``positions[q]`` of a (total, ...) tensor."""
    ref = parts[0]
    out = torch.empty((total, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
    for p, pos in zip(parts, positions, strict=True):
        if pos.numel():
            out.index_copy_(0, pos.to(out.device), p)
    return out


class DistributedClients:
    """The round loop's ``Clients`` for one rank of a distributed run: ``local`` holds this rank's clients (seen
    client ``k`` at local row ``k // world``, unseen client ``u`` at local index ``u // world``); every method that
    returns results returns the whole round's, the same on every rank (see the module docstring)."""

    def __init__(self, group: Group, local: LocalClients, alg: Algorithm, train_counts: Tensor):
        if local.store_kind == "mmap":
            raise ValueError("run.client_store = 'mmap' with the distributed executor: not supported (each rank "
                             "holds its share of the client states in memory; R ranks hold 1/R of the population each)")
        self.group, self.local, self.alg = group, local, alg
        self.train_counts = train_counts.to(torch.long).cpu()  # (N,) every seen client's training examples
        self.num_seen = int(train_counts.numel())
        #: sum the round's updates across ranks instead of gathering them (``summed_round``); set by ``make_engine``
        #: where that gives the same server step: ``can_sum``
        self.sum_updates = False
        self.groups = local.groups
        self.executor = local.executor
        self.ctx: Context | None = None

    def _split(self, ids: Tensor) -> list[Tensor]:
        """Positions (into ``ids``) of each rank's clients, in order."""
        owner = ids.to(torch.long).cpu() % self.group.world
        return [torch.nonzero(owner == q).flatten() for q in range(self.group.world)]

    def start(self, ctx: Context, server0: Tree, resume: dict[str, Any] | None = None, round_idx: int = 0) -> None:
        """Open this rank's store; on resume keep the checkpoint's rows of this rank's clients."""
        self.ctx = ctx
        mine = None
        if resume is not None:
            mine = dict(resume)
            if resume.get("kind") == "memory" and isinstance(resume.get("ids"), Tensor):
                ids = resume["ids"].to(torch.long)
                keep = torch.nonzero(ids % self.group.world == self.group.rank).flatten()
                # ids outside [0, N) or repeated are refused by the store below, on the rank that holds them
                mine["ids"] = ids.index_select(0, keep) // self.group.world
                for key, v in resume.items():
                    if key.startswith("leaf") and isinstance(v, Tensor) and v.shape[:1] == ids.shape:
                        mine[key] = v.index_select(0, keep)
        self.local.start(ctx, server0, mine, round_idx)

    # ------------------------------------------------------------------------------------------ training
    @staticmethod
    def can_sum(alg: Algorithm, update_steps: int) -> bool:
        """Whether a round's updates may be summed across ranks rather than gathered: the algorithm's server step
        is the default one (``Algorithm.aggregate``: the weighted mean of the rows, through ``ctx.combine``) and no
        update step (attack, clipping, robust combination, DP) reads the rows."""
        return type(alg).aggregate is Algorithm.aggregate and update_steps == 0

    def train(self, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut:
        g = self.group
        pos = self._split(ids)
        mine = pos[g.rank]
        if mine.numel():
            out = self.local.train(payload, ids[mine], orders.take(mine), lr, round_idx)
        else:
            out = self._empty(payload)
        counts = [int(p.numel()) for p in pos]
        k = len(ids)

        def gather(x: Tensor, what: str) -> Tensor:
            parts = g.gather_rows(x, counts, f"gather the round's {what} (round {round_idx + 1})")
            assert parts is not None
            return assemble(parts, pos, k)

        # losses and flags in one collective: (k, 3) float64 rows
        flags = torch.stack([out.losses.detach().double().cpu(), out.ok.double().cpu(), out.failed.double().cpu()], 1)
        got = gather(flags, "losses")
        losses, ok, failed = got[:, 0].float(), got[:, 1] > 0, got[:, 2] > 0
        if self.sum_updates and T.leaves(out.updates):
            return self.summed_round(out, ids, mine, ok, failed, losses, round_idx)
        updates = T.tmap(lambda u: gather(u.detach(), "updates"), out.updates) if T.leaves(out.updates) \
            else out.updates
        return TrainOut(updates, losses, ok, failed)

    def summed_round(self, out: TrainOut, ids: Tensor, mine: Tensor, ok: Tensor, failed: Tensor, losses: Tensor,
                     round_idx: int) -> TrainOut:
        """The round's weighted mean of the updates, each rank's share summed by one ``all_reduce`` per leaf: P
        numbers cross the wire instead of K x P.  The same arithmetic as ``tree.weighted_mean`` in one process
        (weights normalized in float64, rows of weight 0 never read), the ranks' partial sums added in rank order;
        only that addition's rounding differs (measured within 1e-6).  The rows handed to the server step are a
        zero-copy view, read only through the returned combiner."""
        g = self.group
        weights = self.train_counts[ids.cpu()].to(torch.float64) * (ok & ~failed).cpu().to(torch.float64)  # (K,)
        total = weights[weights > 0].sum()
        w_mine = weights[mine]
        keep = torch.nonzero(w_mine > 0).flatten()
        wk = w_mine[keep] / total if keep.numel() else w_mine[:0]

        def partial(x: Tensor) -> Tensor:
            rows = x.detach().index_select(0, keep.to(x.device))
            return torch.tensordot(wk.to(x.dtype).to(x.device), rows, dims=1) if keep.numel() else \
                torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)

        mean = T.tmap(partial, out.updates)
        if g.world > 1:  # one all_reduce per dtype over the leaves laid end to end
            leaves = T.leaves(mean)
            for dtype in sorted({x.dtype for x in leaves}, key=str):
                mine_leaves = [x for x in leaves if x.dtype == dtype]
                buf = torch.cat([x.reshape(-1) for x in mine_leaves]).to(g.comm_device)
                g._run(f"sum the round's updates (round {round_idx + 1})", partial_sum(buf))
                at = 0
                for x in mine_leaves:
                    x.copy_(buf[at:at + x.numel()].view_as(x))
                    at += x.numel()
        k = len(ids)
        view = T.tmap(lambda m: m.unsqueeze(0).expand(k, *m.shape), mean)

        def combine(_: Tree, w: Tensor) -> Tree:
            if not torch.equal(w.detach().to(torch.float64).cpu(), weights):
                raise RuntimeError("a summed distributed round was combined with other weights than its own (an "
                                   "algorithm whose aggregate reweights must set the updates to be gathered)")
            return mean

        return TrainOut(view, losses, ok, failed, combine)

    def _empty(self, payload: Tree) -> TrainOut:
        """No client of this rank trains this round: zero rows shaped like an update."""
        assert self.ctx is not None
        like = self.alg.update_like(self.ctx, payload)
        none = torch.zeros(0, dtype=torch.bool)
        updates = T.tmap(lambda p: p.unsqueeze(0)[:0].to(self.group.device), like)
        return TrainOut(updates, torch.zeros(0), none, none)

    def gossip(self, fn: Callable[[Tree, Tree], tuple[Tree, Tree]], server: Tree, round_idx: int) -> Tree:
        """Every rank's client states gathered (the population, in client order), ``fn`` run on every rank, each
        rank's rows written back to its store."""
        assert self.local.store is not None
        g = self.group
        states = T.to(self.local.store.read_all(), g.device)
        pos = [owned(self.num_seen, q, g.world) for q in range(g.world)]
        counts = [int(p.numel()) for p in pos]

        def gather(x: Tensor) -> Tensor:
            parts = g.gather_rows(x, counts, f"gather the client states for gossip (round {round_idx + 1})")
            assert parts is not None
            return assemble(parts, pos, self.num_seen)

        everyone = T.tmap(gather, states) if T.leaves(states) else states
        mine = pos[g.rank].to(g.device)

        def local_fn(s: Tree, _: Tree) -> tuple[Tree, Tree]:
            new_server, mixed = fn(s, everyone)
            return new_server, T.tmap(lambda x: x.index_select(0, mine.to(x.device)), mixed)

        return self.local.gossip(local_fn, server, round_idx)

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, group: str, payload: Tree, server: Tree, ids: Tensor, adapt: Orders | None,
                 lr: float) -> dict[str, Any]:
        g = self.group
        pos = self._split(ids)
        mine = pos[g.rank]
        local_ids = ids[mine] if group == "seen" else ids[mine] // g.world  # seen: federation-wide ids
        sub = None if adapt is None else adapt.take(mine)
        res = self.local.evaluate(group, payload, server, local_ids, sub, lr) if mine.numel() else None
        counts = [int(p.numel()) for p in pos]
        names = sorted(self.local.data.group(group).splits())
        out: dict[str, Any] = {}
        for name in names:
            cols: dict[str, Any] = {}
            for f in ("acc", "loss", "n"):
                x = torch.zeros(0, dtype=torch.float64) if res is None else torch.from_numpy(
                    np.ascontiguousarray(res[name][f], dtype=np.float64))
                parts = g.gather_rows(x, counts, f"gather the evaluation of the {group} clients")
                assert parts is not None
                cols[f] = assemble(parts, pos, len(ids)).numpy()
            cols["client"] = ids.cpu().numpy()
            out[name] = cols
        return out

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The written rows of every rank, on rank 0, in the one-process format (federation-wide ids, ascending);
        the other ranks return their kind only (they write no checkpoint)."""
        g = self.group
        sd = self.local.state_dict()
        ids = sd["ids"] * g.world + g.rank
        counts = g.counts(int(ids.numel()), "count the client states to checkpoint")
        what = "send the client states to rank 0 for the checkpoint"
        all_ids = g.gather_rows(ids, counts, what, to_all=False)
        leaves = {key: g.gather_rows(v, counts, what, to_all=False) for key, v in sd.items() if key.startswith("leaf")}
        if all_ids is None:
            return {"kind": sd["kind"]}
        merged = torch.cat(all_ids)
        order = torch.argsort(merged)
        out: dict[str, Any] = {"kind": sd["kind"], "ids": merged[order]}
        for key, parts in leaves.items():
            assert parts is not None
            out[key] = torch.cat(parts).index_select(0, order)
        return out

    def check_agreement(self, server: Tree, round_idx: int) -> None:
        """Refuse to go on if the ranks' server states differ (they run the same server step on the same rows; a
        difference is a bug, not noise): a float64 fingerprint of every leaf compared across ranks."""
        g = self.group
        if g.world == 1:
            return
        leaves = [x for x in T.leaves(server) if isinstance(x, Tensor)]
        fp = torch.tensor([float(x.double().sum()) + float((x.double().flatten() * torch.arange(
            x.numel(), dtype=torch.float64, device=x.device).remainder(7)).sum()) for x in leaves] or [0.0],
            dtype=torch.float64)
        parts = g.gather_rows(fp.unsqueeze(0), [1] * g.world, f"compare the server states (round {round_idx})")
        assert parts is not None
        if any(not torch.equal(p.cpu(), fp.unsqueeze(0)) for p in parts):
            raise RuntimeError(f"round {round_idx}: the ranks' server states differ; a distributed run must give "
                               "every rank the same server step (a bug: please report it with the config)")

    def commit(self) -> None:
        self.local.commit()

    def close(self) -> None:
        self.local.close()


def shard(data: FederatedData, rank: int, world: int) -> FederatedData:
    """This rank's clients of ``data``: seen client ``k`` and unseen client ``u`` with ``k, u mod world == rank``."""
    seen = data.seen.subset(owned(data.seen.num_clients, rank, world))
    unseen = None if data.unseen is None else data.unseen.subset(owned(data.unseen.num_clients, rank, world))
    return FederatedData(seen, data.num_classes, unseen, data.name, data.meta)
