"""``fedmtl bench networked``: the vectorized GTV solver against CVXPY on SBM graphs of growing size.

Graphs: two equal clusters, about 10 neighbours inside a node's cluster and 0.2 across on average, 5
samples of 2 features per node, 40% of the nodes labelled, network Lasso (TV) with lambda = 0.05 and the
squared-error loss.  For each size: CVXPY's (Clarabel) solve time and solution, the number of primal-dual
iterations until ||w - w_cvxpy|| / ||w_cvxpy|| <= 1e-3 (found on a traced run), and the wall time of a clean
run of exactly that many iterations (no tracing).  Where CVXPY is not run (sizes above ``--cvxpy-max``) the
reference is our own solver run to a relative iterate change of 1e-10, and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedmtl.graph import Graph, sbm
from fedmtl.networked.gtv import GTVConfig, NodeData, cvxpy_solution, solve

from .common import add_out


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    p.add_argument("--sizes", default="1000,10000,100000", help="graph sizes (nodes)")
    p.add_argument("--cvxpy-max", type=int, default=10000, help="the largest graph CVXPY solves")


def problem(nodes: int, seed: int = 0) -> tuple[Any, NodeData]:
    """The SBM plus a ring through each cluster (so the graph is connected and every node's weight is
    pinned down by labelled nodes) with weights U(0.5, 1.5) (generic weights: a unique TV solution)."""
    half = nodes // 2
    s = sbm([half, nodes - half], 10.0 / half, 0.2 / half, seed=seed)
    rng = np.random.default_rng(seed + 1)
    ring = np.concatenate([np.stack([np.arange(a, b), np.roll(np.arange(a, b), -1)], 1)
                           for a, b in ((0, half), (half, nodes))])
    edges = np.concatenate([s.edges, ring])
    lo, hi = np.minimum(edges[:, 0], edges[:, 1]), np.maximum(edges[:, 0], edges[:, 1])
    key = np.unique(lo * nodes + hi)
    edges = np.stack([key // nodes, key % nodes], 1)
    g = Graph(nodes, edges, rng.uniform(0.5, 1.5, len(edges)), s.clusters)
    assert g.clusters is not None
    wbar = np.array([[2.0, 2.0], [-2.0, 2.0]])[g.clusters]
    x = rng.normal(size=(g.num_nodes, 5, 2))
    y = np.einsum("imn,in->im", x, wbar) + 0.1 * rng.normal(size=(g.num_nodes, 5))
    lab = rng.permutation(g.num_nodes)[: int(0.4 * g.num_nodes)]
    data = NodeData(x, y, np.full(g.num_nodes, 5), np.isin(np.arange(g.num_nodes), lab))
    return g, data


def run(out: str | Path, sizes: tuple[int, ...] = (1000, 10000, 100000), cvxpy_max: int = 10000,
        max_iterations: int = 20000) -> dict[str, Any]:
    cfg = GTVConfig(lam=0.05, penalty="tv", iterations=max_iterations)
    res: dict[str, Any] = {"lambda": cfg.lam, "penalty": cfg.penalty, "target_rel_error": 1e-3, "sizes": []}
    for n in sizes:
        g, data = problem(n)
        row: dict[str, Any] = {"nodes": g.num_nodes, "edges": g.num_edges}
        if n <= cvxpy_max:
            w_ref, _, secs = cvxpy_solution(g, data, cfg)
            row.update(reference="cvxpy", cvxpy_seconds=secs)
        else:
            t0 = time.perf_counter()
            w_ref = solve(g, data, GTVConfig(lam=cfg.lam, penalty="tv", iterations=max_iterations, tol=1e-10)).w
            row.update(reference="own solver to relative iterate change 1e-10",
                       reference_seconds=time.perf_counter() - t0)
        every = 10
        traced = solve(g, data, GTVConfig(lam=cfg.lam, penalty="tv", iterations=max_iterations, record_every=every,
                                                 ref_tol=1e-3),
                       w_ref=w_ref)
        hit = next((r["iteration"] for r in traced.trace if r["rel_error"] <= 1e-3), None)
        row["iterations_to_1e-3"] = hit
        if hit is not None:
            t0 = time.perf_counter()
            clean = solve(g, data, GTVConfig(lam=cfg.lam, penalty="tv", iterations=hit))
            secs = time.perf_counter() - t0
            rel = float(np.linalg.norm(clean.w - w_ref) / np.linalg.norm(w_ref))
            row.update({"seconds_to_1e-3": secs, "rel_error_reached": rel, "iterations_per_s": hit / secs,
                        "us_per_edge_iteration": 1e6 * secs / (hit * g.num_edges), "messages": clean.messages})
            if "cvxpy_seconds" in row:
                row["speedup_vs_cvxpy"] = row["cvxpy_seconds"] / secs
        res["sizes"].append(row)
        print(json.dumps(row))
    first = res["sizes"][0]
    if first["nodes"] == 1000 and "speedup_vs_cvxpy" in first:
        res["speedup_vs_cvxpy_1000"] = first["speedup_vs_cvxpy"]
    done = [r for r in res["sizes"] if "us_per_edge_iteration" in r]
    if len(done) >= 2:  # linear scaling in edges <=> constant time per edge-iteration
        res["us_per_edge_iteration"] = {str(r["nodes"]): r["us_per_edge_iteration"] for r in done}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    return res


def main(args: argparse.Namespace) -> int:
    sizes = tuple(int(s) for s in args.sizes.split(","))
    run(args.out, sizes, args.cvxpy_max)
    return 0


__all__ = ["add_arguments", "main", "problem", "run"]
