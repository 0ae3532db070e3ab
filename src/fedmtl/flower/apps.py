"""fedmtl algorithms as a Flower ``ServerApp`` and ``ClientApp`` (Flower >= 1.41, Message API).

The same algorithm functions as the in-process simulator run here:

* **ServerApp** (``server_main``): asks every SuperNode which partition it holds (``query``), then runs the
  algorithm's own round loop — fedmtl's client sampling with the simulator's generator, ``payload``,
  ``aggregate`` — sending one ``train`` message per sampled client and an ``evaluate`` message to every
  client at the end.  Flower's built-in strategies are not used: they cannot carry several models per
  reply (FedEM's M components travel as stacked named arrays, see ``records``).
* **ClientApp**: the node with ``partition-id`` k builds the experiment's federation from the config (same
  seed, so the same partition), keeps its client state (FedEM's pi, pFedMe's theta, Ditto's personal
  model) in the node's persistent ``context.state`` (and, with ``FEDMTL_FLOWER_STATE_DIR`` set, in a file
  so a restarted run finds it), and runs ``client_update`` on exactly the batches the simulator would give
  it: the server sends the sampled clients' training counts and the client's position, the client draws the
  round's orders from the simulator's generator.  Node ids never pass through floating point.
* **Failures**: a reply that carries an error, never arrives within ``round_timeout`` seconds, or holds
  NaN/Inf is a dropped client for that round (MOCHA's drop-out model): the round aggregates the replies it
  has, logs and counts the drop.  The server checkpoints after every round (``checkpoint.pt`` in the
  output directory) and a restarted server resumes from it.

Decentralized methods (D-FedEM, D-SGD) gossip between neighbours; Flower is hub-and-spoke, so they are
not offered here yet (``server_main`` refuses them with a clear error): a server-relayed version has to
ship every client's state through the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import tree as T
from ..algorithms.base import Algorithm
from ..algorithms.base import Context as AlgContext
from ..config import ExperimentConfig, validate
from ..data.federated import Orders, Split, epoch_orders, round_batches
from ..evaluation import summarize
from ..simulate import round_generator, sample_clients
from .records import from_record, record_to_tree, to_config, to_metrics, tree_to_record

log = logging.getLogger("fedmtl")
STATE_KEY = "fedmtl.client_state"


def config_from_text(text: str, source: str = "<flower run config>") -> ExperimentConfig:
    import tomllib

    return validate(tomllib.loads(text), source)


# ---------------------------------------------------------------------------------------------- client
@dataclass
class _Runtime:
    cfg: ExperimentConfig
    data: Any
    model: Any
    alg: Algorithm
    server0: Any
    clients0: Any  # every client's initial state (stacked), computed once


_RUNTIMES: dict[str, _Runtime] = {}


def runtime(cfg_text: str) -> _Runtime:
    """The node's dataset, model and algorithm, built once per process and config."""
    key = hashlib.sha256(cfg_text.encode()).hexdigest()
    if key not in _RUNTIMES:
        cfg = config_from_text(cfg_text)
        data = cfg.build_data()
        model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
        alg = cfg.build_algorithm()
        ctx = _alg_ctx(cfg, model, data.seen.num_clients, float(data.seen.train.counts.sum()))
        server0 = alg.init_server(ctx, model.init(cfg.run.seed), cfg.run.seed)
        _RUNTIMES[key] = _Runtime(cfg, data, model, alg, server0, alg.init_clients(ctx, server0))
    return _RUNTIMES[key]


def _alg_ctx(cfg: ExperimentConfig, model: Any, num_clients: int, total_train: float) -> AlgContext:
    return AlgContext(model, cfg.optim, num_clients, total_train, cfg.run.local_epochs)


def _client_split(split: Split, k: int) -> Split:
    x, y = split.client(k)
    return Split(x, y, torch.tensor([0, len(y)], dtype=torch.long))


def _state_file(cfg_text: str, k: int) -> Path | None:
    root = os.environ.get("FEDMTL_FLOWER_STATE_DIR")
    if not root:
        return None
    return Path(root) / f"{hashlib.sha256(cfg_text.encode()).hexdigest()[:16]}_client{k}.pt"


def _load_state(rt: _Runtime, context: Context, cfg_text: str, k: int) -> Any:
    template = T.take(rt.clients0, k)
    if f"{STATE_KEY}.{k}" in context.state:
        rec = context.state[f"{STATE_KEY}.{k}"]
        assert isinstance(rec, ArrayRecord)
        return record_to_tree(rec, template)
    f = _state_file(cfg_text, k)
    if f is not None and f.exists():
        return torch.load(f, weights_only=False)
    return template


