"""``fedmtl bench batchnorm``: seconds per round of ``cnn_bn`` (batch norm after every layer) and of an MLP with batch
norm (784-200-10, ``mlp`` with ``batch_norm = true``) under FedAvg and FedBN on each executor: ``stacked`` (the
clients form: grouped convolutions or batched products, per-client batch statistics), ``vmap`` and ``loop``, on
synthetic 28 x 28 images, with the executor ``auto`` picks for each.  Figures are measured and written to JSON, never
asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
import torch

from fedmtl.algorithms import FedAvg, FedBN
from fedmtl.data.federated import FederatedData
from fedmtl.engine.executors import make_executor
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.models import build_model
from fedmtl.optim import SGD
from fedmtl.runs.driver import make_engine
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, device_name, out_path, time_rounds

RUNNERS = ("stacked", "vmap", "loop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p, default=5, what="rounds timed per executor, interleaved (the median is reported)")
    add_threads(p)
    add_device(p)
    p.add_argument("--clients", type=int, default=20, help="clients, all sampled every round")
    p.add_argument("--examples", type=int, default=40, help="training examples per client (sizes 0.5x to 1.5x)")
    p.add_argument("--batch-size", type=int, default=10, help="local batch size")
    p.add_argument("--hidden", type=int, default=128, help="cnn_bn's dense layer")


def images(clients: int, examples: int, seed: int = 0) -> FederatedData:
    """``clients`` clients of 1 x 28 x 28 images (sizes spread from half to one and a half times ``examples``), each
    with its own brightness and contrast (FedBN's feature shift), 10 classes of one linear rule."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(28 * 28, 10))
    pairs = []
    for k in range(clients):
        n = int(examples * (0.5 + k / max(clients - 1, 1)))
        x = rng.normal(size=(n, 1, 28, 28)).astype(np.float32)
        pairs.append((x * (1 + k % 4) + k % 3, np.argmax(x.reshape(n, -1) @ w, 1)))
    return FederatedData.from_arrays(pairs, pairs, num_classes=10)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    data = images(args.clients, args.examples)
    models = {"cnn_bn": build_model("cnn_bn", (1, 28, 28), 10, hidden=args.hidden),
              "mlp_bn": build_model("mlp", (1, 28, 28), 10, hidden=(200,), batch_norm=True)}
    dev = torch.device(args.device)
    res: dict[str, object] = {
        "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__, "device": device_name(args.device), "rounds_timed": args.rounds,
        "clients": args.clients, "train_examples": int(data.seen.train.counts.sum()), "batch_size": args.batch_size,
        "cnn_bn_hidden": args.hidden, "load_average_1min_at_start": os.getloadavg()[0],
    }
    secs: dict[str, float] = {}
    for name, model in models.items():
        model.check_features(data.seen.train.x[:6])  # the clients form verified, as a run does, before ``auto``
        res[f"{name}_auto_runner"] = make_executor("auto", model, dev).name
        for alg in (FedAvg(), FedBN()):
            key = f"{name}_{alg.name}"
            engines = {}
            for runner in RUNNERS:
                sim = make_engine(alg, model, data, RunSpec(RunConfig(
                    rounds=10, runner=runner, batch_size=args.batch_size, device=args.device), SGD(lr=0.05)))
                st = sim.init_state()
                sim.round(st)  # warm-up
                engines[runner] = (sim, st)
            times: dict[str, list[float]] = {r: [] for r in RUNNERS}
            for _ in range(args.rounds):  # the executors' rounds interleaved: a shared machine's load hits all alike
                for runner, (sim, st) in engines.items():
                    times[runner] += time_rounds(lambda sim=sim, st=st: sim.round(st), 1, warmup=0)
            for runner in RUNNERS:
                res[f"{key}_{runner}_round_s"] = secs[runner] = statistics.median(times[runner])
                print(f"{key} {runner}: {secs[runner]:.3f} s/round", flush=True)
            res[f"{key}_stacked_vs_vmap"] = secs["stacked"] / secs["vmap"]
            res[f"{key}_stacked_vs_loop"] = secs["stacked"] / secs["loop"]
    write_json(out_path(args.out), res)
    return 0
