"""Secure aggregation over Flower (SecAgg+, Bell et al., CCS 2020, as Flower ships it): the ``[flower]`` table, which
algorithms may use it, and the arithmetic of what a SuperNode sends and what the server recovers.  This module is
torch-only; the protocol itself (Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``) runs in
``fedmtl.flower.secagg``.

Turned on with ``flower.secure_aggregation = true``.  Each round every SuperNode then sends one *masked* integer
vector; the server adds them up and, with the key shares of at least ``reconstruction_threshold`` nodes, removes the
masks of the sum only.  It never holds a node's update in the clear, only the round's sum.

**Weighting.**  fedmtl sends one message per SuperNode carrying all of its sampled clients, and Flower's protocol sums
one vector per node, so a node pre-aggregates.  For a round of sampled clients ``S`` the server sends each node the
weights ``a_k`` of its clients: ``a_k = n_k / sum_{j in S} n_k`` (training examples; the engine's FedAvg-family
weights) or, under ``[privacy]``, ``a_k = 1 / |S|`` (DP-FedAvg's noised *sum*).  A node replies

    s = sum_{k valid} a_k v_k          and          W = sum_{k valid} a_k,

where ``v_k`` is client k's update minus the broadcast payload (the update itself when it is not shaped like the
payload) and *valid* means finite (a non-finite client is left out of ``s`` and ``W`` and reported as such, as the
simulator excludes it).  Under ``[privacy]`` the node first clips each ``v_k`` to ``privacy.clip_norm``, the step the
simulator does on the server.  Every node enters the protocol with weight 1 (Flower's ``max_weight`` = 1), so
Flower's own weight quantization cancels exactly, and the server obtains ``S = sum_nodes s`` and ``A = sum_nodes W``.
The recovered mean ``m = S / A`` is the weighted mean of the valid clients' ``v_k``: the server gives the engine
``payload + m`` for every valid client, whose weighted mean (FedAvg, FedProx, Ditto's global model, FedEM's
components) is ``payload + m`` and whose sum of deviations (DP-FedAvg's noised sum, noise added on the server) is
``(number valid) * m``: the simulator's aggregate up to the quantization error below.  Every SuperNode takes part
in every round (one with no sampled client sends zeros), so the protocol always has all nodes to mask with.

**Quantization.**  Flower maps each entry of ``s`` from ``[-C, C]`` (``clipping_range``) to an integer in
``[0, Q]`` (``quantization_range``) by stochastic rounding, an error below one step ``2C/Q`` per node and entry; the
weight travels as ``C W`` in the same vector.  With ``n`` nodes in a round's sum, ``|S - S_exact| < 2nC/Q`` per entry
and ``|A - A_exact| < 2n/Q``, so each entry of the recovered mean is off by at most

    |m - m_exact| <= 2n (C + |m|) / (Q A)           (``mean_error_bound``)

(A = 1 when no client failed).  Entries of ``s`` outside ``[-C, C]`` are clipped: the node counts them and the server
logs the count, naming ``flower.clipping_range``.  The integers are summed modulo 2^32, so ``n Q < 2^32`` is required
(1023 nodes at the default ``Q = 2^22``).

**What stays in the clear:** which clients were sampled, each client's training loss and whether its update was
finite, and the number of clipped entries per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import tree as T
from .schema import Annotated, Range, check_fields
from .tree import Tree

#: Flower's modulus for the masked sums (``SecAggPlusWorkflow``'s ``modulus_range`` default)
MODULUS = 1 << 32

#: algorithms whose server step reads only the weighted mean (or, under [privacy], the sum) of the clients' updates
SUM_ONLY = ("fedavg", "fedprox", "fedavg+", "ditto", "fedem")

#: the name of the extra entry that carries a node's total weight ``C W`` next to its weighted sum
WEIGHT_KEY = "__fedmtl_weight__"


class SecureAggregationError(ValueError):
    """A run that cannot use secure aggregation (an algorithm that needs each update, too many nodes, ...)."""


@dataclass(frozen=True)
class FlowerConfig:
    """The ``[flower]`` table: secure aggregation of the clients' updates with Flower's SecAgg+ protocol."""

    #: sum the SuperNodes' updates with SecAgg+: the server sees only their sum (Flower runs only)
    secure_aggregation: bool = False
    #: SecAgg+: key shares each node hands out, itself included (0 = every node of the round; else at least 3)
    num_shares: Annotated[int, Range(0, 100_000)] = 0
    #: SecAgg+: shares needed to unmask a node (0 = a majority of num_shares, at least 2; else below num_shares)
    reconstruction_threshold: Annotated[int, Range(0, 100_000)] = 0
    #: SecAgg+: entries of a node's weighted update are clipped to [-clipping_range, clipping_range]
    clipping_range: Annotated[float, Range(1e-6, 1e6)] = 8.0
    #: SecAgg+: integer levels of the quantizer (error per node and entry below 2 clipping_range / quantization_range)
    quantization_range: Annotated[int, Range(256, 1 << 30)] = 1 << 22

    def __post_init__(self) -> None:
        check_fields(self, "flower")
        if self.num_shares not in (0,) and self.num_shares < 3:
            raise ValueError(f"flower.num_shares = {self.num_shares}: 0 (every node) or at least 3")
        if self.reconstruction_threshold == 1:
            raise ValueError("flower.reconstruction_threshold = 1: 0 (a majority) or at least 2")
        if self.num_shares and self.reconstruction_threshold >= self.num_shares:
            raise ValueError(f"flower.reconstruction_threshold = {self.reconstruction_threshold} must be below "
                             f"flower.num_shares = {self.num_shares}")

    def protocol(self, nodes: int) -> tuple[int, int]:
        """(num_shares, reconstruction_threshold) for a round of ``nodes`` SuperNodes (``SecureAggregationError`` when
        the protocol cannot run with that many)."""
        if nodes < 3:
            raise SecureAggregationError(f"flower.secure_aggregation needs at least 3 SuperNodes, {nodes} connected "
                                         "(with 2, each could subtract its own update from the sum)")
        if nodes * self.quantization_range >= MODULUS:
            raise SecureAggregationError(f"{nodes} SuperNodes x flower.quantization_range = {self.quantization_range} "
                                         f"overflow SecAgg+'s 2^32 modulus: lower quantization_range below "
                                         f"{MODULUS // nodes}")
        shares = min(self.num_shares or nodes, nodes)
        threshold = self.reconstruction_threshold or max(shares // 2 + 1, 2)
        if threshold >= shares:
            raise SecureAggregationError(f"flower.reconstruction_threshold = {threshold} must be below the "
                                         f"{shares} shares a round of {nodes} SuperNodes has")
        return shares, threshold


def refusal(algorithm: str, robust: Any, attack: Any) -> str | None:
    """Why a run with ``flower.secure_aggregation = true`` cannot work (one line), or None.  ``robust`` /
    ``attack``: the ``[robust]`` / ``[attack]`` configs."""
    if algorithm not in SUM_ONLY:
        return (f"flower.secure_aggregation = true: algorithm {algorithm!r} needs each client's update on the server, "
                f"and SecAgg+ reveals only their sum; it works with {', '.join(SUM_ONLY)} (and [privacy])")
    if robust.aggregator != "mean" or robust.bucketing > 1:
        return (f"flower.secure_aggregation = true: robust.aggregator = {robust.aggregator!r} / robust.bucketing = "
                f"{robust.bucketing} needs each client's update on the server; SecAgg+ reveals only their sum")
    if robust.clip_norm > 0:
        return ("flower.secure_aggregation = true: robust.clip_norm clips each update on the server, which never sees "
                "one; use privacy.clip_norm (clipped on the nodes)")
    if attack.active:
        return (f"flower.secure_aggregation = true: attack.kind = {attack.kind!r} rewrites individual updates on the "
                "server, which never sees one")
    return None


def flat(tree: Tree) -> dict[str, Tensor]:
    """``tree``'s leaves by name, in the fixed order both ends use."""
    return dict(sorted(T.to_named(tree).items()))