def _save_state(state: Any, context: Context, cfg_text: str, k: int) -> None:
    if not T.leaves(state):
        return
    context.state[f"{STATE_KEY}.{k}"] = tree_to_record(state)
    f = _state_file(cfg_text, k)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(f)


def _partitions(context: Context) -> list[int]:
    """The clients this SuperNode serves: node config ``partition-id=K`` (one client, Flower's convention)
    or ``partition-ids="A-B"`` / ``"A,B,C"`` (several clients on one machine)."""
    nc = context.node_config
    if "partition-ids" in nc:
        out: list[int] = []
        for part in str(nc["partition-ids"]).split(","):
            a, _, b = part.strip().partition("-")
            out += list(range(int(a), int(b) + 1)) if b else [int(a)]
        return out
    if "partition-id" not in nc:
        raise ValueError("this SuperNode has no node config 'partition-id' (start it with "
                         "--node-config 'partition-id=K num-partitions=N')")
    return [int(nc["partition-id"])]


def _client_of(msg: Message, context: Context) -> int:
    k = int(from_record(msg.content["config"])["client"])  # type: ignore[arg-type]
    if k not in _partitions(context):
        raise ValueError(f"message for client {k} reached a SuperNode serving partitions {_partitions(context)[:8]}")
    return k


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
        "config_sha": hashlib.sha256(cfg_text.encode()).hexdigest(),
        "feature_shape": list(d.feature_shape), "num_classes": d.num_classes,
        "meta": json.dumps(d.meta, default=str),
    })
    return Message(RecordDict({"info": info}), reply_to=msg)


def handle_train(msg: Message, context: Context, cfg_text: str) -> Message:
    rt = runtime(cfg_text)
    k = _client_of(msg, context)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    r = int(conf["round"])
    _maybe_fail(k, r)
    cfg = rt.cfg
    ctx = _alg_ctx(cfg, rt.model, int(conf["num_clients"]), float(conf["total_train"]))
    payload = record_to_tree(msg.content["payload"], rt.alg.payload(rt.server0))  # type: ignore[arg-type]
    state = _load_state(rt, context, cfg_text, k)
    counts = torch.tensor(conf["sampled_counts"], dtype=torch.long)
    orders = epoch_orders(counts, cfg.run.local_epochs, round_generator(cfg.run.seed, r, 2))
    pos = int(conf["position"])
    s, e = int(orders.starts[pos]), int(orders.starts[pos + 1])
    one = Orders(orders.local[:, s:e], torch.tensor([0, e - s]))
    split = _client_split(rt.data.seen.train, k)
    b = round_batches(split, torch.tensor([0]), one, torch.tensor([0]), cfg.run.batch_size)
    batches = T.take(b, 0)
    update, new_state, loss = rt.alg.client_update(ctx, payload, state, batches, float(conf["lr"]))
    ok = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(x).all()) for x in T.leaves(update))
    ok = ok and all(bool(torch.isfinite(x).all()) for x in T.leaves(new_state))
    if ok:  # a client never keeps a state whose update the server will reject
        _save_state(new_state, context, cfg_text, k)
    content = RecordDict({
        "update": tree_to_record(update),
        "metrics": to_metrics({"loss": float(loss), "n": int(split.counts[0]), "finite": int(ok), "client": k}),
    })
    return Message(content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context, cfg_text: str) -> Message:
    rt = runtime(cfg_text)
    k = _client_of(msg, context)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    cfg, alg = rt.cfg, rt.alg
    ctx = _alg_ctx(cfg, rt.model, int(conf["num_clients"]), float(conf["total_train"]))
    payload = record_to_tree(msg.content["payload"], alg.payload(rt.server0))  # type: ignore[arg-type]
    state = _load_state(rt, context, cfg_text, k)
    batches = None
    if alg.needs_adaptation:  # the simulator's adaptation orders: one generator over all seen clients
        g = torch.Generator().manual_seed(int(cfg.run.seed) * 7919 + int(conf["round"]) * 104729)
        orders = epoch_orders(torch.tensor(conf["all_train_counts"]), alg.adapt_epochs, g)
        s, e = int(orders.starts[k]), int(orders.starts[k + 1])
        one = Orders(orders.local[:, s:e], torch.tensor([0, e - s]))
        b = round_batches(_client_split(rt.data.seen.train, k), torch.tensor([0]), one, torch.tensor([0]),
                          cfg.run.batch_size)
        batches = T.take(b, 0)
    es = alg.personalize(ctx, payload, state, batches, float(conf["lr"]), True)
    out: dict[str, Any] = {"client": k}
    for name, split in rt.data.seen.splits().items():
        x, y = split.client(k)
        out[f"{name}_n"] = len(y)
        if len(y) == 0:
            out[f"{name}_correct"], out[f"{name}_nll"] = 0.0, 0.0
            continue
        logp = alg.predict_log_proba(ctx, es, x)
        nll = -torch.gather(logp, -1, y.unsqueeze(-1)).squeeze(-1)
        out[f"{name}_correct"] = float((logp.argmax(-1) == y).double().sum())
        out[f"{name}_nll"] = float(torch.nan_to_num(nll.double(), nan=float("inf")).sum())
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
    out: str = ""  # run directory (summary.json, history.json, checkpoint.pt); "" = none
    num_nodes: int = 0  # SuperNodes to wait for (0 = the federation's number of seen clients)
    round_timeout: float = 600.0
    connect_timeout: float = 300.0


