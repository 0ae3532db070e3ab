"""Federated datasets: the flat per-split storage, partitioners and dataset builders."""

from __future__ import annotations

from collections.abc import Callable

from .federated import ClientGroup, DataError, FederatedData, Split
from .synthetic import fedem_synthetic

DATASETS: dict[str, Callable[..., FederatedData]] = {"fedem_synthetic": fedem_synthetic}

__all__ = ["DATASETS", "ClientGroup", "DataError", "FederatedData", "Split", "fedem_synthetic"]
