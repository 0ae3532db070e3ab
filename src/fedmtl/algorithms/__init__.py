"""Algorithm registry: ``ALGORITHMS[name]`` is the dataclass; its fields are the hyper-parameters."""

from __future__ import annotations

from .apfl import APFL
from .base import Algorithm, Context
from .clustered import ClusteredFL
from .decentralized import DSGD, DFedEM
from .ditto import Ditto
from .fedavg import FedAvg, FedAvgFT, FedProx
from .fedem import FedEM
from .local import Local
from .omnifedge import OmniFedge
from .perfedavg import PerFedAvg
from .pfedme import PFedMe

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        Local, FedAvg, FedProx, FedAvgFT, FedEM, DFedEM, DSGD, PerFedAvg, PFedMe, ClusteredFL, Ditto, APFL, OmniFedge
    )
}


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = [
    "APFL", "ClusteredFL", "Ditto", "OmniFedge", "PFedMe", "PerFedAvg",
    "ALGORITHMS", "DSGD", "Algorithm", "Context", "DFedEM", "FedAvg", "FedAvgFT", "FedEM", "FedProx", "Local",
    "get_algorithm",
]