def _discover(grid: Any, want: int | None, timeout: float) -> dict[int, dict[str, Any]]:
    """partition id -> {node_id, info} for every connected SuperNode."""
    t0 = time.time()
    while True:
        nodes = list(grid.get_node_ids())
        if want is not None and len(nodes) >= want:
            break
        if want is None and nodes:
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


def server_main(grid: Any, cfg_text: str, opts: ServerOptions) -> dict[str, Any]:
    cfg = config_from_text(cfg_text)
    alg = cfg.build_algorithm()
    if type(alg).post_round is not Algorithm.post_round:
        raise ValueError(f"algorithm {alg.name!r} gossips between neighbours after each round; Flower runs are "
                         "hub-and-spoke and this method is not offered over Flower yet")
    want = opts.num_nodes or None
    nodes = _discover(grid, want, opts.connect_timeout)
    first = next(iter(nodes.values()))
    n_clients = int(first["num_clients"])
    counts_all = torch.tensor(first["all_train_counts"], dtype=torch.long)
    sha = first["config_sha"]
    if any(v["config_sha"] != sha for v in nodes.values()):
        raise RuntimeError("SuperNodes run different experiment configs")
    missing = sorted(set(range(n_clients)) - set(nodes))
    if missing:
        raise RuntimeError(f"no SuperNode holds partition(s) {missing[:10]} (of {n_clients})")
    # the model skeleton from what the nodes report: the server never reads client data
    model = cfg.build_model(tuple(first["feature_shape"]), int(first["num_classes"]), json.loads(first["meta"]))
    total = float(counts_all.sum())
    ctx = _alg_ctx(cfg, model, n_clients, total)
    out = Path(opts.out) if opts.out else None
    ck = out / "checkpoint.pt" if out else None
    server = alg.init_server(ctx, model.init(cfg.run.seed), cfg.run.seed)
    template = alg.payload(server)  # the shape every update has
    history: list[dict[str, Any]] = []
    counters = {"dropped_updates": 0}
    start = 0
    if ck is not None and ck.exists():
        saved = torch.load(ck, weights_only=False)
        if saved["config_sha"] != sha:
            raise RuntimeError(f"{ck} was written by a different config")
        server, history, counters, start = saved["server"], saved["history"], saved["counters"], saved["round"]
        log.info("flower server: resuming from round %d", start)
    for r in range(start, cfg.run.rounds):
        t0 = time.perf_counter()
        clients = sample_clients(cfg.run, n_clients, r)
        lr = cfg.optim.lr_at(r, cfg.run.rounds)
        payload = alg.payload(server)
        prec = tree_to_record(payload)
        counts = counts_all[clients]
        msgs = []
        for i, k in enumerate(clients.tolist()):
            conf = to_config({"round": r, "lr": lr, "client": k, "position": i, "sampled_counts": counts.tolist(),
                              "num_clients": n_clients, "total_train": total})
            msgs.append(Message(RecordDict({"payload": prec, "config": conf}), dst_node_id=nodes[k]["node_id"],
                                message_type="train", group_id=str(r)))
        position = {k: i for i, k in enumerate(clients.tolist())}
        replies = list(grid.send_and_receive(msgs, timeout=opts.round_timeout))
        updates: list[Any] = [None] * len(msgs)
        losses = np.full(len(msgs), np.nan)
        for rep in replies:
            if rep.has_error():
                log.warning("round %d: a client on node %s failed: %s", r, rep.metadata.src_node_id,
                            rep.error.reason[:200])
                continue
            met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
            i = position.get(int(met.get("client", -1)))
            if i is None:
                continue
            if not met.get("finite", 1):
                continue
            try:
                updates[i] = record_to_tree(rep.content["update"], template)  # type: ignore[arg-type]
            except ValueError as e:
                log.warning("round %d: client %d sent a malformed update: %s", r, int(clients[i]), e)
                continue
            losses[i] = float(met["loss"])
        valid = torch.tensor([u is not None for u in updates])
        dropped = int((~valid).sum())
        if dropped:
            counters["dropped_updates"] += dropped
            log.warning("round %d: %d of %d sampled clients dropped (error, timeout or NaN)", r, dropped, len(msgs))
        if bool(valid.any()):
            ref = next(u for u in updates if u is not None)
            stacked = T.stack([u if u is not None else T.zeros_like(ref) for u in updates])
            weights = counts.to(torch.float64) * valid.to(torch.float64)
            server = alg.aggregate(ctx, server, stacked, weights, clients)
        ok = losses[~np.isnan(losses)]
        history.append({"round": r + 1, "lr": lr, "clients": len(msgs), "dropped": dropped,
                        "train_loss": float(ok.mean()) if ok.size else float("nan"),
                        "seconds": time.perf_counter() - t0})
        if ck is not None:
            ck.parent.mkdir(parents=True, exist_ok=True)
            tmp = ck.with_suffix(".tmp")
            torch.save({"server": server, "history": history, "counters": counters, "round": r + 1,
                        "config_sha": sha}, tmp)
            tmp.replace(ck)
    per_client = evaluate_all(grid, alg, server, nodes, cfg, n_clients, total, counts_all, opts)
    final = summarize({"seen": per_client})
    summary = {"final": final, "rounds": cfg.run.rounds, "history": history, "counters": counters,
               "server": server}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "server"},
                                                     indent=2, default=float))
        torch.save(server, out / "server.pt")
    return summary


