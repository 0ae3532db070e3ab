"""Seeds as a batch dimension: ``fedmtl run CONFIG --seeds 1,2,3`` (``[run] seeds = [...]``,
``fedmtl.run(..., seeds=[...])``).

Each seed is an independent replica of the run: its own model initialization, client sampling, batch orders,
systems draws, attackers and privacy noise, i.e. exactly the run ``fedmtl run CONFIG --set run.seed=S`` gives
(the data, built once, is shared: ``[data] seed`` is the data's own seed).  The replicas advance round by round
together and, in a simulation on the vmap or loop executor, their sampled clients train in the same batched
executor calls (``engine.clients.train_together``): a vmap over all replicas' clients at once.  The stacked executor
runs each replica's clients as one computation per local step already and trains the replicas one after the other
(``driver._batchable``); evaluation is shared either way (``engine.clients.evaluate_together``).

Run directory::

    seed-<S>/       a complete run directory per seed (config.toml with run.seed = S, metrics.csv, clients.csv,
                    summary.json, checkpoint.pt, ...): each can be resumed or inspected alone
    config.toml     the resolved configuration, run.seeds included: fedmtl run --resume --out DIR
    summary.json    per final metric: mean, std (ddof = 1), the 95% confidence interval of the mean (Student t)
                    and the per-seed values; the seeds; the config
    metrics.csv     per evaluated round: mean and std over seeds of every evaluation metric
    accuracy.png    test accuracy over rounds, mean over seeds with a +-1 std band
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, ExperimentConfig, dumps
from ..data.federated import FederatedData
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10, UNSEEN_TEST_ACC_MEAN
from ..files import atomic
from ..models.base import Model
from .driver import Replica, RunResult, build_local, drive_many, prepare
from .report import plot_bands, run_figures_on, write_json
from .rundir import COMMIT, NEXT, RunDirectory, check_resumable, seed_dirs


@dataclass
class SeedsResult:
    """What ``fedmtl.run(..., seeds=...)`` returns: one ``RunResult`` per seed and their statistics.

    ``summary["final"][metric]`` = ``{"mean", "std", "ci95_low", "ci95_high", "values"}``."""

    runs: list[RunResult]
    summary: dict[str, Any]
    out: Path | None = None

    @property
    def final(self) -> dict[str, dict[str, Any]]:
        return self.summary["final"]


def seed_dir(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


def stats(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std and the two-sided 95% Student-t confidence interval of the mean of ``values`` (None and
    non-finite values left out)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "std": None, "ci95_low": None, "ci95_high": None, "values": values}
    mean = float(v.mean())
    if v.size == 1:
        return {"mean": mean, "std": 0.0, "ci95_low": None, "ci95_high": None, "values": values}
    from scipy.special import stdtrit  # the t quantile (scipy.stats is slow to import)

    std = float(v.std(ddof=1))
    half = float(stdtrit(v.size - 1, 0.975)) * std / math.sqrt(v.size)
    return {"mean": mean, "std": std, "ci95_low": mean - half, "ci95_high": mean + half, "values": values}


def run_seeds(cfg: ExperimentConfig, seeds: list[int] | tuple[int, ...] | None = None, out: str | Path | None = None,
              resume: bool = False, progress: bool | str = True, data: FederatedData | None = None,
              model: Model | None = None, overwrite: bool = False,
              on_round: Callable[[list[Replica]], None] | None = None) -> SeedsResult:
    """Run ``cfg`` once per seed (default: ``cfg.run.seeds``), the replicas batched together.  ``resume``: the
    seeds whose folder holds a checkpoint continue from it; ``overwrite``: the other seeds' results are replaced.
    ``on_round``: called after every round with the replicas that ran it (``driver.drive_many``)."""
    seeds = list(seeds if seeds is not None else cfg.run.seeds)
    if not seeds:
        raise ConfigError(f"{cfg.source}: no seeds to run (run.seeds or --seeds)")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{cfg.source}: the seeds {seeds} are not distinct")
    if resume and overwrite:
        raise ConfigError("resume and overwrite (--resume, --overwrite) exclude each other")
    configs = {s: cfg.with_seed(s) for s in seeds}
    if out is not None:  # before anything is built or touched: the directory must fit the command
        check_resumable(Path(out), cfg.raw, seeds, resume, overwrite, lambda s: configs[s].raw, cfg.source)
    out_dir, prog, data = prepare(cfg, out, resume, progress, data)
    name = cfg.algorithm["name"]
    with contextlib.ExitStack() as stack:
        if out_dir is not None:
            # the top level holds the resolved config (with the seeds) and, at the end, the statistics; each seed's
            # folder is a run directory of its own
            top_dir = stack.enter_context(RunDirectory(out_dir, overwrite=overwrite, seeds=True, deferred=True))
            finish_group_commit(out_dir)
            top = {t: dict(v) for t, v in cfg.raw.items()}
            top["run"]["seeds"] = list(seeds)
            with atomic(out_dir / "config.toml") as f:
                f.write(dumps(top))
        replicas = []
        for s, c in configs.items():
            d = None if out_dir is None else seed_dir(out_dir, s)
            if d is not None:  # resume the seeds that have a checkpoint; overwrite (if asked) the others
                cont = resume and (d / "checkpoint.pt").exists()
                stack.enter_context(RunDirectory(d, cont, overwrite and not cont))
            replicas.append(Replica(build_local(c, data, model, d), c, d, f"{name} seed {s}"))
        replicas[0].engine.check_memory(len(replicas))  # all replicas' clients share the batched calls
        if out_dir is not None:
            top_dir.commit()  # built: the results an overwrite replaces go only now
        runs = drive_many(replicas, resume, prog, group_dir=out_dir, on_round=on_round)
        result = SeedsResult(runs, summarize_seeds(cfg, seeds, runs), out_dir)
        if out_dir is not None:
            write_seeds(out_dir, result, f"{name} on {cfg.data['name']}")
    return result


def finish_group_commit(out: Path) -> None:
    """Complete or undo the replicas' last group checkpoint (``drive_many`` writes every replica's
    ``checkpoint.next.pt``, then the top level's ``seeds-commit.json``, then renames them): with the marker, the group
    was durable and the renames are completed; without it, the group never was and the new files are removed.  Every
    replica then resumes from the same round, so a kill anywhere gives a run byte-identical to an uninterrupted one."""
    nexts = [d / NEXT for d in seed_dirs(out).values() if (d / NEXT).exists()]
    if (out / COMMIT).exists():
        for n in nexts:
            os.replace(n, n.with_name("checkpoint.pt"))
        (out / COMMIT).unlink()
    else:
        for n in nexts:
            n.unlink()


def summarize_seeds(cfg: ExperimentConfig, seeds: list[int], runs: list[RunResult]) -> dict[str, Any]:
    keys = [k for k in runs[0].summary["final"] if all(k in r.summary["final"] for r in runs)]
    final = {k: stats([float(r.summary["final"][k]) for r in runs]) for k in keys}
    summary: dict[str, Any] = {
        "algorithm": cfg.algorithm["name"], "data": cfg.data["name"], "seeds": seeds,
        "rounds": [r.summary["rounds"] for r in runs], "final": final,
        # per replica: a batched round's time shared evenly among the replicas
        "seconds_per_round": stats([r.summary["seconds_per_round"] for r in runs])["mean"],
        "runs": [f"seed-{s}" for s in seeds], "config": cfg.raw,
    }
    if all("epsilon" in r.summary for r in runs):
        summary["epsilon"] = [r.summary["epsilon"] for r in runs]
    return summary


def history_stats(histories: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per evaluated round: mean and std over the runs of every evaluation metric and of the simulated clock
    ``est_time_s`` (``*_mean`` / ``*_std``)."""
    rounds: dict[int, list[dict[str, Any]]] = {}
    for hist in histories:
        for row in hist:
            if any(k.startswith(("seen_", "unseen_")) for k in row):
                rounds.setdefault(int(row["round"]), []).append(row)
    out = []
    for rnd in sorted(rounds):
        rows = rounds[rnd]
        entry: dict[str, Any] = {"round": rnd, "runs": len(rows)}
        keys = [k for k in rows[0] if k.startswith(("seen_", "unseen_", "participation")) or k == "est_time_s"]
        for k in keys:
            s = stats([float(r[k]) for r in rows if isinstance(r.get(k), int | float)])
            entry[f"{k}_mean"], entry[f"{k}_std"] = s["mean"], s["std"]
        out.append(entry)
    return out


def write_seeds(out: Path, result: SeedsResult, title: str) -> None:
    from .report import write_history_csv

    rows = history_stats([r.history for r in result.runs])
    write_history_csv(out / "metrics.csv", rows)
    write_json(out / "summary.json", result.summary)
    bands = {}
    for key, label in ((SEEN_TEST_ACC_MEAN, "test (seen, mean)"), (SEEN_TEST_ACC_P10, "test (seen, 10th pct)"),
                       (UNSEEN_TEST_ACC_MEAN, "test (unseen, mean)")):
        pts = [r for r in rows if r.get(f"{key}_mean") is not None]
        if pts:
            bands[label] = ([r["round"] for r in pts], [100 * r[f"{key}_mean"] for r in pts],
                            [100 * (r[f"{key}_std"] or 0.0) for r in pts])
    if bands and run_figures_on():  # (a reproduction draws one summary figure instead)
        n = len(result.runs)
        plot_bands(out / "accuracy.png", bands, "accuracy (%)", f"{title}: mean over {n} seeds, band = +-1 std")


__all__ = ["SeedsResult", "history_stats", "run_seeds", "seed_dir", "stats"]
