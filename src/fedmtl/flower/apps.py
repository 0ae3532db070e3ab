"""fedmtl algorithms as a Flower ``ServerApp`` and ``ClientApp`` (Flower >= 1.42, Message API).

* **ServerApp** (``server_main``): asks every SuperNode which clients it serves and what their data looks like
  (``query``: client ids, training-set sizes, feature shape and dtype, classes and the dataset's public metadata,
  ``fedmtl.data.federated.public_meta``; never data), refuses nodes that disagree, then runs the engine's round
  loop (``fedmtl.engine.round.Engine`` driven by ``fedmtl.runs.driver.drive``) with the Flower executor
  (``executor.FlowerClients``): the same sampling, systems model, NaN exclusion, aggregation, evaluation, run
  directory, checkpoints and resume as ``fedmtl run``.  The run directory (run config ``fedmtl-out``) is locked
  for the whole run (``fedmtl.runs.rundir.RunDirectory``): a second ServerApp writing it is refused, naming the
  directory and the lock's owner; a directory holding a checkpoint is resumed, one holding results without a
  checkpoint is refused unless the run config sets ``fedmtl-overwrite = true``.
  Flower's built-in strategies are not used: they cannot carry several models per reply (FedEM's M components
  travel as stacked named arrays) nor several clients per message.
* **ClientApp** (the handlers below): a SuperNode serves one or many clients.  Its data is either
  *node-local* (node config ``data-dir=/path``: one ``client_<k>.npz`` per client, ``fedmtl.data.npz``) or, for
  trying things out, rebuilt from the experiment config (``partition-id=K`` or ``partition-ids="A-B"``: the same
  seed gives the same federation, of which the node keeps its share).  Per round the node gets *one* ``train``
  message for all of its sampled clients and runs them with the engine's ``LocalClients`` and local executor
  (vmap or loop, as ``run.runner`` says), on exactly the batches the server's orders describe.  Client state
  (FedEM's pi, Ditto's personal models, MOCHA's duals, D-FedEM's models) stays on the node: in the run's
  ``context.state`` and, with node config ``state-dir=/path`` (or ``FEDMTL_FLOWER_STATE_DIR``), in 0600 files
  read back without pickle, so a restarted node or a resumed run finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm
from ..algorithms.base import Context as AlgContext
from ..config import ExperimentConfig, validate
from ..data.federated import FederatedData, public_meta
from ..engine.clients import LocalClients
from ..engine.executors import make_executor
from ..engine.round import Engine, Federation
from ..files import atomic, check_file
from ..models.base import Model
from ..models.stacking import compiled
from ..ranges import parse_ids
from ..runs.driver import RunResult, drive
from ..runs.progress import Progress, format_row
from ..runs.rundir import RunDirectory, RunDirError
from ..schema import shown
from ..tree import Tree
from .executor import FlowerClients, context_config, orders_of, send_and_receive
from .records import from_record, record_to_tree, to_config, to_metrics, tree_to_record

log = logging.getLogger("fedmtl")
STATE_KEY = "fedmtl.client_states"


def config_from_text(text: str, source: str = "run config fedmtl-config") -> ExperimentConfig:
    """The experiment a run config carries (its key ``fedmtl-config``: the TOML text); a text that is no valid
    experiment is a ``ConfigError`` naming the key."""
    import tomllib

    from ..config import MAX_CONFIG_BYTES, MAX_NESTING, ConfigError, max_nesting

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: {len(text)} characters; a config is at most {MAX_CONFIG_BYTES} bytes")
    if max_nesting(text) > MAX_NESTING:
        raise ConfigError(f"{source}: arrays or inline tables nested deeper than {MAX_NESTING}")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    return validate(raw, source)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- client
@dataclass
class _Node:
    """What one SuperNode serves: its clients' data and federation-wide ids, the model and the algorithm."""

    cfg: ExperimentConfig
    alg: Algorithm
    model: Model
    data: FederatedData  # this node's clients only (seen, in id order)
    ids: Tensor  # (K,) long, sorted: their federation-wide ids
    source: str  # "data-dir" or "config"
    clients: dict[tuple[Any, ...], tuple[LocalClients, Tree]] = field(default_factory=dict)


