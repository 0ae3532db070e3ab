"""Communication graphs and doubly-stochastic mixing matrices for decentralized methods.

Graphs are symmetric 0/1 adjacency matrices without self-loops.  Mixing matrices W (N, N) are
symmetric and doubly stochastic, supported on the graph plus the diagonal:

* ``metropolis`` (Metropolis-Hastings, the default): W_ij = 1 / (1 + max(d_i, d_j)) on edges,
  W_ii = 1 - sum_j W_ij.  On a complete graph this is uniform averaging, W = 11^T / N.
* ``max_degree``: W_ij = 1 / (1 + d_max) on edges, W_ii = 1 - d_i / (1 + d_max).

(The FedEM reference code instead solves the fastest-mixing SDP with cvxpy for an Erdos-Renyi(0.5)
graph; Metropolis weights need no solver and are the standard choice in the D-SGD literature.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def complete(n: int) -> np.ndarray:
    return np.ones((n, n), dtype=np.int64) - np.eye(n, dtype=np.int64)


def ring(n: int) -> np.ndarray:
    a = np.zeros((n, n), dtype=np.int64)
    if n < 2:
        return a
    i = np.arange(n)
    a[i, (i + 1) % n] = 1
    a[(i + 1) % n, i] = 1
    np.fill_diagonal(a, 0)
    return a


def is_connected(adj: np.ndarray) -> bool:
    n = adj.shape[0]
    seen = np.zeros(n, dtype=bool)
    stack = [0]
    seen[0] = True
    while stack:
        i = stack.pop()
        for j in np.flatnonzero(adj[i]):
            if not seen[j]:
                seen[j] = True
                stack.append(int(j))
    return bool(seen.all())


def erdos_renyi(n: int, p: float, rng: np.random.Generator, max_tries: int = 1000) -> np.ndarray:
    """G(n, p), redrawn until connected (the reference experiments use p = 0.5)."""
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    for _ in range(max_tries):
        upper = np.triu(rng.random((n, n)) < p, k=1)
        a = (upper | upper.T).astype(np.int64)
        if n == 1 or is_connected(a):
            return a
    raise ValueError(f"no connected G({n}, {p}) in {max_tries} draws; raise p")


def load_adjacency(path: str | Path, n: int) -> np.ndarray:
    """A user-given adjacency: ``.npy`` or whitespace-separated text, N x N, symmetric, 0/1 or weights > 0."""
    path = Path(path)
    a = np.load(path) if path.suffix == ".npy" else np.loadtxt(path)
    a = np.asarray(a)
    if a.shape != (n, n):
        raise ValueError(f"{path}: adjacency must be {n} x {n}, got {a.shape}")
    if not np.allclose(a, a.T):
        raise ValueError(f"{path}: adjacency must be symmetric")
    a = (a != 0).astype(np.int64)
    np.fill_diagonal(a, 0)
    if not is_connected(a):
        raise ValueError(f"{path}: the graph is not connected")
    return a


def build_graph(kind: str, n: int, p: float = 0.5, seed: int = 0, path: str = "") -> np.ndarray:
    if kind == "complete":
        return complete(n)
    if kind == "ring":
        return ring(n)
    if kind == "erdos_renyi":
        return erdos_renyi(n, p, np.random.default_rng(seed))
    if kind == "file":
        return load_adjacency(path, n)
    raise ValueError(f"unknown topology {kind!r}; use complete, ring, erdos_renyi or file")


def mixing_matrix(adj: np.ndarray, rule: str = "metropolis") -> Tensor:
    """Symmetric doubly-stochastic W (N, N) on ``adj`` plus self-loops (float64)."""
    a = (np.asarray(adj) != 0).astype(np.float64)
    np.fill_diagonal(a, 0.0)
    deg = a.sum(1)
    if rule == "metropolis":
        w = a / (1.0 + np.maximum(deg[:, None], deg[None, :]))
    elif rule == "max_degree":
        w = a / (1.0 + deg.max())
    else:
        raise ValueError(f"unknown mixing rule {rule!r}; use metropolis or max_degree")
    np.fill_diagonal(w, 1.0 - w.sum(1))
    return torch.from_numpy(w)


def mix(w: Tensor, stacked: Tensor) -> Tensor:
    """Gossip step: row i of the result is sum_j W_ij stacked[j] (stacked has a leading N axis)."""
    flat = stacked.reshape(stacked.shape[0], -1)
    return (w.to(flat.dtype) @ flat).reshape(stacked.shape)
