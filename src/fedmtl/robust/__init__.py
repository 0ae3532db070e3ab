"""Trust: robust aggregation (``[robust]``) and an attack harness (``[attack]``)."""

from .aggregators import RobustConfig
from .attacks import AttackConfig

__all__ = ["AttackConfig", "RobustConfig"]
