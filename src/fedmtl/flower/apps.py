"""fedmtl algorithms as a Flower ``ServerApp`` and ``ClientApp`` (Flower >= 1.41, Message API).

* **ServerApp** (``server_main``): asks every SuperNode which clients it serves (``query``), then runs the
  engine's round loop (``fedmtl.engine.round.Engine`` driven by ``fedmtl.engine.driver.drive``) with the
  Flower executor (``executor.FlowerClients``): the same sampling, systems model, NaN exclusion, aggregation,
  evaluation, run directory, checkpoints and resume as ``fedmtl run``.  Flower's built-in strategies are not
  used: they cannot carry several models per reply (FedEM's M components travel as stacked named arrays).
* **ClientApp** (the handlers below): a SuperNode serving client k (``partition-id=k``, or several with
  ``partition-ids="A-B"``) builds the experiment's federation from the config (same seed, so the same
  partition) and runs the engine's ``LocalClients`` over its own clients: ``client_update`` on exactly the
  batches the server's orders describe, with the run's local executor.  Client state (FedEM's pi, Ditto's
  personal model, MOCHA's duals) stays on the node, in its persistent ``context.state`` (and, with
  ``FEDMTL_FLOWER_STATE_DIR`` set, in 0600 files read back without pickle, so a restarted node finds it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict

from .. import tree as T
from ..algorithms.base import Algorithm
from ..algorithms.base import Context as AlgContext
from ..config import ExperimentConfig, validate
from ..engine.clients import LocalClients
from ..engine.driver import RunResult, drive
from ..engine.executors import make_executor
from ..engine.round import Engine, Federation
from ..tree import Tree
from .executor import FlowerClients, orders_of
from .records import from_record, record_to_tree, to_config, to_metrics, tree_to_record

log = logging.getLogger("fedmtl")
STATE_KEY = "fedmtl.client_state"


def config_from_text(text: str, source: str = "<flower run config>") -> ExperimentConfig:
    import tomllib

    return validate(tomllib.loads(text), source)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- client
@dataclass
class _Runtime:
    cfg: ExperimentConfig
    data: Any
    model: Any
    alg: Algorithm
    nodes: dict[tuple[int, ...], tuple[LocalClients, Tree]]  # per set of partitions served: clients, initial server


_RUNTIMES: dict[str, _Runtime] = {}


def runtime(cfg_text: str) -> _Runtime:
    """The node's dataset, model and algorithm, built once per process and config."""
    key = _sha(cfg_text)
    if key not in _RUNTIMES:
        cfg = config_from_text(cfg_text)
        data = cfg.build_data()
        model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
        _RUNTIMES[key] = _Runtime(cfg, data, model, cfg.build_algorithm(), {})
    return _RUNTIMES[key]


def _partitions(context: Context) -> list[int]:
    """The clients this SuperNode serves: node config ``partition-id=K`` (one client, Flower's convention)
    or ``partition-ids="A-B"`` / ``"A,B,C"`` (several clients on one machine)."""
    nc = context.node_config
    if "partition-ids" in nc:
        out: list[int] = []
        for part in str(nc["partition-ids"]).split(","):
            a, _, b = part.strip().partition("-")
            out += list(range(int(a), int(b) + 1)) if b else [int(a)]
        return sorted(set(out))
    if "partition-id" not in nc:
        raise ValueError("this SuperNode has no node config 'partition-id' (start it with "
                         "--node-config 'partition-id=K num-partitions=N')")
    return [int(nc["partition-id"])]


def _node_clients(rt: _Runtime, context: Context, conf: dict[str, Any]) -> tuple[LocalClients, Tree]:
    """This node's clients as ``LocalClients`` (built once per process, their algorithm context from the
    message) and the initial server state (the template of payloads; Ditto's personal models start from it)."""
    ks = tuple(_partitions(context))
    if any(not 0 <= k < rt.data.seen.num_clients for k in ks):
        raise ValueError(f"partition ids {list(ks)[:8]} out of range: the federation has {rt.data.seen.num_clients} "
                         "seen clients")
    if ks not in rt.nodes:
        cfg, dev = rt.cfg, torch.device("cpu")
        ids = torch.tensor(ks, dtype=torch.long)
        lc = LocalClients(rt.alg, rt.data.subset(ids), make_executor(cfg.run.runner, rt.model, dev, cfg.run.chunk_size,
                                                                     cfg.run.bucketing),
                          dev, cfg.run.batch_size, cfg.run.eval_chunk_elems, global_ids=ids)
        ctx = AlgContext(rt.model, cfg.optim, int(conf["num_clients"]), float(conf["total_train"]),
                         int(conf["local_epochs"]), int(conf["rounds"]), int(conf["max_train"]))
        server0 = rt.alg.init_server(ctx, rt.model.init(cfg.run.seed), cfg.run.seed)
        lc.start(ctx, server0)
        rt.nodes[ks] = (lc, server0)
    return rt.nodes[ks]


