"""The ``[async]`` table: the asynchronous modes FedAsync and FedBuff and their staleness functions (the
event-ordered simulation that runs them: ``fedmtl.engine.asynchronous``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..schema import Annotated, Range, check_fields

#: the asynchronous modes, as ``fedmtl list`` shows them
ASYNC_MODES: dict[str, str] = {
    "fedasync": "FedAsync: each arriving update mixed into the server at once, weight alpha s(staleness) "
                "(Xie et al., 2020)",
    "fedbuff": "FedBuff: a buffer of K staleness-weighted client changes, then one server step (Nguyen et al., "
               "AISTATS 2022)",
}


@dataclass(frozen=True)
class AsyncConfig:
    """The ``[async]`` table (``mode = "off"``: synchronous rounds)."""

    #: off (synchronous rounds), fedasync or fedbuff
    mode: Literal["off", "fedasync", "fedbuff"] = "off"
    #: clients training at once (0 = the run's clients per round)
    concurrency: Annotated[int, Range(0, 10**7)] = 0
    #: FedBuff: updates per server step, K (at most the concurrency)
    buffer_size: Annotated[int, Range(1, 10**7)] = 10
    #: FedAsync: the mixing weight alpha of an update with no staleness
    mixing: Annotated[float, Range(0, 1, lo_open=True)] = 0.6
    #: the staleness function s: constant, polynomial (t - tau + 1)^-a or hinge (1 until b, then 1 / (a (t-tau-b) + 1))
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    #: the staleness function's a
    staleness_a: Annotated[float, Range(0, 1e6)] = 0.5
    #: the hinge's b (server versions of staleness at full weight)
    staleness_b: Annotated[int, Range(0, 10**7)] = 4
    #: FedBuff: the server learning rate eta_g
    server_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "async")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def weight(self, tau: np.ndarray) -> np.ndarray:
        """s(t - tau) for staleness values ``tau`` (server versions between dispatch and use)."""
        tau = np.asarray(tau, dtype=np.float64)
        if self.staleness == "constant":
            return np.ones_like(tau)
        if self.staleness == "polynomial":
            return (tau + 1.0) ** (-self.staleness_a)
        return np.where(tau <= self.staleness_b, 1.0, 1.0 / (self.staleness_a * (tau - self.staleness_b) + 1.0))


