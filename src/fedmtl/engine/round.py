"""The one round.  ``Engine`` exposes its steps, and every algorithm, on every executor (vmap, loop, Flower), runs
through them:

    plan:   sample -> systems draw (stragglers, drops) -> payload, batch orders
    train:  the clients run (``Clients.train``: an executor, locally or over Flower) and keep their new states
    finish: screen (NaN/Inf, failed replies) -> the update pipeline (attack, clipping, robust combination, DP noise:
            ``fedmtl.engine.updates``) -> aggregate -> server optimizer -> post-round sync (gossip) -> settle
    settle: the books: warnings naming excluded and failed clients, the divergence check, counters, the clock
    [evaluate, checkpoint: ``fedmtl.runs.driver``]

``Engine.round`` is one round of one run.  The schedulers compose the same steps: ``fedmtl.runs.driver`` trains the
plans of several seeds' replicas in one batched call between their plans and finishes, and the asynchronous modes
(``fedmtl.engine.asynchronous``) train the clients they dispatch on the systems clock with ``Engine.train`` and close
each server step with ``Engine.settle``.

Randomness comes only from the run's seed: round r draws its client sample, batch orders and evaluation
adaptation batches from generators seeded with ``(seed, r, purpose)``, so a resumed run repeats an
uninterrupted one exactly and every executor sees identical data.  Sampling costs O(clients sampled), not
O(population): the engine never touches the clients it did not sample (``ClientStore``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm, Context
from ..data.federated import FederatedData, Orders, epoch_orders, usable_counts
from ..hostsync import to_device
from ..machine import torch_device
from ..models.base import Model, ModelError
from ..registry import ALGORITHMS
from ..tree import Tree
from . import asynchronous
from .clients import Clients, RoundPlan, TrainOut
from .sampling import (
    clients_per_round,
    poisson_sample,
    round_generator,
    sample_clients,
    sample_without_replacement,
)
from .server_opt import NoState, legacy_state_names
from .spec import RunSpec
from .steps.base import RoundInfo, Updates
from .steps.privacy import ClipAndNoise
from .updates import build_pipeline

log = logging.getLogger("fedmtl")


def _nbytes(tree: Tree) -> float:
    """The bytes of ``tree``'s tensors."""
    return float(sum(int(x.numel()) * x.element_size() for x in T.leaves(tree)))


def batch_norm_methods() -> list[str]:
    """The registered methods that train models with batch norm (``Algorithm.supports_batch_norm``)."""
    return sorted(n for n, cls in ALGORITHMS.items() if cls.supports_batch_norm)


class Federation(NamedTuple):
    """What the server knows about the clients: their number and sizes, never their data."""

    train_counts: Tensor  # (N,) long, training examples of each seen client
    feature_shape: tuple[int, ...]
    num_classes: int
    meta: dict[str, Any]
    unseen_train_counts: Tensor | None = None  # (U,) long

    @classmethod
    def of(cls, data: FederatedData) -> Federation:
        unseen = None if data.unseen is None else data.unseen.train.counts.clone()
        return cls(data.seen.train.counts.clone(), data.feature_shape, data.num_classes, data.meta, unseen)

    @property
    def num_clients(self) -> int:
        return int(self.train_counts.numel())

    def counts(self, group: str) -> Tensor:
        c = self.train_counts if group == "seen" else self.unseen_train_counts
        if c is None:
            raise KeyError(f"no {group} clients")
        return c


DIVERGED_AFTER = 3  # consecutive rounds in which every update is non-finite


class TrainingDiverged(ValueError):
    """Every client update was non-finite for ``DIVERGED_AFTER`` rounds in a row."""


@dataclass
class EngineState:
    """Everything of a run besides the clients' own states: what a checkpoint holds with the store's rows."""

    round: int
    server: Tree
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=lambda: {"excluded_updates": 0})
    server_opt: Tree = field(default_factory=NoState)  # the [server_opt] optimizer's state (its moments), if any
    #: the asynchronous modes' clients in flight and clock (``asynchronous.AsyncState``), if any; a checkpoint
    #: holds it under ``async``
    asynchronous: Any = None