def _state_file(cfg_text: str, k: int) -> Path | None:
    root = os.environ.get("FEDMTL_FLOWER_STATE_DIR")
    return None if not root else Path(root) / f"{_sha(cfg_text)[:16]}_client{k}.pt"


def _restore(lc: LocalClients, context: Context, cfg_text: str, k: int) -> None:
    """Put client k's saved state (context state, else the state directory) into the node's store."""
    one = T.take(lc.read(torch.tensor([k])), 0)
    if not T.leaves(one):
        return
    saved: Tree = None
    if f"{STATE_KEY}.{k}" in context.state:
        rec = context.state[f"{STATE_KEY}.{k}"]
        assert isinstance(rec, ArrayRecord)
        saved = record_to_tree(rec, one)
    else:
        f = _state_file(cfg_text, k)
        if f is not None and f.exists():
            try:
                saved = T.from_named(torch.load(f, map_location="cpu", weights_only=True), one)
            except Exception as e:  # a corrupt or foreign file: say which, start the client afresh
                log.warning("client %d: ignoring unreadable state file %s (%s)", k, f, e)
    if saved is not None:
        assert lc.store is not None
        lc.store.write(lc.rows_of(torch.tensor([k])), T.stack([saved]))


def _save(lc: LocalClients, context: Context, cfg_text: str, k: int) -> None:
    state = T.take(lc.read(torch.tensor([k])), 0)
    if not T.leaves(state):
        return
    context.state[f"{STATE_KEY}.{k}"] = tree_to_record(state)
    f = _state_file(cfg_text, k)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f".{f.name}.", suffix=".tmp")  # 0600, a unique name
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(T.to_named(state), fh)
            os.replace(tmp, f)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _client_of(msg: Message, context: Context) -> tuple[int, dict[str, Any]]:
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    k = int(conf["client"])
    if k not in _partitions(context):
        raise ValueError(f"message for client {k} reached a SuperNode serving partitions {_partitions(context)[:8]}")
    return k, conf


def _maybe_fail(k: int, rnd: int) -> None:
    """Test hook: FEDMTL_FLOWER_FAIL="k:r,k2:r2" makes client k raise in round r (a crashing device)."""
    spec = os.environ.get("FEDMTL_FLOWER_FAIL", "")
    for item in filter(None, spec.split(",")):
        kk, rr = item.split(":")
        if int(kk) == k and int(rr) == rnd:
            raise RuntimeError(f"client {k} crashed in round {rnd} (FEDMTL_FLOWER_FAIL)")


def handle_query(msg: Message, context: Context, cfg_text: str) -> Message:
    rt = runtime(cfg_text)
    ks = _partitions(context)
    d = rt.data
    if not all(0 <= k < d.seen.num_clients for k in ks):
        raise ValueError(f"partition ids {ks[:8]} out of range: the federation has {d.seen.num_clients} seen clients")
    info = to_config({
        "partition_ids": ks, "num_clients": d.seen.num_clients,
        "all_train_counts": d.seen.train.counts.tolist(),
        "config_sha": _sha(cfg_text),
        "feature_shape": list(d.feature_shape), "feature_dtype": str(d.seen.train.x.dtype).removeprefix("torch."),
        "num_classes": d.num_classes, "meta": json.dumps(d.meta, default=str),
    })
    return Message(RecordDict({"info": info}), reply_to=msg)


def handle_train(msg: Message, context: Context, cfg_text: str) -> Message:
    rt = runtime(cfg_text)
    k, conf = _client_of(msg, context)
    r = int(conf["round"])
    _maybe_fail(k, r)
    lc, server0 = _node_clients(rt, context, conf)
    _restore(lc, context, cfg_text, k)
    payload = record_to_tree(msg.content["payload"], rt.alg.payload(server0), leading=True)  # type: ignore[arg-type]
    out = lc.train(payload, torch.tensor([k]), orders_of(msg.content["order"]), float(conf["lr"]), r)  # type: ignore[arg-type]
    ok = bool(out.ok[0])
    if ok:  # a client never keeps a state whose update the server will reject
        _save(lc, context, cfg_text, k)
    n = int(lc.data.seen.train.counts[int(lc.rows_of(torch.tensor([k]))[0])])
    content = RecordDict({
        "update": tree_to_record(T.take(out.updates, 0)),
        "metrics": to_metrics({"loss": float(out.losses[0]), "n": n, "finite": int(ok), "client": k}),
    })
    return Message(content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context, cfg_text: str) -> Message:
    rt = runtime(cfg_text)
    k, conf = _client_of(msg, context)
    lc, server0 = _node_clients(rt, context, conf)
    _restore(lc, context, cfg_text, k)
    payload = record_to_tree(msg.content["payload"], rt.alg.payload(server0), leading=True)  # type: ignore[arg-type]
    adapt = orders_of(msg.content["order"]) if "order" in msg.content else None  # type: ignore[arg-type]
    res = lc.evaluate("seen", payload, server0, torch.tensor([k]), adapt, float(conf["lr"]))
    out: dict[str, Any] = {"client": k}
    for name, m in res.items():
        n = float(m["n"][0])
        out[f"{name}_n"] = int(n)
        out[f"{name}_correct"] = float(m["acc"][0] * max(n, 1.0))
        out[f"{name}_nll"] = float(m["loss"][0] * max(n, 1.0))
    return Message(RecordDict({"metrics": to_metrics(out)}), reply_to=msg)


