"""``fedmtl bench flower``: seconds per FedAvg round for one workload on the three paths.

Workload: FedEM's synthetic federation with ``clients`` clients (linear model, batch 128, one local epoch, every
client every round). ``vmap_round_s``: the in-process vmap runner; ``flower_simulation_round_s``: Flower's
simulation engine (two virtual SuperNodes of half the clients each, one Ray actor);
``flower_deployment_round_s``: a real SuperLink and two SuperNodes (each serving half of the clients) on
127.0.0.1 with TLS and node authentication, each with its warm worker (``fedmtl flower worker``: the ClientApp
relays every message to it); ``flower_deployment_cold_round_s``: the same without workers (each message handled
in the process Flower starts for it).  ``deployment_round_vs_simulation``: the first over the simulation's round;
``worker_train_message_s``: what the workers spent on a train message; ``clientapp_import_s``: the imports of the
process Flower starts per message (``flwr-clientapp`` and the relay app), the floor of a deployed round.  Round
times are the median over rounds after the first (which pays start-up costs), reported with the first round's
time.  ``torch_import_s``: a fresh ``python -c "import torch"`` (median of 3), timed in the same run: what a
message costs a node without a worker at least (``deployment_round_vs_torch_import``).  A SIGTERM or Ctrl-C
ends the benchmark's SuperLink and SuperNodes with it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from .common import add_out, add_rounds

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = {n}
seed = 1

[model]
name = "linear"

[algorithm]
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = {rounds}
batch_size = 128
seed = 3
runner = "vmap"
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p, what="FedAvg rounds (at least 3; the median of the rounds after the first is reported)")
    p.add_argument("--clients", type=int, default=100, help="clients of the FedAvg workload")


def torch_import_seconds(repeats: int = 3) -> float:
    """Median wall-clock seconds of a fresh interpreter importing torch."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def clientapp_import_seconds(repeats: int = 3) -> float:
    """Median wall-clock seconds of a fresh interpreter importing what Flower's per-message ClientApp process
    (``flwr-clientapp``) imports before it runs any app code, and the project's relay ClientApp."""
    code = "from flwr.supernode.cli import flwr_clientapp; import fedmtl.flower.relay_app"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalDeployment.__exit__, which ends its processes


def run(out: str | Path, clients: int = 100, rounds: int = 4) -> dict[str, Any]:
    from fedmtl.config import dumps, validate
    from fedmtl.flower.deploy import LocalDeployment
    from fedmtl.flower.project import write_project
    from fedmtl.flower.simulation import simulate
    from fedmtl.runs.driver import build_local

    cfg = validate(tomllib.loads(CONFIG.format(n=clients, rounds=rounds)))
    text = dumps(cfg.raw)
    import torch

    signal.signal(signal.SIGTERM, _terminate)
    res: dict[str, Any] = {"clients": clients, "rounds": rounds, "algorithm": "fedavg", "nodes": 2,
                           "torch_threads": torch.get_num_threads()}
    res["torch_import_s"] = torch_import_seconds()
    sim = build_local(cfg)
    st = sim.init_state()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sim.round(st)
        times.append(time.perf_counter() - t0)
    res["vmap_round_s"] = statistics.median(times[1:])
    t0 = time.perf_counter()
    s = simulate(text, clients, nodes=2)
    res["flower_simulation_total_s"] = time.perf_counter() - t0
    hs = s.summary["round_seconds"]
    res["flower_simulation_round_s"] = statistics.median(hs[1:])
    res["flower_simulation_first_round_s"] = hs[0]
    with tempfile.TemporaryDirectory() as tmp:
        from fedmtl.data.npz import export

        app = write_project(cfg, Path(tmp) / "app", 2)
        half = clients // 2
        data = cfg.build_data()  # each node gets its own half as .npz files (node-local data, as sites hold it)
        export(data, Path(tmp) / "site0", list(range(half)))
        export(data, Path(tmp) / "site1", list(range(half, clients)))
        del data
        for workers, key in ((True, "flower_deployment"), (False, "flower_deployment_cold")):
            dep_dir, out_dir = Path(tmp) / f"dep-{key}", Path(tmp) / f"out-{key}"
            with LocalDeployment(dep_dir, data_dirs=[Path(tmp) / "site0", Path(tmp) / "site1"],
                                 workers=workers) as dep:
                dep.wait_for_nodes(2)
                t0 = time.perf_counter()
                dep.run(app, out_dir, timeout=3600)
                res[f"{key}_total_s"] = time.perf_counter() - t0
            d = json.loads((out_dir / "summary.json").read_text())
            hd = d["round_seconds"]
            res[f"{key}_round_s"] = statistics.median(hd[1:])
            res[f"{key}_first_round_s"] = hd[0]
            if workers:  # what the warm workers spent on the train messages (their logs: one line a message)
                served = [float(m.group(1)) for i in range(2) for m in re.finditer(
                    r"served train \(run \d+\) in ([0-9.]+) s", (dep_dir / f"worker{i}.log").read_text())]
                res["worker_train_message_s"] = statistics.median(served) if served else None
    res["clientapp_import_s"] = clientapp_import_seconds()
    res["deployment_round_vs_simulation"] = res["flower_deployment_round_s"] / res["flower_simulation_round_s"]
    res["cold_deployment_round_vs_simulation"] = (res["flower_deployment_cold_round_s"]
                                                  / res["flower_simulation_round_s"])
    res["simulation_over_vmap"] = res["flower_simulation_round_s"] / res["vmap_round_s"]
    res["deployment_over_vmap"] = res["flower_deployment_round_s"] / res["vmap_round_s"]
    res["deployment_round_vs_torch_import"] = res["flower_deployment_round_s"] / res["torch_import_s"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1))
    return res


def main(args: argparse.Namespace) -> int:
    # round 1 pays start-up; the median of the later rounds is reported
    run(args.out, clients=args.clients, rounds=max(args.rounds, 3))
    return 0


__all__ = ["add_arguments", "main", "run", "torch_import_seconds"]
