"""``fedmtl bench secagg``: what secure aggregation (``flower.secure_aggregation = true``, Flower's SecAgg+) costs a
FedAvg round, against the same round without it, on the same workload.

Workload: FedEM's synthetic federation with ``clients`` clients in contiguous blocks over ``nodes`` SuperNodes
(``dim`` features, linear model, batch 128, one local epoch, every client every round), torch threads fixed
(``--threads``, also ``OMP_NUM_THREADS`` of every process started).  Two paths, each timed with and without SecAgg+:

* ``wire_*``: the ServerApp over ``fedmtl.flower.loopback.WireGrid`` (the nodes in this process, every message
  through Flower's protobuf both ways): seconds per round, and bytes per round of the training exchanges (to and from
  the nodes, the exact sizes a SuperLink relays; a SecAgg+ round is four exchanges, a plain round one).  This is the
  protocol's computation and traffic without a network.
* ``deployment_*``: a real SuperLink and the SuperNodes on 127.0.0.1 with TLS and node authentication, each with its
  warm worker (``fedmtl flower worker``): seconds per round, where Flower starts a process per message on each node.

Round times are the median over the rounds after the first (which pays start-up costs).  ``*_ratio``: with over
without.  A SIGTERM or Ctrl-C ends the benchmark's SuperLink and SuperNodes with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from .common import add_out, add_rounds, add_threads

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = {n}
dim = {dim}
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
eval_every = {rounds}
"""

SECURE = "\n[flower]\nsecure_aggregation = true\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p, default=5, what="FedAvg rounds (at least 3; the median of the rounds after the first is reported)")
    add_threads(p)
    p.add_argument("--clients", type=int, default=30, help="clients of the FedAvg workload")
    p.add_argument("--nodes", type=int, default=3, help="SuperNodes (at least 3: SecAgg+ needs them)")
    p.add_argument("--dim", type=int, default=1000, help="features of the synthetic data (the model has dim + 1 "
                                                         "parameters)")
    p.add_argument("--skip-deployment", action="store_true", help="time the in-process wire path only")


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalDeployment.__exit__, which ends its processes


def _blocks(clients: int, nodes: int) -> list[list[int]]:
    return [list(range(i * clients // nodes, (i + 1) * clients // nodes)) for i in range(nodes)]


def wire_round(text: str, clients: int, nodes: int) -> dict[str, float]:
    """Seconds per round (median after the first) and training bytes per round over ``WireGrid``."""
    from fedmtl.flower.apps import ServerOptions, server_main
    from fedmtl.flower.loopback import WireGrid, server_identity

    grid = WireGrid.spread(text, clients, nodes)
    with server_identity():
        res = server_main(grid, text, ServerOptions(num_nodes=nodes))
    secs = res.summary["round_seconds"]
    return {"round_s": statistics.median(secs[1:]), "first_round_s": secs[0],
            "train_bytes_per_round": grid.bytes_by_type.get("train", 0) / len(secs)}


def deployment_round(text: str, clients: int, nodes: int, tmp: Path, tag: str) -> dict[str, float]:
    """Seconds per round (median after the first) of a local deployment with TLS, node authentication, workers."""
    from fedmtl.config import validate
    from fedmtl.data.npz import export
    from fedmtl.flower.deploy import LocalDeployment
    from fedmtl.flower.project import write_project

    cfg = validate(tomllib.loads(text))
    app = write_project(cfg, tmp / f"app-{tag}", nodes)
    sites = [tmp / f"site{i}" for i in range(nodes)]
    if not sites[0].exists():
        data = cfg.build_data()
        for site, ks in zip(sites, _blocks(clients, nodes), strict=True):
            export(data, site, ks)
    out_dir = tmp / f"out-{tag}"
    with LocalDeployment(tmp / f"dep-{tag}", data_dirs=sites, workers=True) as dep:
        dep.wait_for_nodes(nodes)
        t0 = time.perf_counter()
        dep.run(app, out_dir, timeout=3600)
        total = time.perf_counter() - t0
    secs = json.loads((out_dir / "summary.json").read_text())["round_seconds"]
    return {"round_s": statistics.median(secs[1:]), "first_round_s": secs[0], "total_s": total}


def run(out: str | Path, clients: int = 30, nodes: int = 3, rounds: int = 5, threads: int = 1,
        deployment: bool = True, dim: int = 1000) -> dict[str, Any]:
    import torch

    from fedmtl.config import dumps, validate

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes a deployment starts
    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, _terminate)
    plain = dumps(validate(tomllib.loads(CONFIG.format(n=clients, rounds=rounds, dim=dim))).raw)
    secure = dumps(validate(tomllib.loads(CONFIG.format(n=clients, rounds=rounds, dim=dim) + SECURE)).raw)
    cfg = validate(tomllib.loads(plain))
    data = cfg.build_data()
    params = sum(int(p.numel()) for p in cfg.build_model(data.feature_shape, data.num_classes).module.parameters())
    del data
    from importlib.metadata import version

    res: dict[str, Any] = {"clients": clients, "nodes": nodes, "rounds": rounds, "algorithm": "fedavg",
                           "torch": torch.__version__, "flwr": version("flwr"), "cpus": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(), "model_parameters": params,
                           "secagg": {"clipping_range": 8.0, "quantization_range": 1 << 22, "num_shares": nodes,
                                      "reconstruction_threshold": nodes // 2 + 1}}
    for tag, text in (("plain", plain), ("secagg", secure)):
        for key, v in wire_round(text, clients, nodes).items():
            res[f"wire_{tag}_{key}"] = v
    res["wire_round_ratio"] = res["wire_secagg_round_s"] / res["wire_plain_round_s"]
    res["wire_bytes_ratio"] = res["wire_secagg_train_bytes_per_round"] / res["wire_plain_train_bytes_per_round"]
    if deployment:
        with tempfile.TemporaryDirectory() as tmp:
            for tag, text in (("plain", plain), ("secagg", secure)):
                for key, v in deployment_round(text, clients, nodes, Path(tmp), tag).items():
                    res[f"deployment_{tag}_{key}"] = v
        res["deployment_round_ratio"] = res["deployment_secagg_round_s"] / res["deployment_plain_round_s"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1))
    return res


def main(args: argparse.Namespace) -> int:
    if args.nodes < 3:
        print("error: --nodes must be at least 3 (SecAgg+ needs them)", file=sys.stderr)
        return 2
    run(args.out, clients=args.clients, nodes=args.nodes, rounds=max(args.rounds, 3), threads=args.threads,
        deployment=not args.skip_deployment, dim=args.dim)
    return 0


__all__ = ["add_arguments", "main", "run"]
