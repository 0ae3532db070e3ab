"""``fedmtl bench peers``: the workload a researcher brings from the most used personalized-FL library, timed in one
process against two per-client ``nn.Module`` loops and against the floor.

Workload (that library's defaults): Fashion-MNIST, a seeded uniform subset of 12,000 images (9,000 training
examples), 20 clients by a Dirichlet(0.1) label split (``fedmtl.data.partition.dirichlet``, at least 40 examples
each), 75/25 train/test per client, images scaled to [-1, 1]; batch 10 with the last partial batch dropped (as its
``DataLoader(drop_last=True, shuffle=True)``), SGD with rate 0.005 and no momentum, one local epoch, every client
every round.  The models are plain user ``nn.Module``s given through ``Model.from_module``: an MLP 784-100-10 and
the CNN conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc10.

Timed per round (the median of ``--rounds`` after one untimed round), all on ``--device`` with ``--threads``:

* ``fedmtl``: FedAvg, Ditto (lambda 0.1) and FedEM (M = 3) on the engine's default path for the model;
* ``per_client`` (peer-style): per client a copy of the global module loaded with ``load_state_dict``, a
  ``torch.optim.SGD`` and a shuffling ``DataLoader``, trained, its ``state_dict`` averaged by example counts
  (Ditto: a personal module per client trained with the proximal pull besides; FedEM: M modules per client, an
  E-step over a non-shuffled loader, q-weighted M-steps);
* ``lean`` (FedAvg): one module whose parameters are overwritten per client, the same SGD steps over pre-made
  tensor batches (no ``DataLoader``), a running weighted sum; for the CNN also ``lean_channels_last``, the same in
  the channels-last memory format (the per-client computation at its fastest, not what peers write);
* ``centralized`` (the floor): the same model trained centrally for one epoch over the same 9,000 examples with the
  clients' batches side by side (batch 20 x 10 = 200): same FLOPs, the best kernel shapes (for the CNN the faster
  of the default and the channels-last memory formats).

Keys: ``speedup_vs_per_client_{mlp,cnn}`` (per-client round / fedmtl round, FedAvg), ``speedup_vs_lean_loop_*``,
``round_vs_centralized_*`` (fedmtl round / centralized epoch), the Ditto and FedEM rounds and their per-client
baselines, the engine's path for each model (``path_*``) and, with ``--runners all``, FedAvg on the executors it did
not choose (``fedmtl_fedavg_round_s_{model}_{runner}``), device, threads, torch version.  Figures, never
assertions.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedmtl.algorithms import Ditto, FedAvg, FedEM
from fedmtl.data.federated import FederatedData
from fedmtl.data.vision import fmnist_peer_workload
from fedmtl.engine.executors import make_executor
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.models.base import Model
from fedmtl.optim import SGD
from fedmtl.runs.driver import make_engine
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, central_epoch, out_path

CLIENTS, ALPHA, EXAMPLES, BATCH, LR = 20, 0.1, 12_000, 10, 0.005


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p)
    add_threads(p)
    add_device(p)
    p.add_argument("--models", default="mlp,cnn", help="which models (mlp, cnn)")
    p.add_argument("--runners", choices=("all", "default"), default="all",
                   help="also time FedAvg on the executors the engine did not choose (stacked, vmap, loop)")


def mlp_module() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))


def cnn_module() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def peers_data(seed: int = 0) -> FederatedData:
    """The workload's federation (module docstring): ``fedmtl.data.vision.fmnist_peer_workload``."""
    return fmnist_peer_workload(seed, EXAMPLES, CLIENTS, ALPHA)


