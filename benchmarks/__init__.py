"""Speed benchmarks: ``fedmtl bench NAME --out FILE.json [flags]`` (from a checkout of the repository).

One module per benchmark, each with its own flags (``add_arguments(parser)``) and ``main(args) -> int``; the
measured JSON files are kept in ``benchmarks/results/``.  Figures are measured and written, never asserted in tests.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

#: name -> one line on what it measures; the module ``benchmarks.NAME`` runs it
BENCHMARKS: dict[str, str] = {
    "engine": "FedAvg round time: vmap vs loop vs one model per client (FedEM synthetic data)",
    "fedem": "the same for FedEM (M = 3), and Per-FedAvg FO / HF vs FedAvg",
    "models": "FMNIST MLP (FedAvg, FedEM), FMNIST CNN, Shakespeare LSTM vs FLOP floors",
    "seeds": "`fedmtl run --seeds 1-5` vs one seed, synthetic FedEM config, whole commands",
    "peers": "a peer library's workload (FMNIST, 20 Dirichlet clients, user modules) vs per-client loops",
    "scale": "round time and memory from 10^3 to 10^6 clients (FedAvg, FedEM, Ditto)",
    "flower": "FedAvg round: vmap vs Flower simulation vs 2-node deployment",
    "secagg": "FedAvg round over Flower with vs without secure aggregation (SecAgg+): seconds and bytes per round",
    "networked": "GTV solver vs CVXPY on SBM graphs of 1e3 / 1e4 / 1e5 nodes",
    "distributed": "one simulation on 1 and 2 torchrun ranks: the models CNN and a 10^5-client Ditto population",
    "tune": "`fedmtl tune --batch-trials 4` vs trials one after the other: a study over optim.lr (or with FedProx's "
            "mu), whole seconds",
    "adapters": "LoRA adapters: upload and state per client vs the full model; 100 clients' adapters vectorized vs a "
                "per-client loop and the central floor",
    "batchnorm": "cnn_bn round (FedAvg, FedBN): the stacked executor (per-client batch statistics) vs vmap vs loop",
    "pfl": "side by side with pfl-research (pfl, PyTorch backend) on its CIFAR-10 benchmark's workload: FedAvg, 1,000 "
           "clients of 50, cohort 50, its CNN",
}
#: benchmarks whose module is not ``benchmarks.NAME`` (``pfl``: the module would shadow the package it times)
MODULES: dict[str, str] = {"pfl": "pfl_peer"}


def load(name: str) -> ModuleType:
    """The module of benchmark ``name`` (a key of ``BENCHMARKS``): ``benchmarks.NAME`` or as ``MODULES`` says."""
    if name not in BENCHMARKS:
        raise KeyError(f"no benchmark {name!r}: one of {sorted(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{MODULES.get(name, name)}")


def run(name: str, args: argparse.Namespace) -> int:
    """Run benchmark ``name`` with its parsed flags; a ``--device`` this machine cannot use is refused first
    (exit status 2, nothing written)."""
    module = load(name)
    if getattr(args, "device", None) is not None:
        from .common import check_device

        if not check_device(args):
            return 2
    status: int = module.main(args)
    return status


__all__ = ["BENCHMARKS", "MODULES", "load", "run"]
