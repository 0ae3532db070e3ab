"""Convex federated multi-task learning: MOCHA (Smith et al. 2017) and its baselines."""

from .mocha import METHODS, MochaConfig, MochaResult, solve
from .omega import REGULARIZERS, ClusterRelaxation, FixedOmega, GraphicalLasso, TaskCovariance, sigma_prime
from .problem import LOSSES, MTLData, dual, error_rate, primal

__all__ = [
    "LOSSES", "METHODS", "REGULARIZERS", "ClusterRelaxation", "FixedOmega", "GraphicalLasso", "MTLData", "MochaConfig",
    "MochaResult", "TaskCovariance", "dual", "error_rate", "primal", "sigma_prime", "solve",
]
