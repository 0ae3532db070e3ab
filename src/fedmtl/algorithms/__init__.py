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
from .fedala import FedALA
from .fedamp import FedAMP
from .fedas import FedAS
from .fedavg import FedAvg, FedAvgFT, FedProx
from .fedbabu import FedBABU
from .fedbn import FedBN
from .fedcac import FedCAC
from .fedcp import FedCP
from .feddbe import FedDBE
from .feddyn import FedDyn
from .fedem import FedEM
from .fedfomo import FedFomo
from .fedgen import FedGen
from .fedlc import FedLC
from .fednova import FedNova
from .fedpac import FedPAC
from .fedper import FedPer
from .fedproto import FedProto
from .fedrep import FedRep
from .fedrod import FedRoD
from .fedsa_lora import FedSALoRA
from .fenda_fl import FendaFL
from .ffa_lora import FFALoRA
from .floco import Floco
from .gpfl import GPFL
from .ifca import IFCA
from .knnper import KNNPer
from .lgfedavg import LGFedAvg
from .local import Local
from .mocha import Mocha
from .moon import Moon
from .mrmtl import MRMTL
from .omnifedge import OmniFedge
from .perfedavg import PerFedAvg
from .pfedfda import PFedFDA
from .pfedhn import PFedHN
from .pfedme import PFedMe
from .qffl import QFFL
from .scaffold import Scaffold

for _cls in (Local, FedAvg, FedProx, FedAvgFT, FedEM, DFedEM, DSGD, PerFedAvg, PFedMe, ClusteredFL, Ditto, APFL,
             OmniFedge, Mocha, FedPer, FedRep, LGFedAvg, FedBABU, Scaffold, FedDyn, IFCA, KNNPer, Moon, FedRoD, FedALA,
             PFedHN, FedBN, FedNova, QFFL, FedLC, FedAMP, FedProto, FedFomo, GPFL, FedPAC, FedCP, FFALoRA, FedSALoRA,
             MRMTL, FendaFL, FedDBE, FedCAC, FedAS, PFedFDA, Floco, FedGen):
    register_algorithm(_cls, replace=True)


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = [
    "ALGORITHMS", "APFL", "Algorithm", "ClusteredFL", "Context", "DFedEM", "DSGD", "Ditto", "FFALoRA", "FedALA",
    "FedAMP", "FedAvg", "FedAvgFT", "FedBABU", "FedBN", "FedCP", "FedDyn", "FedEM", "FedFomo", "FedLC", "FedNova",
    "FedPAC", "FedPer", "FedProto", "FedProx", "FedRep", "FedRoD", "FedSALoRA", "GPFL", "IFCA", "KNNPer", "LGFedAvg",
    "Local", "Mocha", "Moon", "OmniFedge", "PFedHN", "PFedMe", "PerFedAvg", "QFFL", "Scaffold", "get_algorithm",
    "MRMTL", "FendaFL", "FedDBE", "FedCAC", "FedAS", "PFedFDA", "Floco", "FedGen",
]
