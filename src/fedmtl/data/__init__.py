"""Federated datasets: the flat per-split storage, partitioners and dataset builders."""

from __future__ import annotations

import functools
from collections.abc import Callable

from .federated import ClientGroup, DataError, FederatedData, Split
from .synthetic import fedem_synthetic, permuted_groups
from .tabular import gleam, har, vehicle
from .text import shakespeare
from .vision import cifar, emnist, fashion_mnist, femnist, idx_federation, mnist

DATASETS: dict[str, Callable[..., FederatedData]] = {
    "fedem_synthetic": fedem_synthetic,
    "permuted_groups": permuted_groups,
    "fashion_mnist": functools.partial(idx_federation, name="fashion_mnist"),
    "mnist": functools.partial(idx_federation, name="mnist"),
    "emnist": emnist,
    "femnist": femnist,
    "cifar": cifar,
    "shakespeare": shakespeare,
    "har": har,
    "vehicle": vehicle,
    "gleam": gleam,
}

__all__ = [
    "DATASETS", "ClientGroup", "DataError", "FederatedData", "Split", "cifar", "emnist", "fashion_mnist",
    "fedem_synthetic", "femnist", "gleam", "har", "mnist", "shakespeare", "vehicle",
]