def _median_round(step: Callable[[], Any], rounds: int, device: torch.device) -> float:
    for _ in range(2 if device.type == "cuda" else 1):  # untimed (on a GPU the second records the steps as graphs)
        step()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class PeerLoop:
    """The per-client loops of the module docstring, over the federation's training data on ``device``."""

    def __init__(self, data: FederatedData, module: nn.Module, device: torch.device, seed: int = 0):
        tr = data.seen.train
        self.device = device
        self.clients = [tuple(t.to(device) for t in tr.client(k)) for k in range(tr.num_clients)]
        self.counts = [len(c[1]) for c in self.clients]
        self.global_ = copy.deepcopy(module).to(device)
        self.gen = torch.Generator().manual_seed(seed)
        self.personal: list[nn.Module] = []

    def _loader(self, k: int, shuffle: bool = True, with_index: bool = False) -> DataLoader:
        x, y = self.clients[k]
        ds = TensorDataset(x, y, torch.arange(len(y), device=self.device)) if with_index else TensorDataset(x, y)
        return DataLoader(ds, BATCH, shuffle=shuffle, drop_last=shuffle, generator=self.gen if shuffle else None)

    def _average(self, states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
        total = sum(weights)
        return {k: sum(s[k] * (w / total) for s, w in zip(states, weights, strict=True)) for k in states[0]}

    def fedavg_round(self) -> None:
        """Peer style: a module, an optimizer and a DataLoader per client."""
        states = []
        for k in range(len(self.clients)):
            local = copy.deepcopy(self.global_)
            opt = torch.optim.SGD(local.parameters(), lr=LR)
            for xb, yb in self._loader(k):
                opt.zero_grad()
                nn.functional.cross_entropy(local(xb), yb).backward()
                opt.step()
            states.append(local.state_dict())
        self.global_.load_state_dict(self._average(states, self.counts))

    def lean_round(self) -> None:
        """One module over pre-made tensor batches, parameters overwritten per client, a running weighted sum."""
        start = [p.detach().clone() for p in self.global_.parameters()]
        acc = [torch.zeros_like(p) for p in start]
        total = float(sum(self.counts))
        params = list(self.global_.parameters())
        for (x, y), n in zip(self.clients, self.counts, strict=True):
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            order = torch.randperm(n, generator=self.gen).to(self.device)
            for i in range(n // BATCH):
                idx = order[i * BATCH:(i + 1) * BATCH]
                loss = nn.functional.cross_entropy(self.global_(x[idx]), y[idx])
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g in zip(params, grads, strict=True):
                        p.sub_(g, alpha=LR)
            with torch.no_grad():
                for a, p in zip(acc, params, strict=True):
                    a.add_(p, alpha=n / total)
        with torch.no_grad():
            for p, a in zip(params, acc, strict=True):
                p.copy_(a)

    def lean_channels_last_round(self) -> None:
        """``lean_round`` with the module and its batches in the channels-last memory format (a CNN's kernels run
        faster so on a CPU): what one client's computation at this batch size costs at best, client after client."""
        if not hasattr(self, "_cl"):
            self._cl = copy.deepcopy(self.global_).to(memory_format=torch.channels_last)
        params, start = list(self._cl.parameters()), [p.detach().clone() for p in self.global_.parameters()]
        for (x, y), n in zip(self.clients, self.counts, strict=True):
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            order = torch.randperm(n, generator=self.gen).to(self.device)
            for i in range(n // BATCH):
                idx = order[i * BATCH:(i + 1) * BATCH]
                loss = nn.functional.cross_entropy(self._cl(x[idx].contiguous(memory_format=torch.channels_last)),
                                                   y[idx])
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g in zip(params, grads, strict=True):
                        p.sub_(g, alpha=LR)

    def ditto_round(self, lam: float = 0.1) -> None:
        """Peer style Ditto: the global model's local update (as FedAvg) and, per client, its own personal module
        trained with the proximal pull ``lam (v - w)`` towards the received global model."""
        if not self.personal:
            self.personal = [copy.deepcopy(self.global_) for _ in self.clients]
        received = [p.detach().clone() for p in self.global_.parameters()]
        for k, v in enumerate(self.personal):
            opt = torch.optim.SGD(v.parameters(), lr=LR)
            for xb, yb in self._loader(k):
                opt.zero_grad()
                nn.functional.cross_entropy(v(xb), yb).backward()
                with torch.no_grad():
                    for p, w in zip(v.parameters(), received, strict=True):
                        p.grad.add_(p - w, alpha=lam)  # type: ignore[union-attr]
                opt.step()
        self.fedavg_round()

    def fedem_round(self, m: int = 3) -> None:
        """Peer style FedEM (its reference implementation's shape): M modules per client; the E-step's losses
        over a non-shuffled loader, pi = mean q; each component one epoch of q-weighted SGD; the server averages
        each component by example counts."""
        if not hasattr(self, "components"):
            self.components = [copy.deepcopy(self.global_) for _ in range(m)]
            self.pis = [torch.full((m,), 1.0 / m, device=self.device) for _ in self.clients]
        states: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(m)]
        for k in range(len(self.clients)):
            local = [copy.deepcopy(c) for c in self.components]
            with torch.no_grad():
                losses = torch.stack([torch.cat([nn.functional.cross_entropy(c(xb), yb, reduction="none")
                                                 for xb, yb in self._loader(k, shuffle=False)]) for c in local])
            q = torch.softmax(torch.log(self.pis[k]).unsqueeze(1) - losses, 0)  # (M, n)
            self.pis[k] = q.mean(1)
            for j, c in enumerate(local):
                opt = torch.optim.SGD(c.parameters(), lr=LR)
                for xb, yb, ib in self._loader(k, with_index=True):
                    opt.zero_grad()
                    (q[j, ib] * nn.functional.cross_entropy(c(xb), yb, reduction="none")).mean().backward()
                    opt.step()
                states[j].append(c.state_dict())
        for j, c in enumerate(self.components):
            c.load_state_dict(self._average(states[j], self.counts))


def centralized_epoch(data: FederatedData, module: nn.Module, device: torch.device, seed: int = 0,
                      channels_last: bool = False) -> Callable[[], None]:
    """One epoch of the same model on all training examples at batch clients x batch (the floor); ``channels_last``:
    a CNN in the channels-last memory format (the faster layout for its kernels on a CPU)."""
    return central_epoch(module, data.seen.train.x, data.seen.train.y, CLIENTS * BATCH, LR, device, seed,
                         channels_last)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = peers_data()
    res: dict[str, Any] = {
        "benchmark": "peers", "device": str(device) if device.type == "cpu" else
        f"{device} ({torch.cuda.get_device_name(device)})", "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "rounds_timed": args.rounds, "clients": CLIENTS, "dirichlet_alpha": ALPHA, "batch_size": BATCH, "lr": LR,
        "train_examples": int(data.seen.train.counts.sum()),
        "client_train_examples": data.seen.train.counts.tolist(),
    }
    algs = {"fedavg": FedAvg(), "ditto": Ditto(lam=0.1), "fedem": FedEM(num_components=3)}
    for name, make in (("mlp", mlp_module), ("cnn", cnn_module)):
        if name not in args.models.split(","):
            continue
        torch.manual_seed(0)
        module = make()
        model = Model.from_module(module, num_classes=10, init="module")
        res[f"path_{name}"] = default = make_executor("auto", model, device).name

        def engine_round(alg: Any, runner: str = "auto", model: Model = model) -> float:
            sim = make_engine(alg, model, data, RunSpec(RunConfig(
                rounds=10, batch_size=BATCH, drop_last=True, device=args.device, eval_every=10**6, runner=runner),
                SGD(lr=LR)))
            st = sim.init_state()
            return _median_round(lambda sim=sim, st=st: sim.round(st), args.rounds, device)

        for alg_name, alg in algs.items():
            res[f"fedmtl_{alg_name}_round_s_{name}"] = engine_round(alg)
            print(f"{name} fedmtl {alg_name}: {res[f'fedmtl_{alg_name}_round_s_{name}']:.3f} s/round", flush=True)
        for runner in ("stacked", "vmap", "loop") if args.runners == "all" else ():
            if runner != default:  # FedAvg on the paths the engine did not choose, for the record
                res[f"fedmtl_fedavg_round_s_{name}_{runner}"] = engine_round(algs["fedavg"], runner)
                print(f"{name} fedmtl fedavg ({runner}): {res[f'fedmtl_fedavg_round_s_{name}_{runner}']:.3f} s/round",
                      flush=True)
        loop = PeerLoop(data, module, device)
        loops = [("per_client", loop.fedavg_round), ("lean", loop.lean_round),
                 ("per_client_ditto", loop.ditto_round), ("per_client_fedem", loop.fedem_round)]
        if name == "cnn":
            loops.insert(2, ("lean_channels_last", loop.lean_channels_last_round))
        for key, fn in loops:
            res[f"{key}_round_s_{name}"] = _median_round(fn, args.rounds, device)
            print(f"{name} {key}: {res[f'{key}_round_s_{name}']:.3f} s/round", flush=True)
        for layout, cl in (("_default", False), ("_channels_last", True)):
            if cl and name != "cnn":
                continue
            res[f"centralized_epoch_s_{name}{layout}"] = _median_round(
                centralized_epoch(data, module, device, channels_last=cl), args.rounds, device)
        # the floor: the faster layout (the same FLOPs with the best kernel shapes)
        layouts = [v for k, v in res.items() if k.startswith(f"centralized_epoch_s_{name}")]
        res[f"centralized_epoch_s_{name}"] = min(layouts)
        fed = res[f"fedmtl_fedavg_round_s_{name}"]
        res[f"speedup_vs_per_client_{name}"] = res[f"per_client_round_s_{name}"] / fed
        res[f"speedup_vs_lean_loop_{name}"] = res[f"lean_round_s_{name}"] / fed
        res[f"round_vs_centralized_{name}"] = fed / res[f"centralized_epoch_s_{name}"]
        res[f"speedup_vs_per_client_ditto_{name}"] = res[f"per_client_ditto_round_s_{name}"] / res[
            f"fedmtl_ditto_round_s_{name}"]
        res[f"speedup_vs_per_client_fedem_{name}"] = res[f"per_client_fedem_round_s_{name}"] / res[
            f"fedmtl_fedem_round_s_{name}"]
    return res


def main(args: argparse.Namespace) -> int:
    res = run(args)
    write_json(out_path(args.out), res)
    for k, v in res.items():
        if k != "client_train_examples":
            print(f"{k:36s} {v:.4f}" if isinstance(v, float) else f"{k:36s} {v}")
    return 0


__all__ = ["PeerLoop", "add_arguments", "centralized_epoch", "cnn_module", "main", "mlp_module", "peers_data", "run"]