def evaluate_all(grid: Any, alg: Algorithm, server: Any, nodes: dict[int, dict[str, Any]], cfg: ExperimentConfig,
                 n_clients: int, total: float, counts_all: torch.Tensor, opts: ServerOptions) -> dict[str, Any]:
    prec = tree_to_record(alg.payload(server))
    r = cfg.run.rounds
    base = {"round": r, "lr": cfg.optim.lr_at(max(r - 1, 0), r), "num_clients": n_clients, "total_train": total,
            "all_train_counts": counts_all.tolist()}
    msgs = [Message(RecordDict({"payload": prec, "config": to_config({**base, "client": k})}),
                    dst_node_id=nodes[k]["node_id"],
                    message_type="evaluate", group_id="eval") for k in range(n_clients)]
    res: dict[int, dict[str, Any]] = {}
    for rep in grid.send_and_receive(msgs, timeout=opts.round_timeout):
        if rep.has_error():
            log.warning("evaluation failed on node %s: %s", rep.metadata.src_node_id, rep.error.reason[:200])
            continue
        met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
        res[int(met.pop("client"))] = met
    names = sorted({key.rsplit("_", 1)[0] for m in res.values() for key in m})
    out: dict[str, Any] = {}
    for name in names:
        n = np.array([res[k][f"{name}_n"] if k in res else 0 for k in range(n_clients)], dtype=float)
        c = np.array([res[k][f"{name}_correct"] if k in res else 0 for k in range(n_clients)], dtype=float)
        nll = np.array([res[k][f"{name}_nll"] if k in res else 0 for k in range(n_clients)], dtype=float)
        safe = np.maximum(n, 1)
        out[name] = {"acc": c / safe, "loss": nll / safe, "n": n}
    return out


def make_server_app(cfg_text: str | None = None, opts: ServerOptions | None = None,
                    result: dict[str, Any] | None = None) -> Any:
    """A ``ServerApp``; without ``cfg_text`` the config (and ``out``) come from the run config keys
    ``fedmtl-config`` / ``fedmtl-out``.  ``result`` (a dict) receives the summary in-process."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def _main(grid: Any, context: Context) -> None:
        text = cfg_text if cfg_text is not None else str(context.run_config["fedmtl-config"])
        o = opts or ServerOptions(out=str(context.run_config.get("fedmtl-out", "")),
                                  num_nodes=int(context.run_config.get("fedmtl-num-nodes", 0)))
        summary = server_main(grid, text, o)
        if result is not None:
            result.update(summary)

    return app


__all__ = ["ConfigRecord", "MetricRecord", "ServerOptions", "make_client_app", "make_server_app", "server_main"]
