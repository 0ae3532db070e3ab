"""The built-in algorithms, registered under their config names (``[algorithm] name``).

Each is one module with its paper cited; ``fedmtl.register_algorithm`` adds more.
"""

from __future__ import annotations

from ..registry import ALGORITHMS, register_algorithm
from .apfl import APFL
from .base import Algorithm, Context
from .clustered import ClusteredFL
from .decentralized import DSGD, DFedEM
from .ditto import Ditto
from .fedavg import FedAvg, FedAvgFT, FedProx
from .fedem import FedEM
from .local import Local
from .mocha import Mocha
from .omnifedge import OmniFedge
from .perfedavg import PerFedAvg
from .pfedme import PFedMe

for _cls in (Local, FedAvg, FedProx, FedAvgFT, FedEM, DFedEM, DSGD, PerFedAvg, PFedMe, ClusteredFL, Ditto, APFL,
             OmniFedge, Mocha):
    register_algorithm(_cls, replace=True)


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = [
    "ALGORITHMS", "APFL", "DSGD", "Algorithm", "ClusteredFL", "Context", "DFedEM", "Ditto", "FedAvg", "FedAvgFT",
    "FedEM", "FedProx", "Local", "Mocha", "OmniFedge", "PFedMe", "PerFedAvg", "get_algorithm",
]
