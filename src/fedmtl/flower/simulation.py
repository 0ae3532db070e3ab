"""``fedmtl flower simulate``: the Flower app on Flower's simulation engine: one virtual SuperNode per seen
client (``partition-id`` = client id), or ``nodes`` SuperNodes each serving a contiguous block of clients (one
message per node per round, as in a deployment).  Each virtual node reserves ``--cpus-per-node`` CPUs and
``--gpus-per-node`` GPUs of the Ray cluster Flower's simulation backend runs on: one started for the run with
``--cpus`` CPUs, or an existing cluster joined with ``--ray-address``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..runs.driver import RunResult
from .apps import ServerOptions, config_from_text, make_client_app, make_server_app
from .relay_app import secure_mod

#: the most CPUs (or GPUs, or per-node reservations) a simulation asks Ray for
MAX_CPUS = 4096


def backend_config(cpus: int = 1, cpus_per_node: float = 1.0, gpus_per_node: float = 0.0,
                   ray_address: str = "") -> dict[str, Any]:
    """Flower's simulation backend configuration: each virtual SuperNode reserves ``cpus_per_node`` CPUs and
    ``gpus_per_node`` GPUs (fractions share a GPU between nodes) of a Ray cluster that is either started here with
    ``cpus`` CPUs (and every GPU Ray finds) or, with ``ray_address`` ("auto", or "HOST:PORT" of a head started with
    ``ray start --head``), an existing one joined as it is (its CPUs and GPUs are the cluster's own)."""
    if not 0 < cpus_per_node <= MAX_CPUS:  # (NaN fails too)
        raise ValueError(f"--cpus-per-node {cpus_per_node:g}: must be > 0 and at most {MAX_CPUS}")
    if not 0 <= gpus_per_node <= MAX_CPUS:
        raise ValueError(f"--gpus-per-node {gpus_per_node:g}: must be >= 0 and at most {MAX_CPUS}")
    init: dict[str, Any] = {}
    if ray_address:
        init["address"] = ray_address  # Ray refuses num_cpus when joining a running cluster: its own resources count
    else:
        if not 1 <= cpus <= MAX_CPUS:  # Ray starts workers for what it is given: never 10^9 of them
            raise ValueError(f"--cpus {cpus}: at least 1 and at most {MAX_CPUS}")
        if cpus_per_node > cpus:
            raise ValueError(f"--cpus-per-node {cpus_per_node:g} is more than the {cpus} CPU(s) given to Ray (--cpus): "
                             "no virtual SuperNode could ever run")
        if gpus_per_node > 0:
            import torch

            have = torch.cuda.device_count()
            if have == 0:
                raise ValueError(f"--gpus-per-node {gpus_per_node:g} but this machine has no CUDA device")
            if gpus_per_node > have:
                raise ValueError(f"--gpus-per-node {gpus_per_node:g}: this machine has {have} GPU(s)")
        init["num_cpus"] = cpus
        # a Ray instance of its own: without an address Ray joins the cluster last started on this machine by
        # `ray start` (/tmp/ray/ray_current_cluster), whose resources it may not set (num_cpus: a crash)
        init["address"] = "local"
    return {"client_resources": {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node}, "init_args": init}


def simulate(cfg_text: str, num_clients: int = 0, out: str | Path = "", cpus: int = 1,
             round_timeout: float = 600.0, nodes: int = 0, cpus_per_node: float = 1.0, gpus_per_node: float = 0.0,
             ray_address: str = "", overwrite: bool = False) -> RunResult:
    """Run the experiment ``cfg_text`` (TOML) over Flower's simulation engine with ``nodes`` virtual
    SuperNodes (0: one per seen client), each with the resources ``backend_config`` gives it; returns its
    ``RunResult``.  ``out`` (a run directory): its checkpoint is continued, its results without one refused, unless
    ``overwrite`` (the ServerApp's ``fedmtl-overwrite``)."""
    from flwr.simulation import run_simulation

    cfg = config_from_text(cfg_text)
    n = cfg.build_data().seen.num_clients
    if num_clients and num_clients != n:
        raise ValueError(f"--clients {num_clients}: the config's federation has {n} seen clients (one SuperNode each)")
    if not 0 <= nodes <= n:
        raise ValueError(f"--nodes {nodes}: between 1 and the federation's {n} seen clients (0: one per client)")
    if gpus_per_node > 0 and not cfg.run.device.startswith("cuda"):
        raise ValueError(f"--gpus-per-node {gpus_per_node:g} with run.device = {cfg.run.device!r}: the nodes would "
                         "reserve GPUs and compute on the CPU (--device cuda, or --set run.device=cuda)")
    backend = backend_config(cpus, cpus_per_node, gpus_per_node, ray_address)
    nodes = nodes or n
    if cfg.flower.secure_aggregation:
        try:
            cfg.flower.protocol(nodes)  # enough nodes for SecAgg+, no overflow: refused before Ray starts
        except ValueError as e:
            raise ValueError(f"--nodes {nodes}: {e}") from None
    result: dict[str, Any] = {}
    opts = ServerOptions(out=str(out), num_nodes=nodes, round_timeout=round_timeout, overwrite=overwrite)
    run_simulation(make_server_app(cfg_text, opts, result), make_client_app(cfg_text, mods=[secure_mod]),
                   num_supernodes=nodes, backend_config=backend)
    if "result" not in result:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return result["result"]
