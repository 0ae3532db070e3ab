"""``fedmtl bench seeds``: wall time of ``fedmtl run`` on the synthetic FedEM config (200 rounds) with one seed and
with 5 seeds (``--seeds 1-5``, one batched computation), each a fresh process as a user runs it.  Figures are
measured and written to JSON, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedmtl.resources import config_path
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_threads, device_name, out_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_threads(p)
    add_device(p)
    p.add_argument("--repeats", type=int, default=2, help="measurements of each command (median)")


def main(args: argparse.Namespace) -> int:
    """Wall time of ``fedmtl run`` on the synthetic FedEM config (200 rounds) with one
    seed and with 5 seeds (``--seeds 1-5``, one batched computation), each a fresh process as a user runs it;
    ``ratio_5_vs_1`` = the 5-seed time over the 1-seed time, both measured in this call (alternating, the median
    of ``--repeats``).  Also the training seconds of each command (the runs' ``train_seconds_this_process``; medians
    and every repeat)."""
    config = str(config_path("synthetic/fedem.toml"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    times: dict[int, list[float]] = {1: [], 5: []}
    train: dict[int, list[float]] = {1: [], 5: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for n in (1, 5):
                out = Path(tmp) / f"r{rep}-s{n}"
                cmd = [sys.executable, "-m", "fedmtl", "-q", "run", config, "--out", str(out),
                       "--set", f"run.threads={args.threads}", "--device", args.device]
                cmd += ["--seeds", "1-5"] if n == 5 else []
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                times[n].append(time.perf_counter() - t0)
                runs = [out] if n == 1 else [out / f"seed-{s}" for s in range(1, 6)]
                train[n].append(sum(json.loads((r / "summary.json").read_text())["train_seconds_this_process"]
                                    for r in runs))
    t1, t5 = statistics.median(times[1]), statistics.median(times[5])
    res = {
        "benchmark": "seeds", "config": "configs/synthetic/fedem.toml", "rounds": 200, "seeds": [1, 2, 3, 4, 5],
        "torch_threads": args.threads, "torch": torch.__version__, "device": device_name(args.device),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "repeats": args.repeats,
        "one_seed_s": t1, "five_seeds_s": t5, "one_seed_all_s": times[1], "five_seeds_all_s": times[5],
        "one_seed_train_s": statistics.median(train[1]), "five_seeds_train_s": statistics.median(train[5]),
        "one_seed_train_all_s": train[1], "five_seeds_train_all_s": train[5],
        "ratio_5_vs_1": t5 / t1, "train_ratio_5_vs_1": statistics.median(train[5]) / statistics.median(train[1]),
    }
    write_json(out_path(args.out), res)
    for k, v in res.items():
        print(f"{k:24s} {v:.4f}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0


__all__ = ["add_arguments", "main"]
