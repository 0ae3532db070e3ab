"""Drives a run end to end around the round loop: evaluation every ``eval_every`` rounds, atomic checkpoints
every ``checkpoint_every`` rounds, resume, and the run directory.  The same driver runs a simulation
(``LocalClients``) and a Flower ServerApp (``fedmtl.flower.executor.FlowerClients``).

Run directory layout::

    config.toml     the resolved configuration
    metrics.csv     one row per round (lr, train loss, dropped and excluded updates; evaluation every eval_every),
                    rewritten while the run runs (at most every ``LIVE_EVERY`` seconds) and at every checkpoint
    progress.json   while it runs and at its end: the round reached, the rounds in all, mean seconds per round
                    (what ``fedmtl watch`` turns into an ETA; wall-clock times stay out of metrics.csv)
    clients.csv     final per-client accuracy / loss on every split (seen and unseen clients)
    summary.json    final summary (the last round's evaluation, never the best round) + timings
    accuracy.png    test accuracy over rounds
    checkpoint.pt   written atomically every checkpoint_every rounds; ``resume=True`` continues from it
    privacy.json    under [privacy]: the accountant's composed events, delta and the epsilon they spend
    client_store/   the clients' states when ``run.client_store = "mmap"``
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch

from .. import tree as T
from ..algorithms.base import Algorithm
from ..config import ConfigError, ExperimentConfig, dumps
from ..data.federated import DataError, FederatedData
from ..engine.clients import Clients, LocalClients, RoundPlan, TrainOut, evaluate_together, train_together
from ..engine.distributed import DistributedClients, Group, owned, shard
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, summarize
from ..engine.executors import Executor, StackedExecutor, make_executor
from ..engine.resident import place
from ..engine.round import Engine, EngineState, Federation
from ..engine.spec import RunSpec
from ..engine.store import StoreError
from ..files import atomic
from ..machine import torch_device
from ..models.base import Model
from ..models.stacking import closed_form_clients, compiled, supports_clients
from ..robust.attacks import flip_labels
from ..tree import Tree
from . import checkpoint
from .progress import Progress
from .report import plot_history, run_figures_on, write_clients_csv, write_history_csv, write_json
from .rundir import COMMIT, NEXT, RunDirectory, RunDirError, check_resumable

log = logging.getLogger("fedmtl")


class RunSummary(TypedDict):
    """``summary.json`` of a run (``RunResult.summary``): the final evaluation and the run's facts."""

    algorithm: str
    data: str
    seed: int
    rounds: int
    #: the final round's evaluation, ``{metric name: value}`` (``fedmtl.engine.evaluation``: ``SEEN_TEST_ACC_MEAN``,
    #: ``metric(group, split, statistic)``, ...)
    final: dict[str, float]
    excluded_updates: int
    dropped_updates: int
    train_seconds_this_process: float
    #: over all rounds of the run, interrupted or not (the training time is kept in the checkpoint)
    seconds_per_round: float | None
    round_seconds: list[float]
    #: the rounds (1-based) from which the learning rate is decayed, fractions resolved
    lr_decay_from_rounds: list[int]
    config: dict[str, Any]
    #: the path the engine chose for this model and algorithm (``fedmtl.engine.executors.make_executor``)
    path: dict[str, Any]
    attackers: NotRequired[list[int]]
    #: under [privacy]: the guarantee spent and the noise that bought it
    epsilon: NotRequired[float]
    delta: NotRequired[float]
    noise_multiplier: NotRequired[float]
    reproducible_noise: NotRequired[bool]


@dataclass
class RunResult:
    """What ``fedmtl.run`` returns.

    ``summary``: the final evaluation (``summary["final"]``: ``seen_test_acc_mean``, ``seen_test_acc_p10``,
    ...), timings and the configuration; ``history``: one dict per round (``metrics.csv``); ``per_client``:
    ``{group: {split: {"acc", "loss", "n", "client"}}}`` arrays; ``server``: the final server state (e.g.
    ``result.server.params``); ``client_states(ids)``: the clients' own final states (personal models, FedEM's
    pi), read from the run's client store.
    """

    summary: RunSummary
    history: list[dict[str, Any]]
    per_client: dict[str, Any]
    server: Tree
    out: Path | None = None
    clients: Clients | None = field(default=None, repr=False)

    @property
    def final(self) -> dict[str, float]:
        return self.summary["final"]

    def client_states(self, ids: torch.Tensor | list[int] | None = None) -> Tree:
        if not isinstance(self.clients, LocalClients):
            raise RuntimeError("client states live on the nodes that ran them (not in this process)")
        n = self.clients.data.seen.num_clients
        sel = torch.arange(n) if ids is None else torch.as_tensor(ids, dtype=torch.long)
        return self.clients.read(sel)


