"""``fedmtl bench engine``: FedAvg on the FedEM synthetic data (300 clients, full participation, one local epoch,
batch 128) — seconds per round for the vmap runner, the loop runner, and a baseline written the way peer libraries
work (one ``nn.Module`` + ``torch.optim.SGD`` + ``DataLoader`` per client, clients stepped one after another), plus
the time to evaluate all 1.5 M test examples.  Figures are measured and written to JSON, never asserted in tests.
``fedmtl bench fedem`` (``benchmarks/fedem.py``) runs the same measurement for FedEM.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedmtl.algorithms import FedAvg, FedEM
from fedmtl.data.federated import FederatedData
from fedmtl.data.synthetic import fedem_synthetic
from fedmtl.engine.executors import make_executor
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.models import build_model
from fedmtl.models.base import Model
from fedmtl.optim import SGD
from fedmtl.runs.driver import make_engine
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, device_name, out_path, peak_rss_mb, time_rounds

OPT = SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p)
    add_threads(p)
    add_device(p)


class PerClientBaseline:
    """One module + optimizer + DataLoader per client (and per component for FedEM), stepped serially."""

    def __init__(self, data: FederatedData, components: int, batch_size: int = 128, seed: int = 0,
                 device: str = "cpu"):
        train = data.seen.train
        self.m = components
        self.clients = []
        dev = torch.device(device)
        for k in range(train.num_clients):
            x, y = train.client(k)
            x, y = x.to(dev, torch.float32), y.to(dev)
            ds = TensorDataset(x, y.float(), torch.arange(len(y), device=dev))
            models = []
            for j in range(components):
                torch.manual_seed(seed + j)
                models.append(nn.Linear(x.shape[1], 1).to(dev))
            opts = [torch.optim.SGD(mm.parameters(), lr=OPT.lr, momentum=OPT.momentum,
                                    weight_decay=OPT.weight_decay) for mm in models]
            loader = DataLoader(ds, batch_size=batch_size, shuffle=True)
            full = DataLoader(ds, batch_size=batch_size, shuffle=False)
            pi = torch.full((components,), 1 / components, device=dev)
            self.clients.append([models, opts, loader, full, len(ds), pi])
        self.global_models = [nn.Linear(train.x.shape[1], 1).to(dev) for _ in range(components)]
        self.total = float(train.counts.sum())
        self.bce = nn.BCEWithLogitsLoss(reduction="none")

    def round(self) -> None:
        for j in range(self.m):
            g = self.global_models[j].state_dict()
            for c in self.clients:
                c[0][j].load_state_dict(g)
        for c in self.clients:
            models, opts, loader, full, n, pi = c
            if self.m > 1:  # E-step over the whole local set, one component after the other
                with torch.no_grad():
                    losses = torch.stack([torch.cat([self.bce(mm(xb).squeeze(-1), yb) for xb, yb, _ in full])
                                          for mm in models])
                q = torch.softmax(torch.log(pi).unsqueeze(1) - losses, dim=0)
                c[5] = q.mean(1)
            for j, (mm, opt) in enumerate(zip(models, opts, strict=True)):
                for xb, yb, ib in loader:
                    opt.zero_grad()
                    loss = self.bce(mm(xb).squeeze(-1), yb)
                    if self.m > 1:  # q-weighted loss of the M-step, looked up by sample index
                        loss = loss * q[j, ib]
                    loss.mean().backward()
                    opt.step()
        with torch.no_grad():
            for j in range(self.m):
                avg = {k: sum(c[0][j].state_dict()[k] * (c[4] / self.total) for c in self.clients)
                       for k in self.global_models[j].state_dict()}
                self.global_models[j].load_state_dict(avg)


def measure(args: argparse.Namespace, which: str,
            extra: Callable[[FederatedData, Model, int, str], dict[str, Any]] | None = None) -> int:
    """``which`` = "engine" (FedAvg) or "fedem" (M = 3): the runners' round times, the evaluation time and the
    per-client baseline's round time; ``extra(data, model, rounds, device)`` adds its keys after the runners'."""
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = fedem_synthetic(legacy=True)
    gen_s = time.perf_counter() - t0
    model = build_model("linear", 150, 2)
    alg = FedAvg() if which == "engine" else FedEM(num_components=3)
    rounds = args.rounds
    res: dict[str, Any] = {
        "benchmark": which, "algorithm": alg.name, "clients": data.num_clients, "batch_size": 128,
        "local_epochs": 1, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "rounds_timed": rounds,
        "data_generation_s": gen_s, "device": device_name(args.device),
    }
    runners = ("stacked", "vmap", "loop") if alg.clients_form() else ("vmap", "loop")
    for runner in runners:
        sim = make_engine(alg, model, data, RunSpec(RunConfig(rounds=200, runner=runner, device=args.device), OPT))
        st = sim.init_state()
        ts = time_rounds(lambda sim=sim, st=st: sim.round(st), rounds)
        res[f"{runner}_round_s"] = statistics.median(ts)
        res[f"{runner}_round_s_min"] = min(ts)
        if runner == "vmap":
            ev = time_rounds(lambda sim=sim, st=st: sim.evaluate(st), 3)
            res["eval_all_clients_s"] = statistics.median(ev)
            res["eval_examples"] = int(data.seen.test.counts.sum() + data.seen.train.counts.sum())
    if extra is not None:
        res.update(extra(data, model, rounds, args.device))
    base = PerClientBaseline(data, components=1 if which == "engine" else 3, device=args.device)
    ts = time_rounds(base.round, max(2, rounds // 3))
    res["per_client_round_s"] = statistics.median(ts)
    res["speedup_vmap_vs_per_client"] = res["per_client_round_s"] / res["vmap_round_s"]
    res["speedup_vmap_vs_loop"] = res["loop_round_s"] / res["vmap_round_s"]
    res["default_runner"] = make_executor("auto", model, torch.device(args.device)).for_algorithm(alg).name
    res["speedup_default_vs_per_client"] = res["per_client_round_s"] / res[f"{res['default_runner']}_round_s"]
    res["peak_rss_mb"] = peak_rss_mb()
    write_json(out_path(args.out), res)
    for k, v in res.items():
        print(f"{k:32s} {v:.4f}" if isinstance(v, float) else f"{k:32s} {v}")
    return 0


def main(args: argparse.Namespace) -> int:
    return measure(args, "engine")


__all__ = ["OPT", "PerClientBaseline", "add_arguments", "main", "measure"]
