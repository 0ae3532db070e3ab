"""The round loop and its runners: ``vmap`` (all sampled clients as one batched computation) and
``loop`` (a Python loop over the same functions; the reference for tests and debugging).

Randomness comes only from the run's seed: round r draws its client sample, batch orders and
evaluation adaptation batches from generators seeded with ``(seed, r)``, so a resumed run repeats an
uninterrupted one exactly and both runners see identical data.

vmap runner and padding: a client's local epoch has ceil(n_k / B) steps; clients are grouped into
buckets of similar step counts (powers of two; ``bucketing="none"`` pads everyone to the largest)
and each bucket is one ``torch.func.vmap`` call, at most ``chunk_size`` clients wide.  Padded steps
are exact no-ops (see ``optim.local_sgd``), so the grouping never changes the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import vmap

from . import tree as T
from .algorithms.base import Algorithm, Context
from .data.federated import (
    ClientGroup,
    FederatedData,
    Orders,
    epoch_orders,
    ragged_batches,
    round_batches,
    steps_per_epoch,
)
from .model import Model
from .optim import SGD
from .systems import SystemsModel
from .tree import Tree

log = logging.getLogger("fedmtl")


@dataclass(frozen=True)
class RunConfig:
    """The ``[run]`` table: everything about the simulation that is not the algorithm."""

    rounds: int = 200
    seed: int = 1234
    batch_size: int = 128
    local_epochs: int = 1
    sampling_rate: float = 1.0
    clients_per_round: int = 0  # > 0 overrides sampling_rate
    runner: str = "auto"  # auto | vmap | loop (auto: loop for compute-bound models on CPU, else vmap)
    chunk_size: int = 0  # 0 = no limit on clients per vmap call
    bucketing: str = "steps"  # "steps" | "none"
    device: str = "cpu"
    eval_every: int = 10
    checkpoint_every: int = 10
    eval_chunk_elems: int = 2**24  # bound on padded evaluation tensor size
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"run.rounds must be >= 1, got {self.rounds}")
        if self.batch_size < 1 or self.local_epochs < 1:
            raise ValueError("run.batch_size and run.local_epochs must be >= 1")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"run.sampling_rate must be in (0, 1], got {self.sampling_rate}")
        if self.clients_per_round < 0:
            raise ValueError("run.clients_per_round must be >= 0")
        if self.runner not in ("auto", "vmap", "loop"):
            raise ValueError(f"run.runner must be 'auto', 'vmap' or 'loop', got {self.runner!r}")
        if self.bucketing not in ("steps", "none"):
            raise ValueError(f"run.bucketing must be 'steps' or 'none', got {self.bucketing!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"run.device must be 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.eval_every < 1 or self.checkpoint_every < 0 or self.chunk_size < 0:
            raise ValueError("run.eval_every must be >= 1; checkpoint_every and chunk_size >= 0")


def sample_clients(cfg: RunConfig, num_clients: int, round_idx: int) -> Tensor:
    """The clients of round ``round_idx`` (sorted ids): everyone, or a uniform sample without replacement of
    ``clients_per_round`` (else ``round(sampling_rate * num_clients)``) from stream 1 of the round."""
    k = cfg.clients_per_round or max(1, int(round(cfg.sampling_rate * num_clients)))
    k = min(k, num_clients)
    if k == num_clients:
        return torch.arange(num_clients)
    g = round_generator(cfg.seed, round_idx, 1)
    return torch.sort(torch.randperm(num_clients, generator=g)[:k]).values


def round_generator(seed: int, round_idx: int, stream: int = 0) -> torch.Generator:
    """Generator for one round and one purpose, independent of everything that came before."""
    mixed = np.random.SeedSequence([seed, round_idx, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))


@dataclass
class SimState:
    """Everything a checkpoint holds."""

    round: int
    server: Tree
    clients: Tree  # stacked over all seen clients
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=lambda: {"excluded_updates": 0})


class Simulator:
    """Runs ``algorithm`` on ``data`` with ``model`` and the local solver ``opt``."""

    def __init__(
        self, algorithm: Algorithm, model: Model, data: FederatedData, opt: SGD, cfg: RunConfig,
        systems: SystemsModel | None = None,
    ):
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"run.device={cfg.device!r} but torch.cuda.is_available() is False")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.alg, self.model, self.opt, self.cfg = algorithm, model, opt, cfg
        self.systems = systems or SystemsModel()
        self._n_params = sum(int(p.numel()) for p in model.module.parameters())
        self.device = torch.device(cfg.device)
        self.data = data.to(self.device)
        self.model = model
        model.module.to(self.device)
        train = self.data.seen.train
        self.runner = cfg.runner
        if cfg.runner == "auto":
            self.runner = "loop" if (model.prefer_loop_on_cpu and self.device.type == "cpu") else "vmap"
        self.ctx = Context(model, opt, train.num_clients, float(train.counts.sum()), cfg.local_epochs)
        self._update = vmap(self._client_update_fn, in_dims=(None, 0, 0, None), randomness="error")

    # ------------------------------------------------------------------------------ state
    def init_state(self) -> SimState:
        params = T.to(self.model.init(self.cfg.seed), self.device)
        server = self.alg.init_server(self.ctx, params, self.cfg.seed)
        clients = T.to(self.alg.init_clients(self.ctx, server), self.device)
        return SimState(round=0, server=server, clients=clients)

    # ------------------------------------------------------------------------------ sampling
    def sample_clients(self, round_idx: int) -> Tensor:
        return sample_clients(self.cfg, self.ctx.num_clients, round_idx)

    # ------------------------------------------------------------------------------ runners
    def _client_update_fn(self, payload: Tree, state: Tree, batches: Any, lr: float) -> Any:
        return self.alg.client_update(self.ctx, payload, state, batches, lr)

    def _buckets(self, counts: Tensor, epochs_batch: int) -> list[Tensor]:
        """Positions (into the sampled list) grouped into vmap calls."""
        steps = steps_per_epoch(counts, epochs_batch)
        if self.cfg.bucketing == "steps":
            key = torch.ceil(torch.log2(steps.double().clamp_min(1))).long()
        else:
            key = torch.zeros_like(steps)
        groups = []
        for v in torch.unique(key):
            pos = torch.nonzero(key == v).flatten()
            pos = pos[torch.argsort(counts[pos], stable=True)]
            cs = self.cfg.chunk_size or len(pos)
            groups += list(torch.split(pos, cs))
        return groups

    def run_clients(
        self, fn: Callable[..., Any], payload: Tree, states: Tree, clients: Tensor, orders: Orders,
        lr: float, group: ClientGroup, runner: str | None = None,
    ) -> Any:
        """Apply ``fn(payload, state, batches, lr)`` to every client in ``clients``; stacked outputs."""
        runner = runner or self.runner
        split = group.train
        counts = split.counts[clients].cpu()
        bsz = self.cfg.batch_size
        if runner == "loop":  # one client at a time, written straight into a preallocated stack
            result = None
            for i in range(len(clients)):
                out = fn(payload, T.take(states, i), ragged_batches(split, clients, orders, i, bsz), lr)
                if result is None:
                    result = T.tmap(lambda x: x.new_empty((len(clients), *x.shape)), out)
                for dst, src in zip(T.leaves(result), T.leaves(out), strict=True):
                    dst[i] = src
            return result
        vfn = self._update if fn is self._client_update_fn else vmap(fn, in_dims=(None, 0, 0, None))
        outs, where = [], []
        for pos in self._buckets(counts, bsz):
            b = round_batches(split, clients, orders, pos, bsz)
            outs.append(vfn(payload, T.take(states, pos.to(self.device)), b, lr))
            where.append(pos)
        inverse = torch.argsort(torch.cat(where)).to(self.device)
        return T.tmap(lambda *xs: torch.cat(xs)[inverse], *outs)

    # ------------------------------------------------------------------------------ one round
    def round(self, state: SimState) -> dict[str, Any]:
        r = state.round
        cfg = self.cfg
        clients = self.sample_clients(r)
        lr = self.opt.lr_at(r, cfg.rounds)
        payload = self.alg.payload(state.server)
        sys = self.systems
        counts = self.data.seen.train.counts[clients].cpu()
        budget = (steps_per_epoch(counts, cfg.batch_size) * cfg.local_epochs).numpy()
        draw = sys.draw(cfg.seed, r, clients.numpy())
        done = sys.steps(draw, budget)
        n_dropped = int(draw.dropped.sum())
        est = self._estimated_seconds(payload, draw, budget, done)
        state.counters["est_time_s"] = float(state.counters.get("est_time_s", 0.0)) + est
        if n_dropped:
            state.counters["dropped_updates"] = int(state.counters.get("dropped_updates", 0)) + n_dropped
            keep = torch.from_numpy(~draw.dropped)
            clients, counts, budget, done = clients[keep], counts[keep], budget[~draw.dropped], done[~draw.dropped]
        base = {"round": r + 1, "lr": lr, "clients": len(clients), "dropped": n_dropped,
                "est_time_s": state.counters["est_time_s"]}
        if len(clients) == 0:  # nobody answered: the server keeps its model
            state.round = r + 1
            return {**base, "excluded": 0, "train_loss": float("nan")}
        g = round_generator(cfg.seed, r, 2)
        orders = epoch_orders(counts, cfg.local_epochs, g)
        if (done < budget).any():
            orders = orders._replace(limit=torch.from_numpy(done))
        states = T.take(state.clients, clients.to(self.device))
        updates, new_states, losses = self.run_clients(
            self._client_update_fn, payload, states, clients, orders, lr, self.data.seen
        )
        valid = torch.isfinite(losses)
        if T.leaves(updates):
            valid &= T.all_finite_rows(updates)
        if T.leaves(new_states):
            valid &= T.all_finite_rows(new_states)
        n_bad = int((~valid).sum())
        if n_bad:
            bad = clients[~valid.cpu()].tolist()
            log.warning("round %d: excluded %d client update(s) with NaN/Inf: clients %s", r, n_bad, bad[:20])
            state.counters["excluded_updates"] = state.counters.get("excluded_updates", 0) + n_bad
        weights = self.data.seen.train.counts[clients].to(torch.float64) * valid.to(torch.float64)
        state.server = self.alg.aggregate(self.ctx, state.server, updates, weights.to(self.device), clients)
        if T.leaves(new_states) and bool(valid.any()):
            keep = valid.to(self.device)
            state.clients = T.put(state.clients, clients.to(self.device)[keep], T.take(new_states, keep))
        state.server, state.clients = self.alg.post_round(self.ctx, state.server, state.clients)
        state.round = r + 1
        ok = losses[valid]
        return {**base, "excluded": n_bad, "train_loss": float(ok.mean()) if ok.numel() else float("nan")}

    def _estimated_seconds(self, payload: Tree, draw: Any, budget: Any, done: Any) -> float:
        """Estimated wall-clock seconds of this round on the systems model's device network: the
        compute of the round's clock cycle (or of its slowest node, in ``wait`` mode) at 6 FLOPs per
        parameter per example (forward and backward), plus the payload down and an update as large up."""
        step_flops = 6.0 * self._n_params * self.cfg.batch_size
        nbytes = float(sum(int(x.numel()) * x.element_size() for x in T.leaves(payload)))
        steps = self.systems.compute_time_steps(draw, budget, done)
        return self.systems.time_model.round_seconds(steps * step_flops, nbytes, nbytes)

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self, state: SimState, groups: tuple[str, ...] = ("seen", "unseen")) -> dict[str, Any]:
        """Per-client accuracy and loss for every split of every group.

        Returns ``{group: {split: {"acc": (C,) array, "loss": (C,) array, "n": (C,) array}}}``.
        """
        from .evaluation import evaluate_group

        out: dict[str, Any] = {}
        lr = self.opt.lr_at(max(state.round - 1, 0), self.cfg.rounds)
        for name in groups:
            group = self.data.seen if name == "seen" else self.data.unseen
            if group is None:
                continue
            out[name] = evaluate_group(self, state, group, seen=name == "seen", lr=lr)
        return out