def make_engine(alg: Algorithm, model: Model, data: FederatedData, spec: RunSpec,
                out_dir: Path | None = None, group: Group | None = None) -> Engine:
    """An engine over ``LocalClients`` holding all of ``data`` (a simulation) that runs as ``spec`` says; with
    ``group`` (a rank of a distributed run), over ``DistributedClients`` holding this rank's share of ``data``."""
    rc, attack = spec.run, spec.attack
    if data.is_regression:
        raise DataError(f"{data.name}: real-valued targets; the round engine trains classifiers")
    if attack.kind == "labelflip" and attack.active:
        data = flip_labels(data, attack.attackers(data.seen.num_clients, rc.seed))
    model.check_features(data.seen.train.x[:6])
    model = compiled(model, rc.compile, rc.device)
    device = torch_device(rc.device)
    held, global_ids = data, None
    if group is not None:
        if data.seen.num_clients < group.world:
            raise ValueError(f"{data.seen.num_clients} seen clients for {group.world} ranks: every rank needs at "
                             "least one client (fewer ranks)")
        held, global_ids = shard(data, group.rank, group.world), owned(data.seen.num_clients, group.rank, group.world)
    held = place(held, device, rc.data_on_device)  # on a GPU: moved there once, in the stored dtype
    local = LocalClients(
        alg, held, make_executor(rc.runner, model, device, rc.chunk_size, rc.bucketing), device,
        rc.batch_size, rc.eval_chunk_elems, rc.client_store,
        None if out_dir is None else out_dir / "client_store", journal=out_dir is not None and rc.checkpoint_every > 0,
        drop_last=rc.drop_last, global_ids=global_ids,
    )
    clients: Clients = local
    if group is not None:
        clients = DistributedClients(group, local, alg, data.seen.train.counts)
    engine = Engine(alg, model, clients, Federation.of(data), spec)
    if isinstance(clients, DistributedClients):
        clients.sum_updates = DistributedClients.can_sum(alg, len(engine.pipeline.steps))
    if group is not None and engine.privacy is not None:  # every rank adds the same noise: rank 0's seed
        engine.privacy.secret = group.shared_secret
    return engine


def build_local(cfg: ExperimentConfig, data: FederatedData | None = None, model: Model | None = None,
                out_dir: Path | None = None, group: Group | None = None) -> Engine:
    """``make_engine`` for a validated config (data and model built from it unless given)."""
    data = data if data is not None else cfg.build_data()
    if model is None:
        model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    engine = make_engine(cfg.build_algorithm(), model, data, cfg.run_spec(), out_dir, group)
    if out_dir is not None and cfg.run.checkpoint_every:  # the data its checkpoints are held to on a resume
        from ..data.federated import data_digest

        engine.data_sha256 = data_digest(data)
    return engine


