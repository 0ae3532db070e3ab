"""``fedmtl bench tune``: what ``fedmtl tune --batch-trials K`` saves.  The same study (a space over ``optim.lr``;
with ``--space fedprox``, over ``optim.lr`` and FedProx's ``algorithm.mu``; TPE seed 0, no pruning, so that every
trial runs all its rounds in both) of the synthetic config shortened to ``--rounds`` rounds on the vmap executor,
with its trials one after the other and ``K`` at a time as one batched computation; whole-study seconds (the median
of ``--repeats``, alternating) and their ratio.  Figures are measured and written to JSON, never asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedmtl.runs.report import write_json

from .common import add_out, add_threads, out_path

SPACE = "[optim]\nlr = { low = 0.003, high = 1.0, log = true }\n"
#: ``--space``: the searched keys and the algorithm they are searched for (``fedprox``: a rate and FedProx's mu per
#: replica, ``engine.clients.with_fields``)
SPACES = {"lr": (SPACE, "fedavg"),
          "fedprox": (SPACE + "[algorithm]\nmu = { low = 0.001, high = 1.0, log = true }\n", "fedprox")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_threads(p)
    p.add_argument("--trials", type=int, default=8, help="trials per study")
    p.add_argument("--batch", type=int, default=4, help="K of --batch-trials K")
    p.add_argument("--rounds", type=int, default=20, help="rounds per trial")
    p.add_argument("--clients", type=int, default=100, help="clients of the synthetic federation")
    p.add_argument("--repeats", type=int, default=1, help="measurements of each mode (median)")
    p.add_argument("--space", choices=sorted(SPACES), default="lr",
                   help="lr: FedAvg over optim.lr; fedprox: FedProx over optim.lr and algorithm.mu")


def main(args: argparse.Namespace) -> int:
    """Seconds (wall and this process's CPU) of the whole study with ``--batch-trials 1`` and ``--batch-trials K``, in
    this process."""
    from fedmtl.runs.tune import tune

    torch.set_num_threads(args.threads)
    sets = [f"run.rounds={args.rounds}", f"run.eval_every={max(1, args.rounds // 4)}", "run.checkpoint_every=0",
            "run.runner=vmap", f"run.threads={args.threads}", f"data.num_clients={args.clients}",
            "optim.lr_milestones=[]", f"algorithm.name={SPACES[args.space][1]}"]
    times: dict[int, list[float]] = {1: [], args.batch: []}
    cpu: dict[int, list[float]] = {1: [], args.batch: []}  # this process's CPU seconds: steadier on a shared machine
    values: dict[int, list[float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        space = Path(tmp) / "space.toml"
        space.write_text(SPACES[args.space][0])
        for rep in range(args.repeats):
            for k in (1, args.batch):
                t0, c0 = time.perf_counter(), time.process_time()
                s = tune("synthetic/fedavg", space, trials=args.trials, seed=0, out=Path(tmp) / f"r{rep}-k{k}",
                         sets=sets, batch_trials=k, prune=False)
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
                values[k] = [r["value"] for r in s.trials]
    t1, tk = statistics.median(times[1]), statistics.median(times[args.batch])
    res = {
        "benchmark": "tune", "config": "configs/synthetic/fedavg.toml", "sets": sets,
        "space": SPACES[args.space][0].strip(),
        "trials": args.trials, "batch_trials": args.batch, "torch_threads": args.threads, "torch": torch.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "repeats": args.repeats,
        "one_at_a_time_s": t1, "batched_s": tk, "one_at_a_time_all_s": times[1], "batched_all_s": times[args.batch],
        "ratio_batched_vs_one": tk / t1, "one_at_a_time_cpu_s": statistics.median(cpu[1]),
        "batched_cpu_s": statistics.median(cpu[args.batch]),
        "cpu_ratio_batched_vs_one": statistics.median(cpu[args.batch]) / statistics.median(cpu[1]),
        "load_average_1min": os.getloadavg()[0], "best_value_one": max(v for v in values[1] if v is not None),
        "best_value_batched": max(v for v in values[args.batch] if v is not None),
    }
    write_json(out_path(args.out), res)
    for key, v in res.items():
        print(f"{key:24s} {v:.4f}" if isinstance(v, float) else f"{key:24s} {v}")
    return 0


__all__ = ["add_arguments", "main"]
