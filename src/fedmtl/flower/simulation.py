"""``fedmtl flower simulate``: the Flower app on Flower's simulation engine: one virtual SuperNode per seen
client (``partition-id`` = client id), or ``nodes`` SuperNodes each serving a contiguous block of clients (one
message per node per round, as in a deployment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.driver import RunResult
from .apps import ServerOptions, config_from_text, make_client_app, make_server_app


def simulate(cfg_text: str, num_clients: int = 0, out: str | Path = "", cpus: int = 1,
             round_timeout: float = 600.0, nodes: int = 0) -> RunResult:
    """Run the experiment ``cfg_text`` (TOML) over Flower's simulation engine with ``nodes`` virtual
    SuperNodes (0: one per seen client); returns its ``RunResult``."""
    from flwr.simulation import run_simulation

    cfg = config_from_text(cfg_text)
    n = cfg.build_data().seen.num_clients
    if num_clients and num_clients != n:
        raise ValueError(f"--clients {num_clients}: the config's federation has {n} seen clients (one SuperNode each)")
    if not 0 <= nodes <= n:
        raise ValueError(f"--nodes {nodes}: between 1 and the federation's {n} seen clients (0: one per client)")
    nodes = nodes or n
    result: dict[str, Any] = {}
    opts = ServerOptions(out=str(out), num_nodes=nodes, round_timeout=round_timeout)
    run_simulation(
        make_server_app(cfg_text, opts, result), make_client_app(cfg_text), num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": cpus}},
    )
    if "result" not in result:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return result["result"]
