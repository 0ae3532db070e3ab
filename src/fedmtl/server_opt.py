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

from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import tree as T
from .batchnorm import is_statistic
from .schema import Annotated, Range, check_fields
from .tree import Params

ServerOptName = Literal["none", "sgd", "avgm", "adam", "yogi", "adagrad"]


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
        if self.name not in ("none", "sgd", "avgm", "adam", "yogi", "adagrad"):
            raise ValueError(f"server_opt.name must be one of none, sgd, avgm, adam, yogi, adagrad, got {self.name!r}")
        check_fields(self, "server_opt")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def check(self, server: Any, method: str) -> None:
        if self.enabled and not (hasattr(server, "_fields") and "params" in server._fields):
            raise ValueError(f"[server_opt] name = {self.name!r}: {method} has no single global model (its server "
                             "state has no 'params'); server optimizers apply to global-model methods")

    def init(self, params: Params) -> dict[str, Params]:
        """The optimizer's state for the global model ``params``."""
        if self.name in ("sgd", "none"):
            return {}
        if self.name == "avgm":
            return {"m": T.zeros_like(params)}
        return {"m": T.zeros_like(params), "v": T.tmap(lambda p: torch.full_like(p, self.tau**2), params)}

    def step(self, old: Params, new: Params, state: dict[str, Params]) -> tuple[Params, dict[str, Params]]:
        """One server step from the previous model ``old`` given the aggregation's model ``new``.  Batch-norm running
        statistics are not optimized: they take the aggregation's value (their average, as FedAvg's)."""
        stats = {k: v for k, v in new.items() if is_statistic(k)}
        if stats:
            learn = [k for k in new if not is_statistic(k)]
            x, st = self.step({k: old[k] for k in learn}, {k: new[k] for k in learn},
                              {n: {k: s[k] for k in learn} for n, s in state.items()})
            return {k: stats[k] if k in stats else x[k] for k in new}, {n: {**state[n], **s} for n, s in st.items()}
        delta = T.sub(new, old)
        if self.name == "sgd":
            return T.tmap(lambda x, d: x + self.lr * d, old, delta), state
        b1, b2 = self.beta1, self.beta2
        if self.name == "avgm":
            m = T.tmap(lambda mm, d: b1 * mm + d, state["m"], delta)
            return T.tmap(lambda x, mm: x + self.lr * mm, old, m), {"m": m}
        m = T.tmap(lambda mm, d: b1 * mm + (1 - b1) * d, state["m"], delta)
        if self.name == "adagrad":
            v = T.tmap(lambda vv, d: vv + d * d, state["v"], delta)
        elif self.name == "yogi":
            v = T.tmap(lambda vv, d: vv - (1 - b2) * d * d * torch.sign(vv - d * d), state["v"], delta)
        else:  # adam
            v = T.tmap(lambda vv, d: b2 * vv + (1 - b2) * d * d, state["v"], delta)
        x = T.tmap(lambda xx, mm, vv: xx + self.lr * mm / (vv.sqrt() + self.tau), old, m, v)
        return x, {"m": m, "v": v}