def run_experiment(
    cfg: ExperimentConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | str = True,
    data: FederatedData | None = None,
    model: Model | None = None,
    overwrite: bool = False,
    group: Group | None = None,
) -> RunResult:
    """Train and evaluate in this process; the summary is also written to ``out/summary.json``.  The run
    directory is locked for the run; one that holds results needs ``resume`` or ``overwrite``.  (A config with
    ``run.seeds`` is run by ``fedmtl.runs.seeds.run_seeds``.)  ``group``: this process is a rank of a distributed
    run (``fedmtl.engine.distributed``); rank 0 writes the run directory, the others only read its checkpoint."""
    if cfg.run.seeds:
        raise ConfigError(f"{cfg.source}: run.seeds = {list(cfg.run.seeds)}: several seeds are run by run_seeds "
                          "(fedmtl run --seeds, fedmtl.run(..., seeds=...))"
                          + ("; a distributed run takes one seed" if group is not None else ""))
    writes = group is None or group.is_writer
    if out is not None:  # before anything is built or touched: the directory must fit the command (every rank checks)
        if resume and overwrite:
            raise RunDirError("resume and overwrite (--resume, --overwrite) exclude each other")
        check_resumable(Path(out), cfg.raw, None, resume, overwrite, source=cfg.source)
        if writes:
            RunDirectory(out, resume, overwrite).in_use()
    out_dir, prog, data = prepare(cfg, out, resume, progress if writes else False, data)
    try:
        if out_dir is None:
            return drive(build_local(cfg, data, model, None, group), cfg, None, False, prog)
        if not writes:
            assert group is not None
            group.barrier("wait for rank 0 to open the run directory")
            return drive(build_local(cfg, data, model, out_dir, group), cfg, out_dir, resume, prog, writes=False)
        with RunDirectory(out_dir, resume, overwrite, deferred=True) as run_dir:
            if group is not None:
                group.barrier("wait for rank 0 to open the run directory")
            engine = build_local(cfg, data, model, out_dir, group)
            run_dir.commit()  # built: the results an overwrite replaces go only now
            return drive(engine, cfg, out_dir, resume, prog)
    finally:
        prog.close()


def prepare(cfg: ExperimentConfig, out: str | Path | None, resume: bool, progress: bool | str | Progress,
            data: FederatedData | None) -> tuple[Path | None, Progress, FederatedData]:
    """The run directory (``resume`` needs one), the progress reporter and the data (built unless given)."""
    out_dir = Path(out) if out is not None else None
    if out_dir is None and resume:
        raise ConfigError("resume needs a run directory (out)")
    prog = progress if isinstance(progress, Progress) else Progress(progress)
    return out_dir, prog, data if data is not None else build_data(cfg, prog)


def build_data(cfg: ExperimentConfig, prog: Progress) -> FederatedData:
    """The config's data, reported as a phase (clients, examples, seconds)."""
    with prog.phase(f"building data {cfg.data['name']}") as info:
        data = cfg.build_data()
        info["clients"] = data.seen.num_clients + (0 if data.unseen is None else data.unseen.num_clients)
        info["training examples"] = int(data.seen.train.counts.sum())
    return data


