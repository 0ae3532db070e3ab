"""Networked federated learning: GTV minimization over an empirical graph by primal-dual message passing."""

from .graph import EmpiricalGraph, GraphError, chain, knn, sbm
from .gtv import GTVConfig, GTVResult, NodeData, cvxpy_solution, objective, solve

__all__ = [
    "EmpiricalGraph", "GTVConfig", "GTVResult", "GraphError", "NodeData", "chain", "cvxpy_solution", "knn",
    "objective", "sbm", "solve",
]