class NodeCache:
    """The nodes one run's ClientApp serves in this process, built once per config and node config and kept warm
    across the messages of that run."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[tuple[str, str], bool], _Node] = {}


class RunCaches:
    """A ``NodeCache`` per run id, the ``keep`` most recent runs.  Flower's simulation engine (1.42) builds the
    ClientApp anew for every message inside a long-lived Ray actor, so a cache owned by the app would be empty at
    every message (each train message would build the node's data again); one instance of this class per process
    (``PROCESS_RUNS``) keeps it warm.  Keyed by run id: a new run, a resumed server included, never sees another
    run's client states, as a fresh ClientApp process would not."""

    def __init__(self, keep: int = 2) -> None:
        from collections import OrderedDict

        self.keep = keep
        self.runs: OrderedDict[int, NodeCache] = OrderedDict()

    def of(self, run_id: int) -> NodeCache:
        if run_id not in self.runs:
            self.runs[run_id] = NodeCache()
            while len(self.runs) > self.keep:
                self.runs.popitem(last=False)
        self.runs.move_to_end(run_id)
        return self.runs[run_id]


#: this process's warm nodes by run (see ``RunCaches``); what a long-lived Flower worker process keeps
PROCESS_RUNS = RunCaches()


def process_nodes(run_id: int) -> NodeCache:
    """This process's warm nodes of run ``run_id``.  (A module-level function: Ray ships the ClientApp's closures
    by value with copies of the globals they name, so the app must reach ``PROCESS_RUNS`` through a function
    that is imported, not copied.)"""
    return PROCESS_RUNS.of(run_id)


def _node_int(nc: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """Node config ``key`` as an integer in ``[lo, hi]`` (an int, or its digits as a string); else a one-line
    ``ValueError`` naming the key and echoing the value cut short."""
    v = nc[key]
    if isinstance(v, str) and re.fullmatch(r"\s*[0-9]{1,19}\s*", v):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"node config {key}={shown(v)}: expected an integer in {lo}-{hi}")
    return v


def node_clients(nc: dict[str, Any], n: int) -> list[int]:
    """The federation-wide ids of the clients a node serves from its node config, checked against the federation's
    ``n`` seen clients before any list is built (``fedmtl.ranges``): ``partition-ids="A-B,C"``, or Flower's
    ``partition-id=p`` (with ``num-partitions=P``: the p-th of P contiguous blocks; P = N: client p alone)."""
    if "partition-ids" in nc:
        return parse_ids(str(nc["partition-ids"]), n, "node config partition-ids")
    if "partition-id" in nc:
        parts = _node_int(nc, "num-partitions", 1, n) if "num-partitions" in nc else n
        p = _node_int(nc, "partition-id", 0, parts - 1)
        return list(range(p * n // parts, (p + 1) * n // parts))
    raise ValueError("this SuperNode has no data: start it with --node-config \"data-dir=/path\" (its "
                     "clients' .npz files) or 'partition-ids=\"A-B\"' (a share of the config's federation)")


def node_of(nodes: NodeCache, context: Context, cfg_text: str, full: bool = True) -> _Node:
    """The node's data, model and algorithm, built once per app (``nodes``), config and node config.  ``full=False``
    (training, gossip, queries) may skip reading the test and validation splits of a ``data-dir``: Flower
    starts a process per message, so each message reads only what it needs."""
    nc = dict(context.node_config)
    key = (_sha(cfg_text), json.dumps({k: str(v) for k, v in sorted(nc.items())}))
    for k in ((key, True),) if full else ((key, True), (key, False)):
        if k in nodes.nodes:
            return nodes.nodes[k]
    cfg = config_from_text(cfg_text)
    if "data-dir" in nc:
        from ..data.npz import load_dir

        ids, data = load_dir(str(nc["data-dir"]), train_only=not full)
        source = "data-dir"
    else:
        whole = cfg.build_data()
        n = whole.seen.num_clients
        ks = node_clients(nc, n)
        ids = torch.tensor(ks, dtype=torch.long)
        data, source = whole.subset(ids), "config"
    model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    model.check_features(data.seen.train.x[:6])
    model = compiled(model, cfg.run.compile, cfg.run.device)
    node = nodes.nodes[key, full or source == "config"] = _Node(cfg, cfg.build_algorithm(), model, data, ids, source)
    return node


def _alg_context(node: _Node, conf: dict[str, Any]) -> AlgContext:
    return AlgContext(node.model, node.cfg.optim, int(conf["num_clients"]), float(conf["total_train"]),
                      int(conf["local_epochs"]), int(conf["rounds"]), int(conf["max_train"]))


def _local_clients(node: _Node, conf: dict[str, Any]) -> tuple[LocalClients, Tree]:
    """The node's clients as ``LocalClients`` (their algorithm context from the message) and the initial
    server state (the template of payloads; Ditto's personal models and D-FedEM's mixing come from it)."""
    ctx = _alg_context(node, conf)
    key = tuple(context_config(ctx).values())
    if key not in node.clients:
        cfg, dev = node.cfg, torch.device("cpu")
        lc = LocalClients(node.alg, node.data, make_executor(cfg.run.runner, node.model, dev, cfg.run.chunk_size,
                                                             cfg.run.bucketing),
                          dev, cfg.run.batch_size, cfg.run.eval_chunk_elems, global_ids=node.ids,
                          drop_last=cfg.run.drop_last)
        server0 = node.alg.init_server(ctx, node.model.start(cfg.run.seed), cfg.run.seed)
        lc.start(ctx, server0)
        node.clients[key] = (lc, server0)
    return node.clients[key]


def _state_dir(context: Context) -> Path | None:
    root = context.node_config.get("state-dir") or os.environ.get("FEDMTL_FLOWER_STATE_DIR")
    return None if not root else Path(str(root))


_VERSION = re.compile(r"client(\d+)\.r(\d+)\.pt")


def _versions(d: Path, tag: str, k: int) -> list[tuple[int, Path]]:
    """Saved states of client k in state directory ``d``: (round, file), oldest first."""
    sub = d / tag
    if not sub.is_dir():
        return []
    out = []
    for f in sub.glob(f"client{k}.r*.pt"):
        m = _VERSION.fullmatch(f.name)
        if m and int(m.group(1)) == k:
            out.append((int(m.group(2)), f))
    return sorted(out)


def _restore(node: _Node, lc: LocalClients, context: Context, cfg_text: str, before: int) -> None:
    """Put the node's clients' saved states into its store: the run's ``context.state`` (one stacked record),
    else, client by client, the newest state file written before round ``before`` (a resumed run never sees
    a state from rounds after its checkpoint)."""
    assert lc.store is not None
    if not lc.store.leaves:
        return
    template = lc.read(node.ids[:1])
    if STATE_KEY in context.state:
        rec = context.state[STATE_KEY]
        assert isinstance(rec, ArrayRecord)
        saved = record_to_tree(rec, template, leading=True)
        lc.store.write(torch.arange(len(node.ids)), saved)
        return
    d = _state_dir(context)
    if d is None:
        return
    one = T.take(template, 0)
    # a client's state file holds its tensors and a few bytes of framing: a file much larger is not one (checked
    # before it is read)
    limit = 2 * sum(int(x.numel()) * x.element_size() for x in T.leaves(one)) + (1 << 20)
    for row, k in enumerate(node.ids.tolist()):
        for rnd, f in reversed(_versions(d, _sha(cfg_text)[:16], k)):
            if rnd >= before:
                continue
            try:
                check_file(f, limit, "client state")  # kind and size before reading: never a FIFO or a device
                got = torch.load(f, map_location="cpu", weights_only=True)
                state = T.from_named(got["state"], one)
                if not all(bool(torch.isfinite(x).all()) for x in T.leaves(state) if x.is_floating_point()):
                    raise ValueError("it holds NaN or Inf")
            except Exception as e:  # a corrupt, foreign or non-finite file: say which, try the older one
                log.warning("client %d: ignoring unusable state file %s (%s)", k, f, e)
                continue
            lc.store.write(torch.tensor([row]), T.stack([state]))
            break


def _save(node: _Node, lc: LocalClients, context: Context, cfg_text: str, rows: Tensor, rnd: int) -> None:
    """Keep the node's client states: all of them in ``context.state``; the clients ``rows`` (written in round
    ``rnd``) in the state directory, 0600 files through unique temporary names, keeping the versions a resume
    from the last ``checkpoint_every`` rounds may need."""
    assert lc.store is not None
    if not lc.store.leaves:
        return
    context.state[STATE_KEY] = tree_to_record(lc.read(node.ids))
    d = _state_dir(context)
    if d is None or not rows.numel():
        return
    tag = _sha(cfg_text)[:16]
    sub = d / tag
    sub.mkdir(parents=True, exist_ok=True, mode=0o700)
    keep = max(node.cfg.run.checkpoint_every, 1)
    states = lc.store.read(rows)
    for i, row in enumerate(rows.tolist()):
        k = int(node.ids[row])
        f = sub / f"client{k}.r{rnd}.pt"
        with atomic(f, "wb", private=True) as fh:  # 0600 from its first byte, whole or not at all
            torch.save({"round": rnd, "state": T.to_named(T.take(states, i))}, fh)
        # a resume restarts at the last checkpoint, at most `keep` rounds back, and reads the newest version
        # written before it: keep every version since round rnd + 1 - keep and the newest one before
        for _, stale in [v for v in _versions(d, tag, k) if v[0] < rnd + 1 - keep][:-1]:
            stale.unlink(missing_ok=True)


def _maybe_fail(ks: list[int], rnd: int) -> None:
    """Test hook: FEDMTL_FLOWER_FAIL="k:r,k2:r2" makes the node serving client k fail in round r (a crash)."""
    spec = os.environ.get("FEDMTL_FLOWER_FAIL", "")
    for item in filter(None, spec.split(",")):
        kk, rr = item.split(":")
        if int(kk) in ks and int(rr) == rnd:
            raise RuntimeError(f"client {kk} crashed in round {rnd} (FEDMTL_FLOWER_FAIL)")


def _asked(node: _Node, conf: dict[str, Any]) -> Tensor:
    ids = torch.tensor([int(k) for k in conf["clients"]], dtype=torch.long)
    held = set(node.ids.tolist())
    stray = [k for k in ids.tolist() if k not in held]
    if stray:
        raise ValueError(f"message for clients {stray[:8]} reached a SuperNode serving {node.ids[:8].tolist()}...")
    return ids


def handle_query(msg: Message, context: Context, cfg_text: str, nodes: NodeCache) -> Message:
    """What the server may know of this node: its clients' ids and training-set sizes, the feature shape and
    dtype, the classes and the dataset's public metadata (``public_meta``: what a model needs and the keys the
    dataset declares public; never a generator's parameters or other clients' attributes); never an example."""
    node = node_of(nodes, context, cfg_text, full=False)
    d = node.data
    info = to_config({
        "client_ids": node.ids.tolist(), "train_counts": d.seen.train.counts.tolist(),
        "config_sha": _sha(cfg_text), "source": node.source,
        "feature_shape": list(d.feature_shape), "feature_dtype": str(d.seen.train.x.dtype).removeprefix("torch."),
        "num_classes": d.num_classes, "meta": json.dumps(public_meta(d.meta, d.name), sort_keys=True),
    })
    return Message(RecordDict({"info": info}), reply_to=msg)


def handle_train(msg: Message, context: Context, cfg_text: str, nodes: NodeCache) -> Message:
    """Train this node's sampled clients (one message per node per round) with the local executor; reply their
    updates stacked in the order asked, their losses and which of them are finite."""
    from . import secagg

    node = node_of(nodes, context, cfg_text, full=False)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    ids, r = _asked(node, conf), int(conf["round"])
    secure = secagg.is_protocol_message(msg)
    if node.cfg.flower.secure_aggregation and not secure:
        raise ValueError("this SuperNode's config sets flower.secure_aggregation = true: it sends updates only "
                         "masked by SecAgg+, and this train message is not part of that protocol")
    _maybe_fail(ids.tolist(), r)
    lc, server0 = _local_clients(node, conf)
    _restore(node, lc, context, cfg_text, r)
    payload = record_to_tree(msg.content["payload"], node.alg.payload(server0), leading=True)  # type: ignore[arg-type]
    if secure and not ids.numel():  # a node without sampled clients masks zeros: every node takes part
        return secagg.node_reply(node.cfg, node.alg, _alg_context(node, conf), server0, payload, None, ids, conf, msg)
    out = lc.train(payload, ids, orders_of(msg.content["order"]), float(conf["lr"]), r)  # type: ignore[arg-type]
    # a client never keeps a state whose update the server will reject (LocalClients writes finite ones only)
    _save(node, lc, context, cfg_text, lc.rows_of(ids[out.ok]), r)
    if secure:
        return secagg.node_reply(node.cfg, node.alg, _alg_context(node, conf), server0, payload, out, ids, conf, msg)
    losses = torch.where(out.ok, out.losses.detach().double().cpu(), torch.zeros(()))
    content = RecordDict({
        "update": tree_to_record(out.updates),
        "metrics": to_metrics({"clients": ids.tolist(), "loss": losses.tolist(),
                               "finite": out.ok.to(torch.long).tolist()}),
    })
    return Message(content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context, cfg_text: str, nodes: NodeCache) -> Message:
    """Score this node's asked clients on their own splits: per client, examples, correct and summed NLL."""
    node = node_of(nodes, context, cfg_text)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    ids = _asked(node, conf)
    lc, server0 = _local_clients(node, conf)
    _restore(node, lc, context, cfg_text, int(conf["round"]))
    payload = record_to_tree(msg.content["payload"], node.alg.payload(server0), leading=True)  # type: ignore[arg-type]
    adapt = orders_of(msg.content["order"]) if "order" in msg.content else None  # type: ignore[arg-type]
    res = lc.evaluate("seen", payload, server0, ids, adapt, float(conf["lr"]))
    out: dict[str, Any] = {"clients": ids.tolist()}
    for name, m in res.items():
        n = torch.as_tensor(m["n"], dtype=torch.float64)
        out[f"{name}_n"] = n.to(torch.long).tolist()
        out[f"{name}_correct"] = (torch.as_tensor(m["acc"], dtype=torch.float64) * n.clamp_min(1)).tolist()
        out[f"{name}_nll"] = (torch.as_tensor(m["loss"], dtype=torch.float64) * n.clamp_min(1)).tolist()
    return Message(RecordDict({"metrics": to_metrics(out)}), reply_to=msg)


def handle_pull(msg: Message, context: Context, cfg_text: str, nodes: NodeCache) -> Message:
    """Server-relayed gossip, step 1: this node's clients' states (all of them), for the server to forward."""
    node = node_of(nodes, context, cfg_text, full=False)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    lc, _ = _local_clients(node, conf)
    _restore(node, lc, context, cfg_text, int(conf["round"]) + 1)
    return Message(RecordDict({"states": tree_to_record(lc.read(node.ids)),
                               "config": to_config({"clients": node.ids.tolist()})}), reply_to=msg)


def handle_mix(msg: Message, context: Context, cfg_text: str, nodes: NodeCache) -> Message:
    """Server-relayed gossip, step 2: mix this node's clients with the neighbours' states the server forwarded
    (``alg.sync`` over a population whose other rows are zeros: row i of a gossip step reads only i's
    neighbours, so this node's rows equal a simulation's).  Replies the sum of its clients' new states."""
    node = node_of(nodes, context, cfg_text, full=False)
    conf = from_record(msg.content["config"])  # type: ignore[arg-type]
    lc, server0 = _local_clients(node, conf)
    r = int(conf["round"])
    _restore(node, lc, context, cfg_text, r + 1)
    own = lc.read(node.ids)
    n = int(conf["num_clients"])
    full = T.tmap(lambda x: x.new_zeros((n, *x.shape[1:])), own)
    nb_ids = torch.tensor([int(k) for k in conf["neighbours"]], dtype=torch.long)
    if nb_ids.numel():
        nb = record_to_tree(msg.content["neighbours"], own, leading=True)  # type: ignore[arg-type]
        for dst, src in zip(T.leaves(full), T.leaves(nb), strict=True):
            dst.index_copy_(0, nb_ids, src)
    for dst, src in zip(T.leaves(full), T.leaves(own), strict=True):
        dst.index_copy_(0, node.ids, src)
    ctx = _alg_context(node, conf)
    _, mixed = node.alg.sync(ctx, server0, full)
    mine = T.tmap(lambda x: x.index_select(0, node.ids), mixed)
    assert lc.store is not None
    lc.store.write(torch.arange(len(node.ids)), mine, r)
    _save(node, lc, context, cfg_text, torch.arange(len(node.ids)), r)
    return Message(RecordDict({"sum": tree_to_record(T.tmap(lambda x: x.double().sum(0), mine)),
                               "config": to_config({"clients": node.ids.tolist()})}), reply_to=msg)


def make_client_app(cfg_text: str | None = None, runs: RunCaches | None = None, mods: Sequence[Any] = ()) -> Any:
    """A ``ClientApp``; without ``cfg_text`` the config comes from the run config key ``fedmtl-config``.  ``runs``:
    where the app keeps its warm nodes (default: this process's, ``PROCESS_RUNS``).  ``mods``: Flower mods
    around the handlers, e.g. the secure aggregation mod ``relay_app.secure_mod`` (none where another app's mods
    already wrap this one, as in the relay app's in-process fallback)."""
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=list(mods) or None)

    def text(context: Context) -> str:
        return cfg_text if cfg_text is not None else str(context.run_config["fedmtl-config"])

    def nodes(context: Context) -> NodeCache:
        return process_nodes(int(context.run_id)) if runs is None else runs.of(int(context.run_id))

    @app.query()
    def _query(msg: Message, context: Context) -> Message:
        return handle_query(msg, context, text(context), nodes(context))

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, text(context), nodes(context))

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(msg, context, text(context), nodes(context))

    @app.train("pull")
    def _pull(msg: Message, context: Context) -> Message:
        return handle_pull(msg, context, text(context), nodes(context))

    @app.train("mix")
    def _mix(msg: Message, context: Context) -> Message:
        return handle_mix(msg, context, text(context), nodes(context))

    return app


# ---------------------------------------------------------------------------------------------- server
@dataclass
class ServerOptions:
    out: str = ""  # run directory (config.toml, metrics.csv, summary.json, checkpoint.pt); "" = none
    overwrite: bool = False  # replace results in ``out`` that have no checkpoint to resume (else refused)
    num_nodes: int = 0  # SuperNodes to wait for (0 = any)
    round_timeout: float = 600.0
    connect_timeout: float = 300.0


class NodeError(RuntimeError):
    """SuperNodes that cannot form one federation (overlapping or missing clients, disagreeing data)."""


def _discover(grid: Any, want: int | None, timeout: float) -> dict[int, dict[str, Any]]:
    """node id -> what the node reported (``handle_query``), for every connected SuperNode."""
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
    for rep in send_and_receive(grid, msgs, timeout):
        if rep.has_error():
            raise NodeError(f"SuperNode {rep.metadata.src_node_id} could not describe its clients: "
                            f"{(rep.error.reason or '')[:2000]}")
        out[int(rep.metadata.src_node_id)] = from_record(rep.content["info"])  # type: ignore[arg-type]
    if len(out) < len(nodes):
        raise NodeError(f"only {len(out)} of {len(nodes)} SuperNodes answered the query within {timeout:.0f} s")
    return out


def federation_of(infos: dict[int, dict[str, Any]], cfg_text: str) -> tuple[Federation, torch.dtype, dict[int, int]]:
    """The federation the nodes hold together, from their reports only: client id -> node, training-set sizes,
    feature shape and dtype, classes.  Nodes that disagree, overlap or leave ids out are refused by name."""
    ref_node, ref = next(iter(infos.items()))
    for nid, info in infos.items():
        if info["config_sha"] != _sha(cfg_text):
            raise NodeError(f"SuperNode {nid} runs another experiment config than this ServerApp")
        for key, what in (("feature_shape", "feature shape"), ("feature_dtype", "feature dtype"),
                          ("num_classes", "number of classes"), ("meta", "dataset metadata")):
            if info[key] != ref[key]:
                raise NodeError(f"SuperNode {nid} reports {what} {info[key]!r} but SuperNode {ref_node} reports "
                                f"{ref[key]!r}: every node's data must have the same {what}")
    owner: dict[int, int] = {}
    counts: dict[int, int] = {}
    for nid, info in infos.items():
        if len(info["client_ids"]) != len(info["train_counts"]):
            raise NodeError(f"SuperNode {nid} sent {len(info['client_ids'])} ids but {len(info['train_counts'])} sizes")
        for k, c in zip(info["client_ids"], info["train_counts"], strict=True):
            if int(k) in owner:
                raise NodeError(f"SuperNodes {owner[int(k)]} and {nid} both hold client {k}: a client's data lives "
                                "on one node")
            if int(c) < 1:
                raise NodeError(f"SuperNode {nid}: client {k} has no training examples")
            owner[int(k)], counts[int(k)] = nid, int(c)
    n = len(owner)
    missing = sorted(set(range(n)) - set(owner))
    if missing:
        raise NodeError(f"the SuperNodes' clients must be numbered 0..N-1 without gaps: no node holds client(s) "
                        f"{missing[:10]} (ids go up to {max(owner)})")
    try:
        if not isinstance(ref["meta"], str) or len(ref["meta"]) > MAX_META_CHARS:  # before it is parsed
            raise ValueError(f"not a JSON text of at most {MAX_META_CHARS} characters")
        meta = json.loads(ref["meta"])
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        meta = public_meta(meta, f"SuperNode {ref_node}")  # what a model needs, whatever a node sends
    except ValueError as e:
        raise NodeError(f"SuperNode {ref_node} sent unreadable dataset metadata: {e}") from None
    fed = Federation(torch.tensor([counts[k] for k in range(n)], dtype=torch.long), tuple(ref["feature_shape"]),
                     int(ref["num_classes"]), meta)
    return fed, getattr(torch, str(ref["feature_dtype"])), owner


MAX_META_CHARS = 1 << 20  # a node's dataset metadata (public_meta: a model's needs, a few declared keys)


# RunDirectory's hints name fedmtl run's options; a ServerApp's are run config keys
_SERVER_HINTS = (("continue it with resume=True (--resume), replace it with overwrite=True (--overwrite), or choose "
                  "another out directory (--out)",
                  "set fedmtl-overwrite = true in the run config to replace it, or choose another fedmtl-out"),
                 ("replace it with overwrite=True (--overwrite), or choose another out directory (--out)",
                  "set fedmtl-overwrite = true in the run config to replace it, or choose another fedmtl-out"),
                 ("choose another out directory (--out)", "choose another fedmtl-out"))


def lock_run_directory(out: Path, overwrite: bool = False) -> tuple[RunDirectory, bool]:
    """Take the ServerApp's run directory ``out`` for this process (``RunDirectory``'s ``.lock``: host and pid,
    created exclusively, a dead owner's lock taken over): returns the held directory and whether the run
    resumes (``out`` holds ``checkpoint.pt`` and ``overwrite`` is off).  The caller releases it
    (``RunDirectory.release``; entering the returned object again would find its own lock).  A directory
    another run holds, or one that holds results without a checkpoint (unless ``overwrite``), is a one-line
    ``RunDirError`` naming it (and the lock's owner)."""
    resume = not overwrite and (out / "checkpoint.pt").exists()
    rd = RunDirectory(out, resume=resume, overwrite=overwrite)
    try:
        rd.__enter__()
    except RunDirError as e:
        msg = str(e)
        for cli, app in _SERVER_HINTS:
            msg = msg.replace(cli, app)
        raise RunDirError(f"flower ServerApp: {msg}") from None
    return rd, resume


def server_main(grid: Any, cfg_text: str, opts: ServerOptions) -> RunResult:
    """The ServerApp's main: lock the run directory (``lock_run_directory``, before any node is contacted; held
    until this returns or raises, whatever the way out), discover the nodes, then drive the engine with the
    Flower executor (resuming from the directory's checkpoint if it holds one)."""
    cfg = config_from_text(cfg_text)
    alg = cfg.build_algorithm()
    out = Path(opts.out) if opts.out else None
    if out is None:
        return _serve(grid, cfg_text, cfg, alg, opts, None, False)
    rd, resume = lock_run_directory(out, opts.overwrite)
    try:
        if resume:
            Progress("lines").line(f"flower server: resuming from {out}")
        return _serve(grid, cfg_text, cfg, alg, opts, out, resume)
    finally:  # success, error, KeyboardInterrupt: the next ServerApp finds the directory free
        rd.release()


def _serve(grid: Any, cfg_text: str, cfg: ExperimentConfig, alg: Algorithm, opts: ServerOptions, out: Path | None,
           resume: bool) -> RunResult:
    """Discover the nodes, build the engine over them and drive it (the run directory is the caller's)."""
    infos = _discover(grid, opts.num_nodes or None, opts.connect_timeout)
    fed, dtype, owner = federation_of(infos, cfg_text)
    # the ServerApp's log (``flwr log``, ``flwr run --stream``) gets the lines ``fedmtl run`` prints: Flower mirrors
    # the ServerApp process's output there
    prog = Progress("lines")
    prog.line(f"flower server: {len(infos)} SuperNodes hold {fed.num_clients} clients "
              f"({', '.join(sorted({str(i['source']) for i in infos.values()}))})")
    # the model skeleton from what the nodes report: the server never reads client data
    model = cfg.build_model(fed.feature_shape, fed.num_classes, fed.meta)
    clients = FlowerClients(grid, owner, alg, fed.feature_shape, dtype, opts.round_timeout)
    if cfg.flower.secure_aggregation:  # every round's updates are summed by SecAgg+ (fedmtl.flower.secagg)
        from .secagg import SecureRounds

        cfg.flower.protocol(len(infos))  # enough nodes, no overflow: refused before the first round
        clients.secure = SecureRounds(cfg.flower, fed.train_counts, cfg.privacy.enabled, cfg.privacy.clip_norm)
        prog.line(f"flower server: secure aggregation (SecAgg+) over {len(infos)} SuperNodes")
    if cfg.attack.kind == "labelflip" and cfg.attack.active:
        raise NodeError("attack.kind = 'labelflip' poisons the attackers' data, which only a simulation holds")
    engine = Engine(alg, model, clients, fed, cfg.run_spec())
    res = drive(engine, cfg, out, resume=resume, progress=prog)
    s = res.summary
    prog.line(f"flower server: {cfg.algorithm['name']} finished round {s['rounds']}/{cfg.run.rounds}  "
              f"{format_row(s['final'])}  dropped {s['dropped_updates']}  excluded {s['excluded_updates']} update(s) "
              f"in all" + (f"; results in {out}" if out is not None else ""))
    return res


def make_server_app(cfg_text: str | None = None, opts: ServerOptions | None = None,
                    result: dict[str, Any] | None = None) -> Any:
    """A ``ServerApp``; without ``cfg_text`` the config (and ``out``) come from the run config keys
    ``fedmtl-config`` / ``fedmtl-out`` (``fedmtl-num-nodes``, ``fedmtl-overwrite`` optional).  ``result`` (a dict)
    receives the ``RunResult`` under "result"."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def _main(grid: Any, context: Context) -> None:
        text = cfg_text if cfg_text is not None else str(context.run_config["fedmtl-config"])
        o = opts or server_options(dict(context.run_config))
        res = server_main(grid, text, o)
        if result is not None:
            result["result"] = res

    return app




def _flag(v: Any) -> bool:
    """A run config boolean (TOML ``true`` or, from ``--run-config``, the strings "true" / "false")."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    raise ValueError(f"run config fedmtl-overwrite = {shown(v)}: expected true or false")


def server_options(run_config: dict[str, Any]) -> ServerOptions:
    """The ServerApp's options from its run config (``fedmtl-out``, ``fedmtl-num-nodes``, ``fedmtl-overwrite``),
    checked before any node is contacted: a ``ValueError`` naming the key otherwise."""
    out = run_config.get("fedmtl-out", "")
    if not isinstance(out, str) or len(out) > 4096:
        raise ValueError(f"run config fedmtl-out = {shown(out)}: expected the path of the run directory")
    n = run_config.get("fedmtl-num-nodes", 0)
    text = n.strip() if isinstance(n, str) else n
    if isinstance(text, str) and text.isdigit() and len(text) <= 9:
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, int) or not 0 <= text <= 10**6:
        raise ValueError(f"run config fedmtl-num-nodes = {shown(n)}: expected a whole number of SuperNodes in "
                         "[0, 10^6] (0: any)")
    return ServerOptions(out=out, num_nodes=text, overwrite=_flag(run_config.get("fedmtl-overwrite", False)))


__all__ = ["NodeError", "ServerOptions", "federation_of", "lock_run_directory", "make_client_app",
           "make_server_app", "server_main", "server_options"]
