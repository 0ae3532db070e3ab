"""Server optimizers for methods with one global model (the ``[server_opt]`` table).

Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan, "Adaptive Federated Optimization", ICLR 2021,
Algorithm 2, and FedAvgM (Hsu, Qi, Brown, arXiv 1909.06335, 2019).

The server treats Delta_t = (what the method's aggregation gives) - x_{t-1} as a pseudo-gradient and steps:

* ``sgd``:     x_t = x_{t-1} + lr Delta_t  (lr = 1 is the method itself: FedAvg for FedAvg; tested)
* ``avgm``:    m_t = beta1 m_{t-1} + Delta_t;  x_t = x_{t-1} + lr m_t  (server momentum, FedAvgM)
* ``adagrad``: v_t = v_{t-1} + Delta_t^2
* ``yogi``:    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
* ``adam``:    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
  and for these three  m_t = beta1 m_{t-1} + (1 - beta1) Delta_t,  x_t = x_{t-1} + lr m_t / (sqrt(v_t) + tau),
  with v_{-1} = tau^2 and no bias correction (the paper's Algorithm 2).

It acts on the ``params`` field of the server state (FedAvg, FedProx, FedAvg+, Per-FedAvg, pFedMe, Ditto,
APFL, SCAFFOLD, FedDyn, the body of FedPer / FedRep / FedBABU, LG-FedAvg's head); a method without one
(FedEM's components, IFCA's clusters, ...) is refused before the run starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from .. import tree as T
from ..batchnorm import is_statistic
from ..schema import Annotated, Range, check_fields
from ..tree import Params

ServerOptName = Literal["none", "sgd", "avgm", "adam", "yogi", "adagrad"]


class NoState(NamedTuple):
    """``sgd`` keeps no state."""


class MomentumState(NamedTuple):
    """``avgm``: the server momentum."""

    m: Params


class AdaptiveState(NamedTuple):
    """``adam``, ``yogi``, ``adagrad``: first and second moments."""

    m: Params
    v: Params


ServerOptState = NoState | MomentumState | AdaptiveState


@dataclass(frozen=True)
class ServerOptConfig:
    """The ``[server_opt]`` table."""

    #: none (the method's own server step), sgd, avgm (server momentum), adam, yogi or adagrad
    name: ServerOptName = "none"
    #: the server learning rate eta
    lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 1.0
    #: first-moment decay (avgm: the momentum)
    beta1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9
    #: second-moment decay (adam, yogi)
    beta2: Annotated[float, Range(0, 1, hi_open=True)] = 0.99
    #: adaptivity tau (adam, yogi, adagrad): added to sqrt(v); v starts at tau^2
    tau: Annotated[float, Range(0, 1, lo_open=True)] = 1e-3

    def __post_init__(self) -> None:
        check_fields(self, "server_opt")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def check(self, server: Any, method: str) -> None:
        if self.enabled and not (hasattr(server, "_fields") and "params" in server._fields):
            raise ValueError(f"[server_opt] name = {self.name!r}: {method} has no single global model (its server "
                             "state has no 'params'); server optimizers apply to global-model methods")

    def init(self, params: Params) -> ServerOptState:
        """The optimizer's state for the global model ``params``."""
        if self.name in ("sgd", "none"):
            return NoState()
        if self.name == "avgm":
            return MomentumState(T.zeros_like(params))
        return AdaptiveState(T.zeros_like(params), T.tmap(lambda p: torch.full_like(p, self.tau**2), params))

    def step(self, old: Params, new: Params, state: ServerOptState) -> tuple[Params, ServerOptState]:
        """One server step from the previous model ``old`` given the aggregation's model ``new``.  Batch-norm running
        statistics are not optimized: they take the aggregation's value (their average, as FedAvg's)."""
        stats = {k: v for k, v in new.items() if is_statistic(k)}
        if stats:
            learn = [k for k in new if not is_statistic(k)]
            part = type(state)(*({k: s[k] for k in learn} for s in state))
            x, st = self.step({k: old[k] for k in learn}, {k: new[k] for k in learn}, part)
            return {k: stats[k] if k in stats else x[k] for k in new}, type(state)(
                *({**s0, **s1} for s0, s1 in zip(state, st, strict=True)))
        delta = T.sub(new, old)
        if self.name == "sgd":
            return T.tmap(lambda x, d: x + self.lr * d, old, delta), state
        b1, b2 = self.beta1, self.beta2
        if isinstance(state, MomentumState):  # avgm
            m = T.tmap(lambda mm, d: b1 * mm + d, state.m, delta)
            return T.tmap(lambda x, mm: x + self.lr * mm, old, m), MomentumState(m)
        assert isinstance(state, AdaptiveState), f"server_opt.name = {self.name!r} with a {type(state).__name__}"
        m = T.tmap(lambda mm, d: b1 * mm + (1 - b1) * d, state.m, delta)
        second = _SECOND_MOMENT[self.name]
        v = T.tmap(lambda vv, d: second(vv, d, b2), state.v, delta)
        x = T.tmap(lambda xx, mm, vv: xx + self.lr * mm / (vv.sqrt() + self.tau), old, m, v)
        return x, AdaptiveState(m, v)


#: the adaptive optimizers' second-moment updates v_t(v_{t-1}, Delta_t, beta2) (Reddi et al., Algorithm 2)
_SECOND_MOMENT: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "adagrad": lambda vv, d, b2: vv + d * d,
    "yogi": lambda vv, d, b2: vv - (1 - b2) * d * d * torch.sign(vv - d * d),
    "adam": lambda vv, d, b2: b2 * vv + (1 - b2) * d * d,
}


class ServerOptStep:
    """The update pipeline's server step (``fedmtl.engine.updates``): after the algorithm aggregated, step the global
    model from the previous one with the ``[server_opt]`` optimizer."""

    def __init__(self, cfg: ServerOptConfig, method: str):
        self.cfg, self.method = cfg, method

    # servers: any server state with a ``params`` field (a NamedTuple; ``ServerOptConfig.check`` refuses others)
    def init(self, server: Any) -> ServerOptState:
        self.cfg.check(server, self.method)
        return self.cfg.init(server.params)

    def __call__(self, before: Any, after: Any, state: ServerOptState) -> tuple[Any, ServerOptState]:
        params, state = self.cfg.step(before.params, after.params, state)
        return after._replace(params=params), state


def legacy_state_names(named: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints written before the states were NamedTuples name the moments ``['m']...``: read them as ``.m...``."""
    return {(f".{k[2]}{k[5:]}" if k[:2] == "['" and k[2] in "mv" and k[3:5] == "']" else k): t
            for k, t in named.items()}
