"""Run one experiment end to end: build, train with checkpoints, evaluate, write the run directory.

Run directory layout::

    config.toml     the resolved configuration
    metrics.csv     one row per round (lr, train loss, excluded updates; eval summaries every eval_every)
    clients.csv     final per-client accuracy / loss on every split (seen and unseen clients)
    summary.json    final summary (the last round's evaluation, never the best round) + timings
    accuracy.png    test accuracy over rounds
    checkpoint.pt   written atomically every checkpoint_every rounds; ``resume=True`` continues from it
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from . import checkpoint
from .config import ConfigError, ExperimentConfig, dumps
from .data.federated import FederatedData
from .evaluation import summarize
from .report import plot_history, write_clients_csv, write_history_csv, write_json
from .simulate import Simulator

log = logging.getLogger("fedmtl")


def build(cfg: ExperimentConfig, data: FederatedData | None = None) -> Simulator:
    data = data if data is not None else cfg.build_data()
    model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    return Simulator(cfg.build_algorithm(), model, data, cfg.optim, cfg.run, cfg.systems)


def run_experiment(
    cfg: ExperimentConfig,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    data: FederatedData | None = None,
) -> dict[str, Any]:
    """Train and evaluate; returns the summary dict (also written to ``out/summary.json``)."""
    out_dir = Path(out) if out is not None else None
    ckpt = out_dir / "checkpoint.pt" if out_dir is not None else None
    if ckpt is not None and ckpt.exists() and not resume:
        raise ConfigError(f"{out_dir} already holds a run (checkpoint.pt); pass --resume to continue it "
                          "or choose another --out")
    sim = build(cfg, data)
    state = sim.init_state()
    if resume and ckpt is not None and ckpt.exists():
        state, saved_cfg = checkpoint.load(ckpt, sim.device)
        if saved_cfg != cfg.raw:
            raise ConfigError(f"{ckpt}: the checkpoint was written with a different configuration; "
                              "resume with the same config and --set options")
        log.info("resuming %s from round %d", out_dir, state.round)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.toml").write_text(dumps(cfg.raw))
    rcfg = cfg.run
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=rcfg.rounds, initial=state.round, desc=cfg.algorithm["name"], leave=False, disable=None)
    t_train = 0.0
    per_client: dict[str, Any] | None = None
    while state.round < rcfg.rounds:
        t0 = time.perf_counter()
        row = sim.round(state)
        dt = time.perf_counter() - t0
        t_train += dt
        state.counters["train_seconds"] = state.counters.get("train_seconds", 0.0) + dt  # type: ignore[assignment]
        if state.round % rcfg.eval_every == 0 or state.round == rcfg.rounds:
            per_client = sim.evaluate(state)
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
            checkpoint.save(ckpt, state, cfg.raw)
            write_history_csv(out_dir / "metrics.csv", state.history)  # type: ignore[operator]
    if bar is not None:
        bar.close()
    if per_client is None:  # resumed a finished run
        per_client = sim.evaluate(state)
    final = summarize(per_client)
    summary = {
        "algorithm": cfg.algorithm["name"],
        "data": cfg.data["name"],
        "rounds": state.round,
        "final": final,
        "excluded_updates": state.counters.get("excluded_updates", 0),
        "train_seconds_this_process": t_train,
        # over all rounds of the run, interrupted or not (the training time is kept in the checkpoint)
        "seconds_per_round": state.counters.get("train_seconds", 0.0) / state.round if state.round else None,
        "config": cfg.raw,
    }
    if out_dir is not None:
        write_history_csv(out_dir / "metrics.csv", state.history)
        write_clients_csv(out_dir / "clients.csv", per_client)
        write_json(out_dir / "summary.json", summary)
        plot_history(out_dir / "accuracy.png", state.history, f"{cfg.algorithm['name']} on {cfg.data['name']}")
    summary["history"] = state.history
    summary["per_client"] = per_client
    return summary


def fmt_pct(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else 100.0 * x
