"""One sparse graph type for every method that lives on a graph: the empirical graph of networked federated
learning (the GTV solver, ``fedmtl.networked``) and the communication graph of decentralized methods
(D-FedEM, D-SGD gossip).

A ``Graph`` is undirected, stored as an oriented edge list ``edges`` (E, 2) with ``edges[e] = (e+, e-)``,
e+ < e-, and positive weights A_e; memory and every operation are O(N + E).  Its signed incidence matrix D
(E x N) has D[e, e+] = 1 and D[e, e-] = -1 (SarcheshmehPour, Leinonen, Jung, "Federated Learning from Big
Data over Networks", ICASSP 2021).  Builders: adjacency matrices (dense or scipy.sparse), edge lists,
networkx graphs, files, stochastic block models, chains with a boundary edge, k-nearest-neighbour graphs,
complete graphs, rings and Erdos-Renyi graphs.

Gossip uses a symmetric doubly-stochastic mixing matrix W supported on the edges plus the diagonal
(``Graph.mixing``), kept sparse as ``Mixing`` (edge weights + self weights):

* ``metropolis`` (Metropolis-Hastings, the default): W_ij = 1 / (1 + max(d_i, d_j)) on edges,
  W_ii = 1 - sum_j W_ij.  On a complete graph this is uniform averaging, W = 11^T / N.
* ``max_degree``: W_ij = 1 / (1 + d_max) on edges, W_ii = 1 - d_i / (1 + d_max).

(The FedEM reference code instead solves the fastest-mixing SDP with cvxpy for an Erdos-Renyi(0.5) graph;
Metropolis weights need no solver and are the standard choice in the D-SGD literature.)  Mixing weights
ignore the edge weights A_e: they depend on the unweighted degrees.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .files import read_bytes

if TYPE_CHECKING:
    import scipy.sparse as sp  # imported where used: scipy is a fifth of a second of every fedmtl start


class GraphError(ValueError):
    """Malformed graph input."""


class Mixing(NamedTuple):
    """A sparse symmetric mixing matrix: ``W_ij = weight[e]`` for edge e = (i, j) (both directions) and
    ``W_ii = self_weight[i]``.  Tensors, so they live in a server state and in checkpoints."""

    edges: Tensor  # (E, 2) long
    weight: Tensor  # (E,) float
    self_weight: Tensor  # (N,) float

    def mix(self, stacked: Tensor) -> Tensor:
        """Gossip step on a (N, ...) tensor: row i of the result is sum_j W_ij stacked[j].  O(N + E) time; the
        neighbours' rows are gathered N edges at a time, so the step holds at most two more tensors of the input's
        size (gathering all E edges at once held 2E rows: 16 GB for D-FedEM with 10 components of a 160k-parameter
        MLP on an Erdos-Renyi(0.5) graph of 50 clients).  The sums are taken in the same order as in one pass."""
        flat = stacked.reshape(stacked.shape[0], -1)
        w = self.weight.to(flat.dtype).unsqueeze(1)
        i, j = self.edges[:, 0], self.edges[:, 1]
        out = self.self_weight.to(flat.dtype).unsqueeze(1) * flat
        step = max(1, flat.shape[0])
        for dst, src in ((i, j), (j, i)):
            for s in range(0, dst.shape[0], step):
                out.index_add_(0, dst[s:s + step], w[s:s + step] * flat.index_select(0, src[s:s + step]))
        return out.reshape(stacked.shape)

    def dense(self) -> Tensor:
        """W as a dense (N, N) float64 matrix (tests, small graphs)."""
        out = torch.diag(self.self_weight.to(torch.float64))
        i, j = self.edges[:, 0], self.edges[:, 1]
        out[i, j] = self.weight.to(torch.float64)
        out[j, i] = self.weight.to(torch.float64)
        return out


@dataclass
class Graph:
    num_nodes: int
    edges: np.ndarray  # (E, 2) int64, edges[:, 0] < edges[:, 1]
    weights: np.ndarray  # (E,) float64 > 0
    clusters: np.ndarray | None = None  # (N,) ground-truth block of each node, when generated

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        w = np.asarray(self.weights, dtype=np.float64).reshape(-1)
        if len(e) != len(w):
            raise GraphError(f"{len(e)} edges but {len(w)} weights")
        if len(e) and (e.min() < 0 or e.max() >= self.num_nodes):
            raise GraphError(f"edge endpoints must be node ids in [0, {self.num_nodes})")
        if (e[:, 0] == e[:, 1]).any():
            raise GraphError("self-loops are not allowed (phi(w_i - w_i) = 0 carries no information)")
        if not np.isfinite(w).all() or (w <= 0).any():
            raise GraphError("edge weights must be finite and > 0")
        lo, hi = np.minimum(e[:, 0], e[:, 1]), np.maximum(e[:, 0], e[:, 1])
        key = lo * self.num_nodes + hi
        if len(np.unique(key)) != len(key):
            raise GraphError("duplicate edges; merge them (add their weights) before building the graph")
        order = np.argsort(key, kind="stable")
        self.edges = np.stack([lo, hi], 1)[order]
        self.weights = w[order]

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def incidence(self) -> sp.csr_matrix:
        """Signed incidence matrix D (E x N)."""
        import scipy.sparse as sp

        e = self.num_edges
        rows = np.repeat(np.arange(e), 2)
        cols = self.edges.reshape(-1)
        vals = np.tile([1.0, -1.0], e)
        return sp.csr_matrix((vals, (rows, cols)), shape=(e, self.num_nodes))

    def degree(self) -> np.ndarray:
        """Unweighted degree |N_i|."""
        return np.bincount(self.edges.reshape(-1), minlength=self.num_nodes).astype(np.float64)

    def adjacency(self) -> sp.csr_matrix:
        import scipy.sparse as sp

        a = sp.coo_matrix((self.weights, (self.edges[:, 0], self.edges[:, 1])), shape=(self.num_nodes,) * 2)
        return (a + a.T).tocsr()

    def is_connected(self) -> bool:
        from scipy.sparse.csgraph import connected_components

        n, _ = connected_components(self.adjacency(), directed=False)
        return n == 1

    def mixing(self, rule: Literal["metropolis", "max_degree"] = "metropolis") -> Mixing:
        """The symmetric doubly-stochastic mixing matrix of this graph (float64; see the module docstring)."""
        deg = self.degree()
        i, j = self.edges[:, 0], self.edges[:, 1]
        if rule == "metropolis":
            w = 1.0 / (1.0 + np.maximum(deg[i], deg[j]))
        elif rule == "max_degree":
            w = np.full(self.num_edges, 1.0 / (1.0 + deg.max(initial=0.0)))
        else:
            raise GraphError(f"unknown mixing rule {rule!r}; use metropolis or max_degree")
        off = np.bincount(i, w, self.num_nodes) + np.bincount(j, w, self.num_nodes)
        return Mixing(torch.from_numpy(self.edges.copy()), torch.from_numpy(w), torch.from_numpy(1.0 - off))

    # ------------------------------------------------------------------------------------- builders
    @classmethod
    def from_adjacency(cls, a: Any) -> Graph:
        """Symmetric weighted adjacency (dense array or scipy.sparse); the diagonal must be zero."""
        import scipy.sparse as sp

        m = sp.coo_matrix(a)
        if m.shape[0] != m.shape[1]:
            raise GraphError(f"adjacency must be square, got {m.shape}")
        if abs(m - m.T).max() > 1e-12 * max(1.0, abs(m).max()) if m.nnz else False:
            raise GraphError("adjacency must be symmetric")
        keep = m.row < m.col
        if (m.row == m.col).any() and np.any(m.data[m.row == m.col] != 0):
            raise GraphError("adjacency has non-zero diagonal entries (self-loops)")
        keep &= m.data != 0
        return cls(m.shape[0], np.stack([m.row[keep], m.col[keep]], 1), m.data[keep])

    @classmethod
    def from_edges(cls, num_nodes: int, edges: Any, weights: Any = None) -> Graph:
        e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
        w = np.ones(len(e)) if weights is None else np.asarray(weights, dtype=np.float64)
        return cls(num_nodes, e, w)

    @classmethod
    def from_networkx(cls, g: Any, weight: str = "weight") -> Graph:
        nodes = list(g.nodes())
        index = {v: i for i, v in enumerate(nodes)}
        e = [(index[a], index[b]) for a, b in g.edges()]
        w = [float(d.get(weight, 1.0)) for _, _, d in g.edges(data=True)]
        return cls(len(nodes), np.array(e, dtype=np.int64).reshape(-1, 2), np.array(w))


def _pairs_within(n: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """Each of the n(n-1)/2 pairs independently with probability p (exact, sparse for large n)."""
    total = n * (n - 1) // 2
    if total == 0 or p <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    k = int(rng.binomial(total, min(p, 1.0)))
    idx = rng.choice(total, size=k, replace=False) if k < total else np.arange(total)
    # unrank pair index -> (i, j), i < j, in row-major order of the upper triangle
    i = (n - 2 - np.floor(np.sqrt(-8.0 * idx + 4.0 * n * (n - 1) - 7) / 2.0 - 0.5)).astype(np.int64)
    j = (idx + i + 1 - n * (n - 1) // 2 + (n - i) * ((n - i) - 1) // 2).astype(np.int64)
    return np.stack([i, j], 1)


def _pairs_between(na: int, nb: int, p: float, rng: np.random.Generator) -> np.ndarray:
    total = na * nb
    if total == 0 or p <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    k = int(rng.binomial(total, min(p, 1.0)))
    idx = rng.choice(total, size=k, replace=False) if k < total else np.arange(total)
    return np.stack([idx // nb, idx % nb], 1)


def sbm(sizes: list[int] | tuple[int, ...], p_in: float, p_out: float, seed: int = 0,
        weight_in: tuple[float, float] = (1.0, 0.0), weight_out: tuple[float, float] = (1.0, 0.0)) -> Graph:
    """Stochastic block model: edges inside a block with probability ``p_in``, across with ``p_out``;
    weights drawn N(mean, sd) per edge (clipped to stay > 0), e.g. (40, 1) inside and (10, 1) across as
    in the ICASSP 2021 toy example."""
    if not (0 <= p_out <= 1 and 0 <= p_in <= 1):
        raise GraphError("p_in and p_out must be probabilities")
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    blocks, ws = [], []
    for a in range(len(sizes)):
        pa = _pairs_within(int(sizes[a]), p_in, rng) + starts[a]
        blocks.append(pa)
        ws.append(rng.normal(*weight_in, size=len(pa)) if weight_in[1] > 0 else np.full(len(pa), weight_in[0]))
        for b in range(a + 1, len(sizes)):
            pb = _pairs_between(int(sizes[a]), int(sizes[b]), p_out, rng) + np.array([starts[a], starts[b]])
            blocks.append(pb)
            ws.append(rng.normal(*weight_out, size=len(pb)) if weight_out[1] > 0 else np.full(len(pb), weight_out[0]))
    edges = np.concatenate(blocks) if blocks else np.zeros((0, 2), dtype=np.int64)
    weights = np.maximum(np.concatenate(ws), 1e-6) if ws else np.zeros(0)
    clusters = np.repeat(np.arange(len(sizes)), sizes)
    return Graph(int(starts[-1]), edges, weights, clusters)


def chain(sizes: tuple[int, ...] = (5, 5), weight: float = 1.25, boundary_weight: float = 1.0) -> Graph:
    """A path through consecutive clusters; edges inside a cluster have ``weight``, the edges joining
    clusters ``boundary_weight`` (Jung's chain experiments: 5/4 and eta in {1, 1/4})."""
    n = int(sum(sizes))
    e = np.stack([np.arange(n - 1), np.arange(1, n)], 1)
    clusters = np.repeat(np.arange(len(sizes)), sizes)
    w = np.where(clusters[:-1] != clusters[1:], boundary_weight, weight)
    return Graph(n, e, w, clusters)


def knn(features: np.ndarray, k: int = 5, bandwidth: float | None = None) -> Graph:
    """Symmetrized k-nearest-neighbour graph of node features, weights exp(-d^2 / (2 h^2)) with h the
    median neighbour distance (or ``bandwidth``)."""
    from scipy.spatial import cKDTree

    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or len(f) < 2:
        raise GraphError("features must be (N, p) with N >= 2")
    k = min(k, len(f) - 1)
    dist, idx = cKDTree(f).query(f, k + 1)
    rows = np.repeat(np.arange(len(f)), k)
    cols = idx[:, 1:].reshape(-1)
    d = dist[:, 1:].reshape(-1)
    h = bandwidth or float(np.median(d)) or 1.0
    lo, hi = np.minimum(rows, cols), np.maximum(rows, cols)
    key = lo * len(f) + hi
    _, first = np.unique(key, return_index=True)
    w = np.exp(-(d[first] ** 2) / (2 * h * h))
    return Graph(len(f), np.stack([lo[first], hi[first]], 1), np.maximum(w, 1e-12))


def complete(n: int) -> Graph:
    i, j = np.triu_indices(n, 1)
    return Graph(n, np.stack([i, j], 1), np.ones(len(i)))


def ring(n: int) -> Graph:
    if n < 3:
        return complete(n)
    i = np.arange(n)
    return Graph(n, np.stack([i, (i + 1) % n], 1), np.ones(n))


def erdos_renyi(n: int, p: float, seed: int = 0, max_tries: int = 1000) -> Graph:
    """G(n, p) (exact sparse sampling), redrawn until connected (the FedEM experiments use p = 0.5)."""
    if not 0 < p <= 1:
        raise GraphError(f"edge probability must be in (0, 1], got {p}")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        e = _pairs_within(n, p, rng)
        g = Graph(n, e, np.ones(len(e)))
        if n == 1 or g.is_connected():
            return g
    raise GraphError(f"no connected G({n}, {p}) in {max_tries} draws; raise p")


def from_file(path: str | Path, n: int) -> Graph:
    """A user-given adjacency: ``.npy`` or whitespace-separated text, N x N, symmetric, 0/1 or weights > 0,
    connected."""
    path = Path(path)
    try:  # kind and size before a byte is read: a FIFO or a device is refused, never waited on
        raw = io.BytesIO(read_bytes(path, (1 << 20) + 64 * n * n, "adjacency matrix", GraphError))
        a = np.load(raw, allow_pickle=False) if path.suffix == ".npy" else np.loadtxt(raw, ndmin=2)
    except GraphError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise GraphError(f"{path}: cannot read an adjacency matrix ({str(e)[:200]})") from None
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
        raise GraphError(f"{path}: an adjacency matrix holds real numbers, got {getattr(a, 'dtype', type(a))}")
    a = np.asarray(a, dtype=np.float64)
    if a.shape != (n, n):
        raise GraphError(f"{path}: adjacency must be {n} x {n}, got {a.shape}")
    if not np.isfinite(a).all() or (a < 0).any():
        raise GraphError(f"{path}: adjacency entries must be finite and >= 0 (0: no edge), found "
                         f"{a[~np.isfinite(a) | (a < 0)][0]}")
    if not np.allclose(a, a.T):
        raise GraphError(f"{path}: adjacency must be symmetric")
    np.fill_diagonal(a, 0.0)
    g = Graph.from_adjacency((a != 0).astype(np.float64))
    if not g.is_connected():
        raise GraphError(f"{path}: the graph is not connected")
    return g


TOPOLOGIES = ("complete", "ring", "erdos_renyi", "file")


def build(kind: str, n: int, p: float = 0.5, seed: int = 0, path: str = "") -> Graph:
    """A communication graph by name (the decentralized algorithms' ``topology`` field)."""
    if kind == "complete":
        return complete(n)
    if kind == "ring":
        return ring(n)
    if kind == "erdos_renyi":
        return erdos_renyi(n, p, seed)
    if kind == "file":
        return from_file(path, n)
    raise GraphError(f"unknown topology {kind!r}; use one of {TOPOLOGIES}")
