"""The types the update pipeline's steps share (``fedmtl.engine.updates`` composes the steps)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, TypeVar

from torch import Tensor

from ...algorithms.base import Algorithm, Context
from ...tree import Tree
from ..spec import RunSpec


class Updates(NamedTuple):
    """A round's client updates as they pass through the pipeline (K rows, in the order the clients were asked)."""

    ids: Tensor  # (K,) long: the clients whose results these are
    updates: Tree  # (K, ...) what each client sent
    counts: Tensor  # (K,) long: their training examples
    valid: Tensor  # (K,) bool: finite, answered and not excluded by a step
    weights: Tensor  # (K,) float64: counts where valid, 0 elsewhere (what aggregate() weights by)
    excluded: int  # updates excluded so far this round (non-finite)
    ctx: Context  # what aggregate() reads: how to combine (robust combiner, noised mean) and the DP denominator

    def revalidate(self, valid: Tensor) -> Updates:
        """The same updates with validity ``valid`` (a subset of the current one), the weights following."""
        dropped = int((self.valid & ~valid).sum())
        w = self.counts.to(self.weights.dtype) * valid.to(self.weights.dtype)
        return self._replace(valid=valid, weights=w, excluded=self.excluded + dropped)


class RoundInfo(NamedTuple):
    """What a step may know of its round."""

    round: int
    seed: int
    payload: Tree  # what the server broadcast (the reference the updates deviate from)


class UpdateStep(Protocol):
    """One transformation of a round's updates, before the algorithm aggregates them."""

    def __call__(self, u: Updates, info: RoundInfo) -> Updates: ...


StepStateT = TypeVar("StepStateT", bound=Tree)


class ServerStep(Protocol[StepStateT]):
    """One transformation of the server state after the algorithm aggregated (a server optimizer); its own state
    ``StepStateT`` (a NamedTuple of tensors) is checkpointed with the run.  Server states are the algorithm's (any)."""

    def init(self, server: Any) -> StepStateT: ...

    def __call__(self, before: Any, after: Any, state: StepStateT) -> tuple[Any, StepStateT]: ...


class Setting(NamedTuple):
    """What a step factory may read when the pipeline is built."""

    spec: RunSpec
    algorithm: Algorithm
    num_clients: int  # the federation's seen clients
