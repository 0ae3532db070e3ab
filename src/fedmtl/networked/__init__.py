"""Networked federated learning: GTV minimization over an empirical graph by primal-dual message passing."""

from ..graph import Graph, GraphError, chain, knn, sbm
from .gtv import GTVConfig, GTVResult, NodeData, cvxpy_solution, objective, solve

__all__ = [
    "GTVConfig", "GTVResult", "Graph", "GraphError", "NodeData", "chain", "cvxpy_solution", "knn",
    "objective", "sbm", "solve",
]
