"""Drives a run end to end around the round loop: evaluation every ``eval_every`` rounds, atomic checkpoints
every ``checkpoint_every`` rounds, resume, and the run directory.  The same driver runs a simulation
(``LocalClients``) and a Flower ServerApp (``fedmtl.flower.executor.FlowerClients``).

Run directory layout::

    config.toml     the resolved configuration
    metrics.csv     one row per round (lr, train loss, dropped and excluded updates; evaluation every eval_every)
    clients.csv     final per-client accuracy / loss on every split (seen and unseen clients)
    summary.json    final summary (the last round's evaluation, never the best round) + timings
    accuracy.png    test accuracy over rounds
    checkpoint.pt   written atomically every checkpoint_every rounds; ``resume=True`` continues from it
    client_store/   the clients' states when ``run.client_store = "mmap"``
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..algorithms.base import Algorithm
from ..config import ConfigError, ExperimentConfig, dumps
from ..data.federated import DataError, FederatedData
from ..model import Model
from ..optim import SGD
from ..privacy import PrivacyConfig
from ..report import atomic, plot_history, write_clients_csv, write_history_csv, write_json
from ..robust.aggregators import RobustConfig
from ..robust.attacks import AttackConfig, flip_labels
from ..tree import Tree
from . import checkpoint
from .clients import Clients, LocalClients
from .evaluation import summarize
from .executors import make_executor
from .round import Engine, EngineState, Federation, RunConfig
from .rundir import RunDirectory
from .systems import SystemsModel

log = logging.getLogger("fedmtl")


@dataclass
class RunResult:
    """What ``fedmtl.run`` returns.

    ``summary``: the final evaluation (``summary["final"]``: ``seen_test_acc_mean``, ``seen_test_acc_p10``,
    ...), timings and the configuration; ``history``: one dict per round (``metrics.csv``); ``per_client``:
    ``{group: {split: {"acc", "loss", "n", "client"}}}`` arrays; ``server``: the final server state (e.g.
    ``result.server.params``); ``client_states(ids)``: the clients' own final states (personal models, FedEM's
    pi), read from the run's client store.
    """

    summary: dict[str, Any]
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


def make_engine(alg: Algorithm, model: Model, data: FederatedData, opt: SGD, rc: RunConfig,
                systems: SystemsModel | None = None, out_dir: Path | None = None,
                robust: RobustConfig | None = None, attack: AttackConfig | None = None,
                privacy: PrivacyConfig | None = None) -> Engine:
    """An engine over ``LocalClients`` holding all of ``data`` (a simulation)."""
    if data.is_regression:
        raise DataError(f"{data.name}: real-valued targets; the round engine trains classifiers")
    if attack is not None and attack.kind == "label_flip" and attack.active:
        data = flip_labels(data, attack.attackers(data.seen.num_clients, rc.seed))
    model.check_features(data.seen.train.x[:2])
    device = torch.device(rc.device)
    clients = LocalClients(
        alg, data, make_executor(rc.runner, model, device, rc.chunk_size, rc.bucketing), device,
        rc.batch_size, rc.eval_chunk_elems, rc.client_store,
        None if out_dir is None else out_dir / "client_store", journal=out_dir is not None and rc.checkpoint_every > 0,
    )
    return Engine(alg, model, opt, rc, clients, Federation.of(data), systems, robust, attack, privacy)


def build_local(cfg: ExperimentConfig, data: FederatedData | None = None, model: Model | None = None,
                out_dir: Path | None = None) -> Engine:
    """``make_engine`` for a validated config (data and model built from it unless given)."""
    data = data if data is not None else cfg.build_data()
    if model is None:
        model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    return make_engine(cfg.build_algorithm(), model, data, cfg.optim, cfg.run, cfg.systems, out_dir, cfg.robust,
                       cfg.attack, cfg.privacy)


def run_experiment(
    cfg: ExperimentConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    data: FederatedData | None = None,
    model: Model | None = None,
    overwrite: bool = False,
) -> RunResult:
    """Train and evaluate in this process; the summary is also written to ``out/summary.json``.  The run
    directory is locked for the run; one that holds results needs ``resume`` or ``overwrite``."""
    out_dir = Path(out) if out is not None else None
    if out_dir is None:
        if resume:
            raise ConfigError("resume needs a run directory (out)")
        return drive(build_local(cfg, data, model, None), cfg, None, False, progress)
    with RunDirectory(out_dir, resume, overwrite):
        return drive(build_local(cfg, data, model, out_dir), cfg, out_dir, resume, progress)


def drive(engine: Engine, cfg: ExperimentConfig, out_dir: Path | None, resume: bool, progress: bool) -> RunResult:
    """The run loop around ``Engine.round``: evaluate, checkpoint, write the run directory."""
    ckpt = out_dir / "checkpoint.pt" if out_dir is not None else None
    saved = None
    if resume and ckpt is not None and ckpt.exists():
        saved = checkpoint.load(ckpt)
        checkpoint.check_matches(saved, ckpt, cfg.raw, cfg.run.rounds)
        log.info("resuming %s from round %d", out_dir, saved["round"])
    try:
        state = engine.init_state(saved)
    except (ValueError, KeyError) as e:
        if saved is None:
            raise
        raise checkpoint.CheckpointError(f"{ckpt}: does not fit this run: {e}") from e
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic(out_dir / "config.toml") as f:
            f.write(dumps(cfg.raw))
    rcfg = cfg.run
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=rcfg.rounds, initial=state.round, desc=cfg.algorithm["name"], leave=False, disable=None)
    t_train = 0.0
    per_client: dict[str, Any] | None = None
    try:
        while state.round < rcfg.rounds:
            t0 = time.perf_counter()
            row = engine.round(state)
            dt = time.perf_counter() - t0
            t_train += dt
            state.counters["train_seconds"] = state.counters.get("train_seconds", 0.0) + dt
            state.counters.setdefault("round_seconds", []).append(dt)  # wall clock: kept out of metrics.csv
            if state.round % rcfg.eval_every == 0 or state.round == rcfg.rounds:
                per_client = engine.evaluate(state)
                row.update(summarize(per_client))
            state.history.append(row)
            if bar is not None:
                post = {"loss": f"{row['train_loss']:.4f}"}
                if "seen_test_acc_mean" in row:
                    post["acc"] = f"{100 * row['seen_test_acc_mean']:.2f}"
                bar.set_postfix(post)
                bar.update(1)
            if ckpt is not None and rcfg.checkpoint_every and (
                state.round % rcfg.checkpoint_every == 0 or state.round == rcfg.rounds
            ):
                _checkpoint(ckpt, state, cfg, engine)
        if bar is not None:
            bar.close()
        if per_client is None:  # resumed a finished run
            per_client = engine.evaluate(state)
    finally:
        engine.clients.close()
    final = summarize(per_client)
    summary = {
        "algorithm": cfg.algorithm["name"],
        "data": cfg.data["name"],
        "rounds": state.round,
        "final": final,
        "excluded_updates": state.counters.get("excluded_updates", 0),
        "dropped_updates": state.counters.get("dropped_updates", 0),
        "train_seconds_this_process": t_train,
        # over all rounds of the run, interrupted or not (the training time is kept in the checkpoint)
        "seconds_per_round": state.counters.get("train_seconds", 0.0) / state.round if state.round else None,
        "round_seconds": state.counters.get("round_seconds", []),
        "config": cfg.raw,
    }
    if engine.attack.active:
        summary["attackers"] = engine.attackers.tolist()
    if engine.accountant is not None:
        summary["epsilon"] = engine.accountant.epsilon_after(state.round)
        summary["delta"] = engine.privacy.delta
        summary["noise_multiplier"] = engine.noise_multiplier
    if out_dir is not None:
        write_history_csv(out_dir / "metrics.csv", state.history)
        write_clients_csv(out_dir / "clients.csv", per_client)
        write_json(out_dir / "summary.json", summary)
        plot_history(out_dir / "accuracy.png", state.history, f"{cfg.algorithm['name']} on {cfg.data['name']}")
    return RunResult(summary, state.history, per_client, state.server, out_dir, engine.clients)


def _checkpoint(ckpt: Path, state: EngineState, cfg: ExperimentConfig, engine: Engine) -> None:
    checkpoint.save(ckpt, state, cfg.raw, engine.clients.state_dict())
    engine.clients.commit()
    write_history_csv(ckpt.parent / "metrics.csv", state.history)