def node_contribution(updates: Tree, reference: Tree | None, weights: Tensor, ok: Tensor, clip_range: float,
                      dp_clip: float = 0.0) -> tuple[dict[str, Tensor], int]:
    """What a SuperNode sends: ``s = sum_k a_k v_k`` over its valid clients (``updates`` (K, ...), ``weights`` a_k
    (K,), ``ok`` (K,) bool), ``v_k`` the update minus ``reference`` (None: the update), clipped to ``dp_clip`` in L2
    first when > 0; every entry clipped to ``[-clip_range, clip_range]``.  Returns the named float64 arrays (the
    last, ``WEIGHT_KEY``, holds ``clip_range * sum_k a_k``) and the number of entries that were clipped."""
    from .robust.aggregators import clip_updates

    keep = torch.nonzero(ok.cpu()).flatten()
    a = weights.to(torch.float64).cpu().index_select(0, keep)  # (V,)
    if dp_clip > 0:
        updates = clip_updates(updates, reference, ok.to(torch.float64), dp_clip)
    dev = updates if reference is None else T.tmap(lambda u, r: u - r.unsqueeze(0), updates, reference)
    out: dict[str, Tensor] = {}
    clipped = 0
    for name, x in flat(dev).items():  # x: (K, ...)
        rows = x.detach().cpu().to(torch.float64).index_select(0, keep)  # (V, ...): invalid rows never multiplied
        s = torch.tensordot(a, rows, dims=1)  # (...)
        clipped += int((s.abs() > clip_range).sum())
        out[name] = s.clamp(-clip_range, clip_range)
    out[WEIGHT_KEY] = torch.tensor([clip_range * float(a.sum())], dtype=torch.float64)
    return out, clipped


def recovered_mean(sums: dict[str, Tensor], clip_range: float, template: dict[str, Tensor]) -> tuple[dict[str, Tensor],
                                                                                                    float]:
    """The weighted mean ``m = S / A`` of the valid clients' ``v_k`` from the unmasked sums (named like
    ``node_contribution``'s output), cast to ``template``'s dtypes and shapes; and ``A``."""
    total = float(sums[WEIGHT_KEY].reshape(-1)[0]) / clip_range
    if total <= 0:
        return {n: torch.zeros_like(t) for n, t in template.items()}, 0.0
    return {n: (sums[n] / total).reshape(t.shape).to(t.dtype) for n, t in template.items()}, total


def mean_error_bound(nodes: int, clip_range: float, quantization_range: int, total_weight: float,
                     magnitude: float) -> float:
    """The largest error of an entry of the recovered mean (module docstring): ``2 n (C + |m|) / (Q A)``."""
    return 2.0 * nodes * (clip_range + magnitude) / (quantization_range * total_weight)


__all__ = ["MODULUS", "SUM_ONLY", "WEIGHT_KEY", "FlowerConfig", "SecureAggregationError", "flat", "mean_error_bound",
           "node_contribution", "recovered_mean", "refusal"]
