"""The update pipeline: what happens to a round's client updates between training and the server state.

``Engine.finish`` screens the round's results into an ``Updates`` (non-finite and failed replies excluded), passes
it through the run's ``UpdateStep`` s in a fixed order, lets the algorithm aggregate, then passes the old and new
server states through the ``ServerStep`` s.  Each step is one small class in its own module of
``fedmtl.engine.steps`` (the server optimizer: ``fedmtl.engine.server_opt``), built from the config by
``build_pipeline`` from the registry ``UPDATE_STEPS`` -- the way Flower wraps a strategy with its DP and robust
strategies and optax chains gradient transforms.  A new step or server optimizer is a module and one line here; a
new aggregator or attack is one ``register_aggregator`` / ``register_attack`` line (``fedmtl.robust``).

Order:  attack injection -> clipping -> robust combination -> DP clipping and noise (``ClipAndNoise``: the round's
combiner becomes its noised mean) -> ``Algorithm.aggregate`` (which calls the combiner) -> server optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..algorithms.base import Algorithm
from .server_opt import ServerOptStep
from .spec import RunSpec
from .steps.attack import AttackStep
from .steps.base import RoundInfo, ServerStep, Setting, Updates, UpdateStep
from .steps.clip import ClipStep
from .steps.privacy import ClipAndNoise
from .steps.robust import RobustCombination

#: a step factory: the step for this run, or None when its table leaves it off
StepFactory = Callable[[Setting], Any]

#: the update steps, in the order they run; a new one is one module and one line here
UPDATE_STEPS: dict[str, StepFactory] = {
    "attack": AttackStep.build,
    "clip": ClipStep.build,
    "robust": RobustCombination.build,
    "privacy": ClipAndNoise.build,
}


@dataclass(frozen=True)
class Pipeline:
    """The run's update steps (by name, in order) and its server step, if any."""

    steps: dict[str, UpdateStep]
    server: ServerStep[Any] | None = None

    def updates(self, u: Updates, info: RoundInfo) -> Updates:
        for step in self.steps.values():
            u = step(u, info)
        return u

    def get(self, name: str) -> Any:
        """The step registered as ``name`` (e.g. "privacy"), or None when this run has none."""
        return self.steps.get(name)

    @property
    def releases_empty_rounds(self) -> bool:
        """Whether a round in which no client trained still passes through the steps (DP: its noise is released)."""
        return any(getattr(s, "releases_empty_rounds", False) for s in self.steps.values())


def build_pipeline(spec: RunSpec, algorithm: Algorithm, num_clients: int) -> Pipeline:
    """The steps ``spec`` asks for, checked against ``algorithm`` (each step's factory refuses, with the key to
    change, a combination it cannot run) before any work."""
    setting = Setting(spec, algorithm, num_clients)
    steps = {name: step for name, make in UPDATE_STEPS.items() if (step := make(setting)) is not None}
    return Pipeline(steps, ServerOptStep(spec.server_opt, algorithm.name) if spec.server_opt.enabled else None)


__all__ = ["UPDATE_STEPS", "Pipeline", "RoundInfo", "ServerStep", "Setting", "UpdateStep", "Updates", "build_pipeline"]
