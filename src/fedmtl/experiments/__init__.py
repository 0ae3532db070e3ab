"""Paper reproductions: ``fedmtl reproduce NAME [--quick] --out DIR`` and ``fedmtl main`` (``make run``).

One module per reproduction; the method tables (methods and their config settings, paper numbers, seeds) are TOML
files beside the modules, shipped as package data.  The registry maps a reproduction's name to ``module:function``;
the module is imported only when that reproduction runs (``reproduction(name)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: name -> ``module:function`` of this package; the function takes ``(out: Path, quick: bool = False)``
REPRODUCTIONS: dict[str, str] = {
    "robustness": "robustness:run",
    "adapters": "adapters:run",
    "async": "async_clock:run",
    "mocha": "mocha_skewed:everything",
    "mocha-skewed": "mocha_skewed:run",
    "networked": "networked:run",
    "networked-flow": "networked:flow",
    "fedem-synthetic": "fedem:fedem_synthetic",
    "fedem-vs-ifca": "fedem_ifca:run",
    "personalization": "personalization:personalization",
    "personalization-comparison": "personalization:comparison",
    "perfedavg": "perfedavg:run",
    "peer-fedper": "peer_fedper:run",
    "omnifedge-fmnist": "omnifedge:omnifedge_fmnist",
    "fmnist": "fedem:fmnist",
    "fmnist-cnn": "personalization:fmnist_cnn",
    "tuned": "tuned:run",
}


#: what each reproduction runs (``fedmtl reproduce --help``); the results pages give their measured durations
SUMMARIES: dict[str, str] = {
    "adapters": "a pretrained character transformer personalized per Shakespeare role with LoRA adapters (6 methods)",
    "async": "synchronous rounds vs FedBuff and FedAsync on the simulated clock (FedAvg, synthetic, 3 seeds)",
    "fedem-synthetic": "FedEM's synthetic Table 1 row and Figure 1 (accuracy vs M, vs sampling rate)",
    "fedem-vs-ifca": "why IFCA scores above FedEM on FedEM's synthetic data: mixture weights, prediction rules",
    "fmnist": "Local / FedAvg / FedAvg+ / FedEM on Fashion-MNIST (FedEM's label-group split)",
    "fmnist-cnn": "the body/head methods and FedBN on Fashion-MNIST with a CNN, one seed",
    "mocha": "MOCHA's Table 1, Figures 1-3 and Tables 3-4 (all of mocha-skewed)",
    "mocha-skewed": "MOCHA's Tables 3-4: skewed federations, stragglers, drops, shared tasks",
    "networked": "networked FL by GTV minimization: error vs lambda and connectivity, clustering, robustness",
    "networked-flow": "networked FL: the error against the labelled nodes, over 5 graphs",
    "omnifedge-fmnist": "Omni-Fedge vs FedSGD and FedAvg on 5 Fashion-MNIST nodes",
    "peer-fedper": "FedPer / FedRep against a peer library's protocol (reporting and model differences)",
    "perfedavg": "Per-FedAvg (FO, HF) against FedAvg with local adaptation, an offline analogue of its paper's",
    "personalization": "every method on label-permuted groups, then personalization-comparison",
    "personalization-comparison": "every personalized method on Fashion-MNIST Dirichlet(0.1) and the synthetic mixture",
    "tuned": "every registered method tuned (lr and its main hyperparameter), then rerun with 5 seeds",
    "robustness": "every robust aggregator against every attack, and a privacy-utility curve",
}


def summaries() -> dict[str, str]:
    """name -> what it runs, for every reproduction."""
    return {name: SUMMARIES.get(name, "") for name in sorted(REPRODUCTIONS)}


def reproduction(name: str) -> Callable[..., Any]:
    """The function that runs reproduction ``name`` (a key of ``REPRODUCTIONS``)."""
    module, _, function = REPRODUCTIONS[name].partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(f"{__name__}.{module}"), function)
    return fn


__all__ = ["REPRODUCTIONS", "SUMMARIES", "reproduction", "summaries"]
