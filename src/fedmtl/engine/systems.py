"""Systems heterogeneity shared by every method: stragglers, dropped nodes and an estimated clock.

MOCHA (Smith et al., NeurIPS 2017, Sections 3.4 and 5.3-5.4) models a federated round as one clock
cycle in which node t does whatever local work its device allows, and may not answer at all:

* **Local work.**  Each round every node draws a speed ``s ~ U[low, 1]`` (``variability``: "none"
  ``low = 1``, "low" ``low = 0.9``, "high" ``low = 0.1``, or ``speed_low`` directly).  A method with
  flexible local work (MOCHA, FedAvg-like local SGD: ``mode = "deadline"``) does ``floor(s * budget)``
  of its ``budget`` steps (at least one) and the round lasts one clock cycle, the time a full-speed node
  needs for the largest budget.  A method whose nodes must finish a fixed amount of work (CoCoA's fixed
  theta: ``mode = "wait"``) does all of it and the synchronous round lasts until its slowest node is done
  (``steps / s``).
* **Drops.**  Each node independently returns nothing with probability ``drop_prob`` (theta = 1 in the
  paper); ``never_respond`` lists nodes that never answer (the paper's failing case).
* **Estimated time.**  ``TimeModel``: compute (FLOPs over the device's rate) plus communication (latency
  plus bytes over bandwidth, down and up) with presets for 3G, LTE and WiFi, so any run can report how
  long it would take on a device network.  ``TimeModel.paper(network)`` is the unit model of the MOCHA
  reference code (one unit per FLOP-coefficient, communication 10 / 100 / 1000 units for WiFi / LTE / 3G),
  used to reproduce the paper's figures; the physical presets are ours (documented below).

Every draw is a counter-based hash of ``(seed, round, purpose, node id)`` (``uniform``): a node's draw never
depends on which other nodes take part, costs O(1) per participating node (a round stays O(sampled
clients) in a population of millions), and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from ..schema import Annotated, Range, check_fields, shown

VARIABILITY = {"none": 1.0, "low": 0.9, "high": 0.1}
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform(seed: int, round_idx: int, purpose: int, nodes: np.ndarray) -> np.ndarray:
    """U[0, 1) draws, one per node id, from a hash of (seed, round, purpose, node): splitmix64's finalizer
    over a key from ``numpy.random.SeedSequence`` (which mixes the run's seed, the round and the purpose)."""
    key = np.random.SeedSequence([seed, round_idx, 7, purpose]).generate_state(1, dtype=np.uint64)[0]
    z = np.asarray(nodes, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key  # wraps modulo 2^64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Network:
    """A link: one-way ``latency_s`` per message and ``bandwidth_bps`` (bits per second)."""

    latency_s: float
    bandwidth_bps: float

    def seconds(self, num_bytes: float) -> float:
        bw = self.bandwidth_bps
        return self.latency_s + (0.0 if math.isinf(bw) else 8.0 * num_bytes / bw)


# Physical presets (typical uplink figures; our choice, not from the paper): 3G ~1 Mbit/s and 150 ms,
# LTE ~10 Mbit/s and 50 ms, WiFi ~50 Mbit/s and 5 ms.
NETWORKS = {
    "3g": Network(0.150, 1e6),
    "lte": Network(0.050, 10e6),
    "wifi": Network(0.005, 50e6),
}
# The MOCHA reference code's per-round communication cost in its FLOP-like units.
PAPER_COMM_UNITS = {"wifi": 10.0, "lte": 100.0, "3g": 1000.0}


@dataclass(frozen=True)
class TimeModel:
    """Estimated seconds of one synchronous round: ``compute + 2 messages`` (down and up)."""

    network: str = "lte"
    device_flops: float = 1e9  # sustained FLOP/s of one device
    latency_s: float | None = None  # overrides the preset
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if self.network not in NETWORKS and self.network != "paper":
            raise ValueError(f"systems.network must be one of {sorted(NETWORKS)}, got {shown(self.network)}")
        if self.device_flops <= 0:
            raise ValueError("systems.device_flops must be > 0")

    @staticmethod
    def paper(network: str) -> TimeModel:
        """The reference code's units: compute in FLOP-coefficient units, communication 10/100/1000."""
        if network not in PAPER_COMM_UNITS:
            raise ValueError(f"network must be one of {sorted(PAPER_COMM_UNITS)}, got {shown(network)}")
        return TimeModel("paper", 1.0, PAPER_COMM_UNITS[network] / 2, math.inf)

    @property
    def link(self) -> Network:
        base = NETWORKS.get(self.network, Network(0.0, math.inf))
        return Network(
            base.latency_s if self.latency_s is None else self.latency_s,
            base.bandwidth_bps if self.bandwidth_bps is None else self.bandwidth_bps,
        )

    def round_seconds(self, compute_flops: float, bytes_down: float, bytes_up: float) -> float:
        link = self.link
        return compute_flops / self.device_flops + link.seconds(bytes_down) + link.seconds(bytes_up)


class SystemsDraw(NamedTuple):
    """One round's draw for the K participating nodes."""

    speed: np.ndarray  # (K,) in (0, 1]
    dropped: np.ndarray  # (K,) bool


@dataclass(frozen=True)
class SystemsConfig:
    """The ``[systems]`` table.  The defaults model an ideal network: full speed, nobody drops."""

    #: none, low or high: per-round device speed ~ U[low, 1] with low = 1, 0.9 or 0.1
    variability: Literal["none", "low", "high"] = "none"
    #: > 0 overrides the variability preset's lower bound of the speed
    speed_low: Annotated[float, Range(0, 1)] = 0.0
    #: probability that a node returns nothing in a round
    drop_prob: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    #: nodes that never answer
    never_respond: list[Annotated[int, Range(0, 10**9)]] = field(default_factory=list)
    #: deadline: flexible local work (a straggler does floor(speed * steps)); wait: full work, slow rounds
    mode: Literal["deadline", "wait"] = "deadline"
    #: 3g, lte or wifi: the network of the estimated time model
    network: Literal["3g", "lte", "wifi"] = "lte"
    #: sustained FLOP/s of one device (the estimated time model)
    device_flops: Annotated[float, Range(1, 1e30)] = 1e9

    def __post_init__(self) -> None:
        check_fields(self, "systems")
        TimeModel(self.network, self.device_flops)  # validates network / device_flops

    @property
    def low(self) -> float:
        return self.speed_low if self.speed_low > 0 else VARIABILITY[self.variability]

    @property
    def ideal(self) -> bool:
        return self.low >= 1.0 and self.drop_prob == 0 and not self.never_respond

    @property
    def time_model(self) -> TimeModel:
        return TimeModel(self.network, self.device_flops)

    def draw(self, seed: int, round_idx: int, nodes: np.ndarray) -> SystemsDraw:
        """Speeds and drops of ``nodes`` (global ids) in round ``round_idx``: a node's draw depends only
        on (seed, round, node id), not on which other nodes take part."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if self.ideal:
            return SystemsDraw(np.ones(len(nodes)), np.zeros(len(nodes), dtype=bool))
        speed = np.ones(len(nodes))
        if self.low < 1:
            speed = self.low + (1.0 - self.low) * uniform(seed, round_idx, 0, nodes)
        dropped = np.isin(nodes, np.asarray(self.never_respond, dtype=np.int64))
        if self.drop_prob > 0:
            dropped |= uniform(seed, round_idx, 1, nodes) < self.drop_prob
        return SystemsDraw(np.maximum(speed, 1e-6), dropped)

    def steps(self, draw: SystemsDraw, budget: np.ndarray) -> np.ndarray:
        """Local steps each node does: ``floor(speed * budget)`` (>= 1) in deadline mode, the full
        ``budget`` in wait mode; 0 for dropped nodes."""
        budget = np.asarray(budget, dtype=np.int64)
        if self.mode == "deadline":
            done = np.maximum(np.floor(draw.speed * budget + 1e-9).astype(np.int64), np.minimum(budget, 1))
        else:
            done = budget.copy()
        return np.where(draw.dropped, 0, done)

    def compute_time_steps(self, draw: SystemsDraw, budget: np.ndarray, done: np.ndarray | None = None) -> float:
        """The round's compute duration in full-speed steps: one clock cycle (the largest budget) in
        deadline mode; the slowest answering node's ``steps / speed`` in wait mode."""
        budget = np.asarray(budget, dtype=np.float64)
        if budget.size == 0:
            return 0.0
        if self.mode == "deadline":
            return float(budget.max())
        done = budget if done is None else np.asarray(done, dtype=np.float64)
        live = ~draw.dropped
        return float((done[live] / draw.speed[live]).max()) if live.any() else float(budget.max())