class Engine:
    """Runs ``algorithm`` on ``clients`` (``LocalClients`` in a simulation, ``FlowerClients`` over Flower) as
    ``spec`` says (the run, the local optimizer, the systems model and the update pipeline's tables)."""

    #: the SHA-256 of the data a local run trains on (``fedmtl.data.federated.data_digest``), which its checkpoints
    #: keep: a resume over other data is refused; None where the data are not here (Flower) or nothing checkpoints
    data_sha256: str | None = None

    def __init__(self, algorithm: Algorithm, model: Model, clients: Clients, federation: Federation,
                 spec: RunSpec | None = None):
        spec = spec or RunSpec()
        cfg = spec.run
        device = torch_device(cfg.device)  # before anything is built: cuda:7 on a machine with 2 GPUs is refused
        if federation.num_classes < 2:
            raise ValueError("the round engine trains classifiers: its data needs num_classes >= 2 "
                             "(real-valued targets are for the networked GTV solver, fedmtl.networked)")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        algorithm.check_model(model)
        algorithm.check_optim(spec.optim)
        if model.batch_norm and not algorithm.supports_batch_norm:
            raise ModelError(f"model {model.name!r} has batch-norm layers, which {algorithm.name} does not support "
                             "(its update rule or loss would step or ignore their running statistics); the methods "
                             f"that do: {batch_norm_methods()}. Use a model without batch norm (e.g. cnn_femnist)")
        self.alg, self.model, self.spec, self.opt, self.cfg = algorithm, model, spec, spec.optim, cfg
        self.clients, self.fed, self.systems = clients, federation, spec.systems
        self.pipeline = build_pipeline(spec, algorithm, federation.num_clients)
        # who attacks (reported in summary.json; labelflip's attackers trained on flipped labels)
        self.attackers = spec.attack.attackers(federation.num_clients, cfg.seed)
        self.device = device
        model.module.to(self.device)
        self._n_params = sum(int(p.numel()) for p in model.module.parameters())
        self.check_memory()
        self.ctx = Context(model, self.opt, federation.num_clients, float(federation.train_counts.sum()),
                           cfg.local_epochs, cfg.rounds, int(federation.train_counts.max()))
        self.eval_ids = {g: self._eval_sample(g) for g in clients.groups}
        self.step_flops = 6.0 * self._n_params * cfg.batch_size  # one local step, forward and backward
        self.payload_bytes = 0.0  # of the broadcast (set by init_state)
        if spec.asynchronous.enabled:
            asynchronous.check(spec, algorithm, clients, federation.num_clients)

    @property
    def privacy(self) -> ClipAndNoise | None:
        """The run's DP step (its accountant and noise multiplier), or None without ``[privacy]``."""
        return self.pipeline.get("privacy")

    def check_memory(self, replicas: int = 1) -> None:
        """Refuse, before allocating anything, a run whose models alone need more memory than the machine has:
        M models (FedEM's components) on the server, and per client of one batched call its copy, gradients
        and momentum; ``replicas`` runs with several seeds batched together (their clients share the calls)."""
        from ..machine import physical_memory

        n = self.fed.num_clients
        m = int(getattr(self.alg, "num_components", 1) or 1)
        k = clients_per_round(self.cfg, n)
        width = min(replicas * k, self.cfg.chunk_size or replicas * k)
        need = 4.0 * self._n_params * m * (3 * width + 4 * replicas)
        have = physical_memory()
        if need > 0.8 * have:
            reps = f" x {replicas} replicas (seeds)" if replicas > 1 else ""
            raise ValueError(f"{m} model(s) of {self._n_params} parameters{reps} for {width} clients per batched call "
                             f"need about {need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB "
                             "(fewer components, a smaller model, or run.chunk_size)")

    # ------------------------------------------------------------------------------------------ state
    def init_state(self, resume: dict[str, Any] | None = None) -> EngineState:
        """A fresh run (the clients' stores opened empty), or, with ``resume`` (a loaded checkpoint), the
        checkpoint's round, server and history with the clients' states restored."""
        params = T.to(self.model.start(self.cfg.seed), self.device)
        # an algorithm builds its server state's extra tensors (assignments, counters) where it likes; they live on
        # the run's device from here on
        server0 = T.to(self.alg.init_server(self.ctx, params, self.cfg.seed), self.device)
        opt0 = self.pipeline.server.init(server0) if self.pipeline.server is not None else NoState()
        self.payload_bytes = _nbytes(self.alg.payload(server0))
        flight = None
        if self.spec.asynchronous.enabled:
            flight = asynchronous.AsyncState.empty() if resume is None else asynchronous.AsyncState.of(
                resume.get("async", {}), self.alg.update_like(self.ctx, self.alg.payload(server0)), self.device)
        if resume is None:
            self.clients.start(self.ctx, server0)
            return EngineState(round=0, server=server0, server_opt=opt0, asynchronous=flight)
        server = T.from_named(resume["server"], server0, self.device)
        opt = T.from_named(legacy_state_names(resume.get("server_opt", {})), opt0, self.device) \
            if T.leaves(opt0) else opt0
        self.clients.start(self.ctx, server0, resume["clients"], int(resume["round"]))
        return EngineState(int(resume["round"]), server, list(resume["history"]), dict(resume["counters"]), opt, flight)

    def _eval_sample(self, group: str) -> Tensor:
        n = int(self.fed.counts(group).numel())
        k = self.cfg.eval_clients
        if not k or k >= n:
            return torch.arange(n)
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg.seed, 11, 0 if group == "seen" else 1]))
        return torch.from_numpy(sample_without_replacement(rng, n, k))

    # ------------------------------------------------------------------------------------------ one round
    def _sample(self, r: int) -> Tensor:
        if self.spec.privacy.enabled and self.spec.privacy.sampling == "poisson":
            return poisson_sample(self.cfg, self.fed.num_clients, r)
        return sample_clients(self.cfg, self.fed.num_clients, r)

    def round(self, state: EngineState) -> dict[str, Any]:
        """One round of this run, its metrics row: ``plan``, ``train``, ``finish`` (under ``[async]``: one server
        step of the event-ordered simulation, ``asynchronous.step``)."""
        if state.asynchronous is not None:
            return asynchronous.step(self, state)
        plan = self.plan(state)
        return self.finish(state, plan, self.train(plan))

    def plan(self, state: EngineState) -> RoundPlan:
        """Step one: what round ``state.round`` asks of the clients: the sample (less dropped clients), their batch
        orders (straggler limits applied), the learning rate and the payload.  Pure in the state: nothing is changed."""
        r, cfg = state.round, self.cfg
        ids = self._sample(r)
        lr = self.local_lr(r)
        payload = self.payload(state.server)
        counts = self.counts(ids)
        budget = self.step_budget(counts)
        draw = self.systems.draw(cfg.seed, r, ids.numpy())
        done = self.systems.steps(draw, budget)
        # the round's clock cycle (or its slowest node, in wait mode), the payload down and an update as large up
        est = self.estimated_seconds(self.systems.compute_time_steps(draw, budget, done), _nbytes(payload))
        n_sampled = len(ids)
        n_dropped = int(draw.dropped.sum())
        if n_dropped:
            keep = ~draw.dropped
            ids, counts, done = ids[torch.from_numpy(keep)], counts[torch.from_numpy(keep)], done[keep]
        orders = None
        if len(ids):
            orders = self.batch_orders(counts, r)._replace(limit=torch.from_numpy(done))
        return RoundPlan(r, ids, counts, orders, lr, payload, n_sampled, n_dropped, est)

    def train(self, plan: RoundPlan) -> TrainOut | None:
        """Step two: ``plan``'s clients train from its payload in its batch orders (``Clients.train``: an executor,
        locally or over Flower) and keep their new states.  None when nobody trains."""
        if plan.ids.numel() == 0:
            return None
        assert plan.orders is not None  # drawn whenever somebody trains
        return self.clients.train(plan.payload, plan.ids, plan.orders, plan.lr, plan.round)

    def finish(self, state: EngineState, plan: RoundPlan, out: TrainOut | None) -> dict[str, Any]:
        """Step three: screen the clients' results ``out`` of ``plan`` (round ``state.round``), pass them through the
        update pipeline, aggregate, step the server, sync the clients (decentralized methods) and ``settle``."""
        r = plan.round
        if out is None and self.pipeline.releases_empty_rounds:  # a private round releases its noise anyway
            out = self._no_updates(plan.payload)
        bad = failed = torch.zeros(len(plan.ids), dtype=torch.bool)
        excluded, loss = 0, float("nan")
        if out is not None:
            failed = out.failed.cpu()
            bad = ~out.ok.cpu() & ~failed
            u = self.pipeline.updates(self._screen(plan, out, bad, failed), RoundInfo(r, self.cfg.seed, plan.payload))
            before = state.server
            state.server = self.aggregate(before, u.updates, u.weights, u.ids, u.ctx)
            if self.pipeline.server is not None and state.server is not before:
                state.server, state.server_opt = self.pipeline.server(before, state.server, state.server_opt)
            ok = out.losses.detach().cpu()[u.valid]
            excluded, loss = u.excluded, float(ok.float().mean()) if ok.numel() else float("nan")
        if self.alg.syncs_clients:  # decentralized: every client gossips with its neighbours, sampled or not
            state.server = self.clients.gossip(lambda s, c: self.alg.sync(self.ctx, s, c), state.server, r)
        clock = float(state.counters.get("est_time_s", 0.0)) + plan.est_seconds
        return self.settle(state, lr=plan.lr, ids=plan.ids, bad=bad, failed=failed, dropped=plan.n_dropped,
                           excluded=excluded, loss=loss, clock=clock)

    def _screen(self, plan: RoundPlan, out: TrainOut, bad: Tensor, failed: Tensor) -> Updates:
        """The round's results as the pipeline's input: failed replies (remote executors) and non-finite updates
        ``bad`` excluded."""
        valid = out.ok.cpu() & ~failed
        weights = plan.counts.to(torch.float64) * valid.to(torch.float64)
        ctx = self.ctx if out.combine is None else self.ctx._replace(combine=out.combine)  # combined across ranks
        return Updates(plan.ids, out.updates, plan.counts, valid, weights, int(bad.sum()), ctx)

    def settle(self, state: EngineState, *, lr: float, ids: Tensor, bad: Tensor, failed: Tensor | None = None,
               dropped: int, excluded: int, loss: float, clock: float) -> dict[str, Any]:
        """The books of round ``state.round`` (a synchronous round or an asynchronous server step), once the server
        has stepped; returns the round's metrics row.

        ``ids``: the clients whose results came back or failed to; ``bad`` and ``failed``: masks over them of the
        non-finite results (excluded) and of the replies that never came (counted as dropped), each warned of with
        their clients' ids; ``dropped``: clients that never trained; ``excluded``: the updates left out (non-finite,
        or by a pipeline step); ``loss``: the others' mean training loss; ``clock``: the simulated clock after the
        round (``est_time_s``).  Stops a run whose every update was non-finite for ``DIVERGED_AFTER`` rounds in a
        row (``TrainingDiverged``), adds to the counters of excluded and dropped updates and advances ``state``."""
        r = state.round
        if bool(bad.any()):
            log.warning("round %d: excluded %d client update(s) with NaN/Inf: clients %s", r, int(bad.sum()),
                        ids[bad].tolist()[:20])
        n_failed = 0 if failed is None else int(failed.sum())
        if failed is not None and n_failed:
            log.warning("round %d: %d of %d clients failed to answer: %s", r, n_failed, len(ids),
                        ids[failed].tolist()[:20])
        clients, dropped = len(ids) - n_failed, dropped + n_failed
        row: dict[str, Any] = {"round": r + 1, "lr": lr, "clients": clients, "dropped": dropped}
        state.counters["est_time_s"] = clock
        streak = int(state.counters.get("all_excluded_streak", 0)) + 1 if excluded > 0 and clients <= excluded else 0
        state.counters["all_excluded_streak"] = streak
        if streak >= DIVERGED_AFTER:
            raise TrainingDiverged(f"every client update was NaN/Inf in rounds {r + 2 - DIVERGED_AFTER}-{r + 1}: "
                                   f"training diverged (optim.lr = {self.opt.lr:g} too large?); nothing is "
                                   "reported as a result")
        if self.privacy is not None:
            row["epsilon"] = self.privacy.accountant.epsilon_after(r + 1)
        state.counters["excluded_updates"] = int(state.counters.get("excluded_updates", 0)) + excluded
        state.counters["dropped_updates"] = int(state.counters.get("dropped_updates", 0)) + dropped
        state.round = r + 1
        return {**row, "excluded": excluded, "train_loss": loss, "est_time_s": clock}

    def _no_updates(self, payload: Tree) -> TrainOut:
        """A round's results when no client trained: zero rows shaped like the payload (under ``[privacy]``)."""
        none = torch.zeros(0, dtype=torch.bool)
        like = self.alg.update_like(self.ctx, payload)
        return TrainOut(T.tmap(lambda p: p.unsqueeze(0)[:0], like), torch.zeros(0), none, none)

    # ------------------------------------------------------------------------------------------ what a step reads
    @property
    def num_clients(self) -> int:
        """The federation's (seen) clients."""
        return self.fed.num_clients

    def counts(self, ids: Tensor) -> Tensor:
        """The training examples of clients ``ids``."""
        return self.fed.train_counts[ids]

    def step_budget(self, counts: Tensor) -> np.ndarray:
        """The local steps clients with ``counts`` training examples take in full (``Algorithm.step_budget`` of their
        usable examples): the work the systems model cuts a straggler's from."""
        cfg = self.cfg
        usable = usable_counts(counts, cfg.batch_size, cfg.drop_last)
        return self.alg.step_budget(usable, cfg.batch_size, cfg.local_epochs).numpy()

    def local_lr(self, r: int) -> float:
        """The clients' learning rate in round ``r`` (the ``[optim]`` schedule over ``run.rounds``)."""
        return self.opt.lr_at(r, self.cfg.rounds)

    def payload(self, server: Tree) -> Tree:
        """What the server sends the clients from its state ``server``."""
        return self.alg.payload(server)

    def batch_orders(self, counts: Tensor, r: int) -> Orders:
        """The batch orders of clients with ``counts`` training examples, drawn from round ``r``'s stream."""
        cfg = self.cfg
        return self.alg.draw_orders(counts, cfg.local_epochs, cfg.batch_size, round_generator(cfg.seed, r, 2))

    def aggregate(self, server: Tree, updates: Tree, weights: Tensor, ids: Tensor, ctx: Context | None = None) -> Tree:
        """The algorithm's aggregate of ``updates`` (stacked rows of clients ``ids``, weighted by ``weights``) into
        ``server``, on the run's device; ``ctx``: how to combine them (default: the run's, the weighted mean)."""
        ctx = self.ctx if ctx is None else ctx
        w = to_device(weights, self.device)
        if weights.device.type == "cpu":  # the sum read here, where it costs no wait for the device
            ctx = ctx._replace(weights_total=(w, float(weights.sum())))
        return T.to(self.alg.aggregate(ctx, server, updates, w, ids), self.device)

    def estimated_seconds(self, steps: float, nbytes: float) -> float:
        """Estimated wall-clock seconds, on the systems model's device network, of ``steps`` full-speed local steps
        (6 FLOPs per parameter per example, forward and backward) plus ``nbytes`` down and an update as large up."""
        return self.systems.time_model.round_seconds(steps * self.step_flops, nbytes, nbytes)

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, state: EngineState, groups: tuple[str, ...] = ("seen", "unseen")) -> dict[str, Any]:
        """Per-client accuracy and loss on every split of every group (of the fixed evaluation sample).

        Returns ``{group: {split: {"acc": (C,), "loss": (C,), "n": (C,), "client": (C,)}}}`` (numpy arrays).
        """
        out: dict[str, Any] = {}
        for group in groups:
            if group in self.clients.groups:
                out[group] = self.clients.evaluate(group, *self.eval_plan(state, group))
        return out

    def eval_plan(self, state: EngineState, group: str) -> tuple[Tree, Tree, Tensor, Orders | None, float]:
        """What evaluating ``group`` at ``state`` asks of the clients: (payload, server, client ids, adaptation
        orders, personalization rate).  The rate is ``optim.lr``, the schedule's initial value, never the round's
        decayed one: fine-tuning before an evaluation at the end of a decayed schedule would otherwise barely move
        (FedAvg+ equalled FedAvg).  A method's own ``personal_lr`` overrides it."""
        lr = self.opt.lr
        ids = self.eval_ids[group]
        seen = group == "seen"
        adapt = None
        if self.alg.needs_adaptation or not seen:
            g = torch.Generator().manual_seed(int(self.cfg.seed) * 7919 + state.round * 104729 + (not seen))
            adapt = epoch_orders(self.fed.counts(group)[ids], self.alg.adapt_epochs, g)
        return self.alg.payload(state.server), state.server, ids, adapt, lr
