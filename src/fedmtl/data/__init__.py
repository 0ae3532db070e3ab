"""Federated datasets: the flat per-split storage, partitioners and the built-in dataset builders.

Every builder is registered under its config name (``[data] name``); ``fedmtl.register_dataset`` adds more.
"""

from __future__ import annotations

import functools

from ..registry import DATASETS, register_dataset
from .federated import ClientGroup, DataError, FederatedData, Split
from .npz import npz_folder
from .synthetic import fedem_synthetic, linear_mixture, permuted_groups, related_tasks
from .tabular import gleam, har, vehicle
from .text import shakespeare
from .vision import cifar, digits, emnist, fashion_mnist, femnist, fmnist_pairs, idx_federation, mnist

for _name, _fn in {
    "fedem_synthetic": fedem_synthetic,
    "linear_mixture": linear_mixture,
    "permuted_groups": permuted_groups,
    "related_tasks": related_tasks,
    "fashion_mnist": functools.partial(idx_federation, name="fashion_mnist"),
    "mnist": functools.partial(idx_federation, name="mnist"),
    "digits": digits,
    "fmnist_pairs": fmnist_pairs,
    "emnist": emnist,
    "femnist": femnist,
    "cifar": functools.partial(cifar, name="cifar10"),  # the name CIFAR-10 had first
    "cifar10": functools.partial(cifar, name="cifar10"),
    "cifar100": functools.partial(cifar, name="cifar100"),
    "shakespeare": shakespeare,
    "har": har,
    "vehicle": vehicle,
    "gleam": gleam,
    "npz_folder": npz_folder,
}.items():
    register_dataset(_name, replace=True)(_fn)

__all__ = [
    "DATASETS", "ClientGroup", "DataError", "FederatedData", "Split", "cifar", "digits", "emnist", "fashion_mnist",
    "fedem_synthetic", "femnist", "fmnist_pairs", "gleam", "har", "linear_mixture", "mnist", "npz_folder",
    "permuted_groups", "related_tasks", "shakespeare", "vehicle",
]
