"""``fedmtl bench fedem``: the measurement of ``fedmtl bench engine`` for FedEM (M = 3), whose baseline keeps M
modules and optimizers per client and runs the E-step over a non-shuffled loader, as the reference implementation
does; plus Per-FedAvg (FO and HF) against FedAvg.  Figures are measured and written to JSON, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from fedmtl.algorithms import FedAvg, PerFedAvg
from fedmtl.data.federated import FederatedData
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.runs.driver import make_engine

from .common import time_rounds
from .engine import OPT, add_arguments, measure


def perfedavg_ratios(data: FederatedData, model: Any, rounds: int, device: str = "cpu") -> dict[str, Any]:
    """Per-FedAvg (FO and HF, the synthetic config's alpha = beta = 0.01, tau = 10 meta-steps) against FedAvg, round
    times on the default (vmap) runner measured in the same run, and the ratio of examples each processes per round
    (FedAvg: one epoch; Per-FedAvg: tau meta-steps x 2 batches (FO) or x 3 batches, D'' twice (HF))."""
    out: dict[str, Any] = {}
    for name, alg in (("fedavg", FedAvg()), ("perfedavg_fo", PerFedAvg(alpha=0.01, beta=0.01, variant="fo")),
                      ("perfedavg_hf", PerFedAvg(alpha=0.01, beta=0.01, variant="hf"))):
        sim = make_engine(alg, model, data, RunSpec(RunConfig(rounds=200, runner="vmap", device=device), OPT))
        st = sim.init_state()
        out[f"{name}_round_s"] = statistics.median(time_rounds(lambda sim=sim, st=st: sim.round(st), rounds))
    n = data.seen.train.counts.double()
    batch = n.clamp_max(128)
    for v, grads in (("fo", 2), ("hf", 4)):
        out[f"perfedavg_{v}_vs_fedavg"] = out[f"perfedavg_{v}_round_s"] / out["fedavg_round_s"]
        out[f"perfedavg_{v}_examples_vs_fedavg"] = float(10 * grads * batch.sum() / n.sum())
    return out


def main(args: argparse.Namespace) -> int:
    return measure(args, "fedem", perfedavg_ratios)


__all__ = ["add_arguments", "main", "perfedavg_ratios"]