@dataclass
class Replica:
    """One run that ``drive_many`` advances: its engine, config, run directory and state."""

    engine: Engine
    cfg: ExperimentConfig
    out_dir: Path | None
    label: str = ""
    state: EngineState | None = None
    per_client: dict[str, Any] | None = None
    t_train: float = 0.0
    loggers: list[Any] = field(default_factory=list)  # the [log] loggers' RunLogger objects (fedmtl.runs.loggers)
    summary: RunSummary | None = None  # the run's summary once it finished (what its loggers close with)
    writes: bool = True  # False: a rank of a distributed run other than 0 (it reads the run directory, never writes)
    written: float = float("-inf")  # time.monotonic() of the last live write of metrics.csv and progress.json
    base: str | None = None  # an adapted model's base_digest (fedmtl.models.lora), which its checkpoints keep

    @property
    def ckpt(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / "checkpoint.pt"

    @property
    def eval_due(self) -> bool:
        assert self.state is not None
        return self.state.round % self.cfg.run.eval_every == 0 or self.state.round == self.cfg.run.rounds

    @property
    def done(self) -> bool:
        assert self.state is not None
        return self.state.round >= self.cfg.run.rounds

    @property
    def final_evaluation(self) -> dict[str, Any] | None:
        """The last round's per-client evaluation, which its checkpoint keeps; None before the last round."""
        return self.per_client if self.done else None

    @property
    def checkpoint_due(self) -> bool:
        assert self.state is not None
        every, r = self.cfg.run.checkpoint_every, self.state.round
        return self.ckpt is not None and bool(every) and (r % every == 0 or r == self.cfg.run.rounds)


def drive(engine: Engine, cfg: ExperimentConfig, out_dir: Path | None, resume: bool,
          progress: Progress | bool | str = True, writes: bool = True) -> RunResult:
    """The run loop around ``Engine.round``: evaluate, checkpoint, write the run directory (``writes``)."""
    return drive_many([Replica(engine, cfg, out_dir, cfg.algorithm["name"], writes=writes)], resume, progress)[0]


def drive_many(replicas: list[Replica], resume: bool, progress: Progress | bool | str = True,
               group_dir: Path | None = None,
               on_round: Callable[[list[Replica]], None] | None = None) -> list[RunResult]:
    """Advance several runs (the replicas of a run with several seeds) round by round together: the replicas at
    the same round train their clients in one batched computation (``clients.train_together``) where they are
    all simulated in this process, each on its own otherwise; then each is evaluated, checkpointed and written
    as a run of its own.  Each replica's result equals what ``drive`` gives it alone.  ``group_dir`` (the top level
    of a run with several seeds): the replicas' checkpoints of a round are committed together (``_checkpoint_group``),
    so a resume finds them all at the same round and batches them exactly as the uninterrupted run did.
    ``on_round``: called with the replicas of every round once their rows (and evaluation, where due) are in their
    histories and checkpointed (``fedmtl.runs.tune`` reports each evaluated round to its pruner there); what it
    raises stops the run."""
    prog = progress if isinstance(progress, Progress) else Progress(progress)
    try:
        for rep in replicas:
            _open(rep, resume, prog)
        while not all(rep.done for rep in replicas):
            r = min(rep.state.round for rep in replicas if not rep.done)  # type: ignore[union-attr]
            group = [rep for rep in replicas if not rep.done and rep.state.round == r]  # type: ignore[union-attr]
            t0 = time.perf_counter()
            rows = _rounds(group)
            dt = (time.perf_counter() - t0) / len(group)  # a batched round's time, shared evenly
            due = [rep for rep in group if rep.eval_due]
            for rep, per_client in zip(due, _evaluate(due), strict=True):
                rep.per_client = per_client
            for rep, row in zip(group, rows, strict=True):
                _after_round(rep, row, dt, prog, rep in due)
            _checkpoint_group([rep for rep in group if rep.checkpoint_due], group_dir)
            if on_round is not None:
                on_round(group)
        return [_finish(rep) for rep in replicas]
    finally:
        prog.close()
        for rep in replicas:
            rep.engine.clients.close()
            _log(rep, "close", rep.summary)


def _open(rep: Replica, resume: bool, prog: Progress) -> None:
    cfg, ckpt, engine = rep.cfg, rep.ckpt, rep.engine
    saved = None
    if engine.model.adapters is not None:  # the frozen base, which checkpoints name by digest
        from ..models.lora import base_digest

        rep.base = base_digest(engine.model.module)
    if resume and ckpt is not None and ckpt.exists():
        saved = checkpoint.load(ckpt)
        checkpoint.check_matches(saved, ckpt, cfg.raw, cfg.run.rounds, rep.base, cfg.source, engine.data_sha256)
        log.info("resuming %s from round %d", rep.out_dir, saved["round"])
    if saved is not None and saved["round"] >= cfg.run.rounds:  # a finished run: its final evaluation, if kept
        rep.per_client = checkpoint.evaluation_of(saved)
    try:
        rep.state = engine.init_state(saved)
    except (ValueError, KeyError) as e:
        if saved is None:
            raise
        if isinstance(e, StoreError):  # corrupt, tampered or non-finite client states: named by the store
            raise checkpoint.CheckpointError(f"{ckpt}: {e}") from None
        raise checkpoint.CheckpointError(f"{ckpt}: does not fit this run: {e}") from None
    if rep.out_dir is not None and rep.writes:
        rep.out_dir.mkdir(parents=True, exist_ok=True)
        with atomic(rep.out_dir / "config.toml") as f:
            f.write(dumps(cfg.raw))
        if cfg.log.names:
            from .loggers import open_loggers

            rep.loggers = open_loggers(rep.out_dir, cfg, saved is not None, rep.label)
    milestones = cfg.optim.milestone_rounds(cfg.run.rounds)
    if milestones:
        prog.line(f"{rep.label}: learning rate {cfg.optim.lr:g}, x{cfg.optim.lr_gamma:g} from round(s) "
                  f"{', '.join(str(m + 1) for m in milestones)} of {cfg.run.rounds}")
    prog.start(str(id(rep)), rep.label, cfg.run.rounds, rep.state.round, engine.alg.loss_label)


def _batchable(reps: list[Replica]) -> bool:
    """Several replicas simulated in this process over one dataset (a label-flipping attack gives each replica
    its own flipped copy: those run one after the other), on a vmap or loop executor.  The stacked executor already
    runs a replica's clients as one computation per local step, so it runs the replicas one after the other: merged,
    every client would carry its replica's own model, which costs FedEM its shared E-step (the handbook's Seeds
    results page).  Asynchronous runs (``[async]``) run one after the other."""
    local = [rep.engine.clients for rep in reps if isinstance(rep.engine.clients, LocalClients)]
    return (len(reps) > 1 and len(local) == len(reps) and all(c.data is local[0].data for c in local)
            and not isinstance(local[0].executor, StackedExecutor)
            and not any(rep.engine.spec.asynchronous.enabled for rep in reps))  # [async]: each its own event order


def _rounds(group: list[Replica]) -> list[dict[str, Any]]:
    """One round of every replica of ``group`` (all at the same round): each engine's ``Engine.round`` or, where the
    replicas batch, each one's ``plan``, their clients trained together (``_train_together``), each one's
    ``finish``."""
    states: list[EngineState] = []
    for rep in group:
        assert rep.state is not None
        states.append(rep.state)
    if not _batchable(group):
        return [rep.engine.round(st) for rep, st in zip(group, states, strict=True)]
    plans = [rep.engine.plan(st) for rep, st in zip(group, states, strict=True)]
    outs = _train_together([rep.engine for rep in group], plans)
    return [rep.engine.finish(st, p, o) for rep, st, p, o in zip(group, states, plans, outs, strict=True)]


def _train_together(engines: list[Engine], plans: list[RoundPlan]) -> list[TrainOut | None]:
    """``Engine.train`` of each plan (replicas of one run, in the same round), in one batched computation
    (``clients.train_together``): every client's result is what its own engine's ``train`` gives it."""
    active = [i for i, p in enumerate(plans) if p.ids.numel()]
    # replicas whose payloads differ in shape (Clustered FL after one replica split its clusters) train apart
    if len({tuple((tuple(x.shape), x.dtype) for x in T.leaves(plans[i].payload)) for i in active}) > 1:
        return [engine.train(p) for engine, p in zip(engines, plans, strict=True)]
    outs: list[TrainOut | None] = [None] * len(plans)
    if active:
        trained = train_together([engines[i].clients for i in active],  # type: ignore[misc]
                                 [plans[i].payload for i in active], [plans[i].ids for i in active],
                                 [plans[i].orders for i in active],  # type: ignore[misc]
                                 [plans[i].lr for i in active], plans[active[0]].round)
        for i, o in zip(active, trained, strict=True):
            outs[i] = o
    return outs


def _evaluate(reps: list[Replica]) -> list[dict[str, Any]]:
    """``Engine.evaluate`` of each replica; replicas simulated here that evaluate the same clients are evaluated
    together (``clients.evaluate_together``: the evaluation data read once for all of them)."""
    if not _batchable(reps) or len({rep.engine.opt.lr for rep in reps}) > 1 or any(
            rep.engine.alg != reps[0].engine.alg for rep in reps) or any(
            not all(torch.equal(rep.engine.eval_ids[g], reps[0].engine.eval_ids[g]) for g in rep.engine.eval_ids)
            for rep in reps):  # (replicas with rates or algorithm fields of their own personalize with their own)
        return [rep.engine.evaluate(rep.state) for rep in reps]  # type: ignore[arg-type]
    out: list[dict[str, Any]] = [{} for _ in reps]
    for group in reps[0].engine.clients.groups:
        plans = [rep.engine.eval_plan(rep.state, group) for rep in reps]  # type: ignore[arg-type]
        res = evaluate_together([rep.engine.clients for rep in reps], group,  # type: ignore[misc]
                                [p[0] for p in plans], [p[1] for p in plans], plans[0][2], [p[3] for p in plans],
                                plans[0][4])
        for o, r in zip(out, res, strict=True):
            o[group] = r
    return out


def _after_round(rep: Replica, row: dict[str, Any], dt: float, prog: Progress, evaluated: bool) -> None:
    state, rcfg = rep.state, rep.cfg.run
    assert state is not None
    rep.t_train += dt
    state.counters["train_seconds"] = state.counters.get("train_seconds", 0.0) + dt
    state.counters.setdefault("round_seconds", []).append(dt)  # wall clock: kept out of metrics.csv
    if evaluated:
        assert rep.per_client is not None
        row.update(summarize(rep.per_client))
    state.history.append(row)
    prog.round(str(id(rep)), rep.label, rcfg.rounds, row, dt)
    _log(rep, "round", row, rep.per_client if SEEN_TEST_ACC_MEAN in row else None)
    if rep.out_dir is not None and rep.writes and time.monotonic() - rep.written >= LIVE_EVERY:
        _write_live(rep)


def _log(rep: Replica, what: str, *args: Any) -> None:
    """Call ``what`` on every logger of ``rep``; a logger that fails (an unreachable tracking server, a full disk of
    its own) is dropped with a warning naming it: the run and its run directory go on."""
    from .loggers import log_all

    log_all(rep.loggers, what, rep.label, *args)


def _write_live(rep: Replica) -> None:
    """``metrics.csv`` so far and ``progress.json`` (round, rounds, seconds per round), for watching a run."""
    state, out = rep.state, rep.out_dir
    assert state is not None and out is not None
    write_history_csv(out / "metrics.csv", state.history)
    secs = state.counters.get("round_seconds", [])
    write_json(out / "progress.json", {"round": state.round, "rounds": rep.cfg.run.rounds,
                                       "seconds_per_round": sum(secs) / len(secs) if secs else None,
                                       "updated": time.time()})
    rep.written = time.monotonic()


LIVE_EVERY = 2.0  # seconds between two live writes of a run's metrics.csv and progress.json


def _finish(rep: Replica) -> RunResult:
    state, cfg, engine, out_dir = rep.state, rep.cfg, rep.engine, rep.out_dir
    assert state is not None
    if rep.per_client is None:  # resumed a finished run whose checkpoint kept no evaluation (an older checkpoint):
        rep.per_client = engine.evaluate(state)  # evaluated once more, and kept in the checkpoint from now on
        if rep.ckpt is not None and cfg.run.checkpoint_every:
            _checkpoint(rep.ckpt, state, cfg, engine, rep.writes, rep.final_evaluation, rep.base)
    per_client = rep.per_client
    if isinstance(engine.clients, DistributedClients):
        engine.clients.check_agreement(state.server, state.round)
    final = summarize(per_client)
    executor = getattr(engine.clients, "executor", None)
    path = run_path(engine.model, executor)
    if isinstance(engine.clients, DistributedClients):
        g = engine.clients.group
        path = {**path, "executor": "distributed", "rank_executor": path["executor"], "ranks": g.world,
                "backend": g.backend, "updates": "summed" if engine.clients.sum_updates else "gathered"}
    summary: RunSummary = {
        "algorithm": cfg.algorithm["name"],
        "data": cfg.data["name"],
        "seed": cfg.run.seed,
        "rounds": state.round,
        "final": final,
        "excluded_updates": state.counters.get("excluded_updates", 0),
        "dropped_updates": state.counters.get("dropped_updates", 0),
        "train_seconds_this_process": rep.t_train,
        # over all rounds of the run, interrupted or not (the training time is kept in the checkpoint)
        "seconds_per_round": state.counters.get("train_seconds", 0.0) / state.round if state.round else None,
        "round_seconds": state.counters.get("round_seconds", []),
        # the rounds (1-based) from which the learning rate is decayed, fractions resolved
        "lr_decay_from_rounds": [m + 1 for m in cfg.optim.milestone_rounds(cfg.run.rounds)],
        "config": cfg.raw,
        # the path the engine chose for this model and algorithm (fedmtl.engine.executors.make_executor)
        "path": path,
    }
    if engine.spec.attack.active:
        summary["attackers"] = engine.attackers.tolist()
    if (dp := engine.privacy) is not None:
        summary["epsilon"] = dp.accountant.epsilon_after(state.round)
        summary["delta"] = dp.cfg.delta
        summary["noise_multiplier"] = dp.noise_multiplier
        summary["reproducible_noise"] = dp.cfg.reproducible_noise
    if out_dir is not None and rep.writes:
        _write_privacy(out_dir, state, engine)
        if (out_dir / "progress.json").exists():  # written while it ran: brought to the last round
            _write_live(rep)
        else:
            write_history_csv(out_dir / "metrics.csv", state.history)
        write_clients_csv(out_dir / "clients.csv", per_client)
        write_json(out_dir / "summary.json", summary)
        if run_figures_on():  # (a reproduction draws one summary figure instead)
            plot_history(out_dir / "accuracy.png", state.history, f"{cfg.algorithm['name']} on {cfg.data['name']}")
        # the event-ordered simulation: accuracy against the simulated clock too
        if cfg.asynchronous.enabled and run_figures_on():
            plot_history(out_dir / "accuracy_time.png", state.history,
                         f"{cfg.algorithm['name']} ({cfg.asynchronous.mode}) on {cfg.data['name']}", x="est_time_s")
    rep.summary = summary
    return RunResult(summary, state.history, per_client, state.server, out_dir, engine.clients)


def run_path(model: Model, executor: Executor | None) -> dict[str, Any]:
    """The path a run took: its executor (``"remote"`` over Flower), how the model computes (``Model.path``) and,
    on the stacked executor with a clients form, the form each module with parameters took (``"stacked"``,
    ``"vmap"``, ``"loop"``); a clients form refused by its check on the data says why."""
    if executor is None:
        return {"executor": "remote", "model": model.path}
    name = executor.name
    if isinstance(executor, StackedExecutor) and not supports_clients(model):  # its form refused on the data
        name = executor.fallback.name
    path: dict[str, Any] = {"executor": name, "model": model.path}
    form = model.clients_form
    if form is not None and form.usable and name == "stacked" and not closed_form_clients(model):
        path["model"], path["layers"] = "clients form", dict(form.layers)
    elif form is not None and form.usable is False:
        path["clients_form_refused"] = form.reason
    return path


def _checkpoint(ckpt: Path, state: EngineState, cfg: ExperimentConfig, engine: Engine, writes: bool = True,
                final_evaluation: dict[str, Any] | None = None, base: str | None = None) -> None:
    if isinstance(engine.clients, DistributedClients):
        engine.clients.check_agreement(state.server, state.round)
    clients = engine.clients.state_dict()  # (a distributed run: every rank sends its clients' rows to rank 0)
    if not writes:
        engine.clients.commit()
        return
    checkpoint.save(ckpt, state, cfg.raw, clients, final_evaluation, base, engine.data_sha256)
    _committed(ckpt, state, engine)


def _committed(ckpt: Path, state: EngineState, engine: Engine) -> None:
    """After ``ckpt`` is durable: the client store's undo journal is emptied, metrics and privacy record written."""
    engine.clients.commit()
    write_history_csv(ckpt.parent / "metrics.csv", state.history)
    _write_privacy(ckpt.parent, state, engine)


def _checkpoint_group(reps: list[Replica], group_dir: Path | None) -> None:
    """Checkpoint ``reps`` (due at the same round).  One replica, or no group directory: directly.  Several: as one
    transaction: every replica's checkpoint is written (fsynced) to ``checkpoint.next.pt``; then the group's marker
    ``seeds-commit.json`` (atomic) makes them durable together; then each is renamed to ``checkpoint.pt`` and the
    marker removed.  A kill anywhere leaves either the previous group or the new one for
    ``seeds.finish_group_commit`` to complete, never replicas at different rounds."""
    if len(reps) <= 1 or group_dir is None:
        for rep in reps:
            assert rep.ckpt is not None and rep.state is not None
            _checkpoint(rep.ckpt, rep.state, rep.cfg, rep.engine, rep.writes, rep.final_evaluation, rep.base)
        return
    rounds = []
    for rep in reps:
        assert rep.ckpt is not None and rep.state is not None
        checkpoint.save(rep.ckpt.with_name(NEXT), rep.state, rep.cfg.raw, rep.engine.clients.state_dict(),
                        rep.final_evaluation, rep.base, rep.engine.data_sha256)
        rounds.append(rep.state.round)
    write_json(group_dir / COMMIT, {"round": rounds[0], "runs": [str(rep.out_dir) for rep in reps]})
    for rep in reps:
        assert rep.ckpt is not None and rep.state is not None
        os.replace(rep.ckpt.with_name(NEXT), rep.ckpt)
        _committed(rep.ckpt, rep.state, rep.engine)
    (group_dir / COMMIT).unlink()


def _write_privacy(out_dir: Path, state: EngineState, engine: Engine) -> None:
    """``privacy.json``: the accountant's events composed so far (runs under ``[privacy]``)."""
    if engine.privacy is not None:
        write_json(out_dir / "privacy.json", engine.privacy.accountant.record(state.round))