def make_client_app(cfg_text: str | None = None) -> Any:
    """A ``ClientApp``; without ``cfg_text`` the config comes from the run config key ``fedmtl-config``."""
    from flwr.clientapp import ClientApp

    app = ClientApp()

    def text(context: Context) -> str:
        return cfg_text if cfg_text is not None else str(context.run_config["fedmtl-config"])

    @app.query()
    def _query(msg: Message, context: Context) -> Message:
        return handle_query(msg, context, text(context))

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, text(context))

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(msg, context, text(context))

    return app


# ---------------------------------------------------------------------------------------------- server
@dataclass
class ServerOptions:
    out: str = ""  # run directory (config.toml, metrics.csv, summary.json, checkpoint.pt); "" = none
    num_nodes: int = 0  # SuperNodes to wait for (0 = any)
    round_timeout: float = 600.0
    connect_timeout: float = 300.0


def _discover(grid: Any, want: int | None, timeout: float) -> dict[int, dict[str, Any]]:
    """client id -> {node_id, info} for every connected SuperNode."""
    t0 = time.time()
    while True:
        nodes = list(grid.get_node_ids())
        if (want is not None and len(nodes) >= want) or (want is None and nodes):
            break
        if time.time() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} SuperNode(s) connected after {timeout:.0f} s (want {want})")
        time.sleep(0.5)
    msgs = [Message(RecordDict({}), dst_node_id=n, message_type="query") for n in nodes]
    out: dict[int, dict[str, Any]] = {}
    for rep in grid.send_and_receive(msgs, timeout=timeout):
        if rep.has_error():
            raise RuntimeError(f"node {rep.metadata.src_node_id} failed the partition query: {rep.error.reason}")
        info = from_record(rep.content["info"])  # type: ignore[arg-type]
        for pid in info["partition_ids"]:
            if pid in out:
                raise RuntimeError(f"two SuperNodes claim partition {pid}")
            out[int(pid)] = {"node_id": int(rep.metadata.src_node_id), **info}
    return out


def server_main(grid: Any, cfg_text: str, opts: ServerOptions) -> RunResult:
    """The ServerApp's main: discover the nodes, then drive the engine with the Flower executor."""
    cfg = config_from_text(cfg_text)
    alg = cfg.build_algorithm()
    nodes = _discover(grid, opts.num_nodes or None, opts.connect_timeout)
    first = next(iter(nodes.values()))
    n_clients = int(first["num_clients"])
    if any(v["config_sha"] != first["config_sha"] for v in nodes.values()):
        raise RuntimeError("SuperNodes run different experiment configs")
    if first["config_sha"] != _sha(cfg_text):
        raise RuntimeError("the SuperNodes run another experiment config than this ServerApp")
    missing = sorted(set(range(n_clients)) - set(nodes))
    if missing:
        raise RuntimeError(f"no SuperNode holds partition(s) {missing[:10]} (of {n_clients})")
    fed = Federation(torch.tensor(first["all_train_counts"], dtype=torch.long), tuple(first["feature_shape"]),
                     int(first["num_classes"]), json.loads(first["meta"]))
    # the model skeleton from what the nodes report: the server never reads client data
    model = cfg.build_model(fed.feature_shape, fed.num_classes, fed.meta)
    dtype = getattr(torch, str(first["feature_dtype"]))
    clients = FlowerClients(grid, {k: v["node_id"] for k, v in nodes.items()}, alg, fed.feature_shape, dtype,
                            opts.round_timeout)
    engine = Engine(alg, model, cfg.optim, cfg.run, clients, fed, cfg.systems)
    out = Path(opts.out) if opts.out else None
    resume = out is not None and (out / "checkpoint.pt").exists()
    if resume:
        log.info("flower server: resuming from %s", out)
    return drive(engine, cfg, out, resume=resume, progress=False)


def make_server_app(cfg_text: str | None = None, opts: ServerOptions | None = None,
                    result: dict[str, Any] | None = None) -> Any:
    """A ``ServerApp``; without ``cfg_text`` the config (and ``out``) come from the run config keys
    ``fedmtl-config`` / ``fedmtl-out``.  ``result`` (a dict) receives the ``RunResult`` under "result"."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def _main(grid: Any, context: Context) -> None:
        text = cfg_text if cfg_text is not None else str(context.run_config["fedmtl-config"])
        o = opts or ServerOptions(out=str(context.run_config.get("fedmtl-out", "")),
                                  num_nodes=int(context.run_config.get("fedmtl-num-nodes", 0)))
        res = server_main(grid, text, o)
        if result is not None:
            result["result"] = res

    return app


__all__ = ["ServerOptions", "make_client_app", "make_server_app", "server_main"]
