"""The Flower executor: ``FlowerClients`` implements the round loop's ``Clients`` interface by messages to
SuperNodes, so a Flower ServerApp runs the same ``Engine`` and driver as a simulation (sampling, systems
model, NaN exclusion, aggregation, evaluation, checkpoints, resume).

**One message per node per round.**  The sampled clients are grouped by the SuperNode that holds them; each
node gets one ``train`` message: the payload (an ``ArrayRecord`` of named tensors), the ids of its sampled
clients, their epoch orders and straggler limits (so each runs exactly the batches a simulation would) and
the scalars of the algorithm's context.  The node runs them with its local executor and replies their
updates, stacked in the order asked.  Updates travel per client, never pre-summed on the node (unless
``flower.secure_aggregation`` is on: then ``fedmtl.flower.secagg`` runs the round and the server receives only the
sum over nodes): the server's aggregate is the algorithm's own (FedEM's responsibilities, Clustered FL's per-cluster
means, MOCHA's dual sums) and it must see each update to exclude non-finite ones exactly as a simulation does.

A node whose reply carries an error, never arrives within ``round_timeout`` seconds or cannot be decoded
*fails*: its clients are dropped for that round, logged and counted.  A client whose update, state or loss is
not finite is reported (``finite = 0``), keeps its old state on its node, and is *excluded*.

**Decentralized methods** (D-FedEM, D-SGD) gossip through the server, which keeps no client model: it pulls
every node's client states, forwards to each node the states of its clients' neighbours in the mixing graph
(``train.mix``), and each node mixes its own clients; the server only learns the population average (for
unseen clients and reports) from the nodes' partial sums.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm, Context
from ..data.federated import Orders
from ..engine.clients import TrainOut
from ..engine.evaluation import per_client
from ..optim import Batches
from ..tree import Tree
from .records import RecordError, from_record, record_to_tree, to_config, tree_to_record

log = logging.getLogger("fedmtl")


def context_config(ctx: Context) -> dict[str, Any]:
    """The algorithm context's scalars, sent with every message (a node rebuilds ``Context`` from them)."""
    return {"num_clients": ctx.num_clients, "total_train": ctx.total_train, "local_epochs": ctx.local_epochs,
            "rounds": ctx.rounds, "max_train": ctx.max_train}


def update_template(alg: Algorithm, ctx: Context, server0: Tree, feature_shape: tuple[int, ...],
                    feature_dtype: torch.dtype) -> Tree:
    """The structure of one client's update (names, shapes, dtypes), found by running ``client_update`` once on
    a one-example batch of zeros: the server decodes replies against it and never needs client data."""
    x = torch.zeros(1, 1, *feature_shape, dtype=feature_dtype)
    b = Batches(x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
                torch.tensor(1.0), torch.tensor(1), torch.zeros(1, 1, dtype=torch.long))
    state = T.take(alg.init_clients(ctx, server0, torch.zeros(1, dtype=torch.long)), 0)
    update, _, _ = alg.client_update(ctx, alg.payload(server0), state, b, 0.0)
    return T.tmap(lambda t: t.detach().cpu(), update)


def send_and_receive(grid: Any, msgs: list[Message], timeout: float) -> list[Message]:
    """``grid.send_and_receive`` with a short polling interval.  Flower's own polls the SuperLink every 3 s,
    which would add up to 3 s to every exchange; this pushes the messages and pulls replies after 50 ms,
    backing off to 0.5 s (Flower's public ``Grid.push_messages`` / ``pull_messages``)."""
    import time

    waiting = set(grid.push_messages(msgs))
    out: list[Message] = []
    end, pause = time.monotonic() + timeout, 0.05
    while waiting:
        for rep in grid.pull_messages(waiting):
            out.append(rep)
            waiting.discard(rep.metadata.reply_to_message_id)
        if not waiting or time.monotonic() >= end:
            break
        time.sleep(pause)
        pause = min(0.5, pause * 1.3)
    return out


def order_record(orders: Orders, positions: list[int]) -> ArrayRecord:
    """The epoch orders (E, n_i) of the clients at ``positions`` of ``orders``, concatenated, with their
    starts and step limits: what one node needs to run exactly a simulation's batches."""
    mine = orders.take(positions)
    rec = {"local": mine.local, "starts": mine.starts}
    if mine.limit is not None:
        rec["limit"] = mine.limit.to(torch.long)
    return ArrayRecord(rec)


def orders_of(rec: ArrayRecord) -> Orders:
    def get(name: str) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(rec[name].numpy())).to(torch.long)

    local = get("local")
    if local.dim() != 2:
        raise RecordError(f"epoch orders must be 2-d (epochs, examples), got shape {tuple(local.shape)}")
    starts = get("starts")
    limit = get("limit") if "limit" in rec else None
    return Orders(local, starts, limit)


class FlowerClients:
    """The seen clients of a Flower federation, reached through ``grid`` (the ServerApp's ``Grid``).

    ``nodes`` maps each client id to the SuperNode that serves it.  Client state lives on the nodes: the server
    keeps none (``state_dict`` is empty), so a checkpoint holds the server's side only.
    """

    groups = ("seen",)

    def __init__(self, grid: Any, nodes: dict[int, int], alg: Algorithm, feature_shape: tuple[int, ...],
                 feature_dtype: torch.dtype, round_timeout: float = 600.0):
        self.grid, self.nodes, self.alg = grid, nodes, alg
        self.feature_shape, self.feature_dtype = feature_shape, feature_dtype
        self.round_timeout = round_timeout
        self.ctx: Context | None = None
        self.template: Tree = None
        self.state_template: Tree = None
        self.round = 0  # rounds completed: evaluation reads the client states written before it
        #: the rounds' secure aggregation (``fedmtl.flower.secagg.SecureRounds``); None: updates travel per client
        self.secure: Any = None

    def start(self, ctx: Context, server0: Tree, resume: dict[str, Any] | None = None, round_idx: int = 0) -> None:
        self.ctx, self.round = ctx, round_idx
        self.template = update_template(self.alg, ctx, server0, self.feature_shape, self.feature_dtype)
        self.state_template = T.take(self.alg.init_clients(ctx, server0, torch.zeros(1, dtype=torch.long)), 0)

    def _by_node(self, ids: Tensor) -> dict[int, list[int]]:
        """node id -> positions (into ``ids``) of the clients it holds, in order."""
        out: dict[int, list[int]] = {}
        for i, k in enumerate(ids.tolist()):
            out.setdefault(self.nodes[int(k)], []).append(i)
        return out

    def _send(self, msgs: list[Message]) -> list[Message]:
        return send_and_receive(self.grid, msgs, self.round_timeout)

    def _exchange(self, msgs: dict[int, Message], what: str) -> dict[int, Message]:
        """Send one message per node; node id -> its reply (nodes that failed or never answered are logged)."""
        out: dict[int, Message] = {}
        for rep in self._send(list(msgs.values())):
            nid = int(rep.metadata.src_node_id)
            if rep.has_error():
                log.warning("%s: SuperNode %s failed: %s", what, nid, (rep.error.reason or "")[:300])
            elif nid in msgs:
                out[nid] = rep
        for nid in set(msgs) - set(out):
            log.warning("%s: no usable reply from SuperNode %s", what, nid)
        return out

    def _config(self, extra: dict[str, Any]) -> ConfigRecord:
        assert self.ctx is not None
        return to_config({**context_config(self.ctx), **extra})

    def train(self, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut:
        if self.secure is not None:
            out: TrainOut = self.secure.train(self, payload, ids, orders, lr, round_idx)
            self.round = round_idx + 1
            return out
        prec = tree_to_record(payload)
        groups = self._by_node(ids)
        msgs = {nid: Message(RecordDict({
            "payload": prec, "order": order_record(orders, pos),
            "config": self._config({"round": round_idx, "lr": lr, "clients": [int(ids[i]) for i in pos]})}),
            dst_node_id=nid, message_type="train", group_id=str(round_idx)) for nid, pos in groups.items()}
        replies = self._exchange(msgs, f"round {round_idx}")
        k = len(ids)
        updates = T.broadcast(T.zeros_like(self.template), k) if T.leaves(self.template) else self.template
        updates = T.tmap(lambda x: x.clone(), updates)
        losses = torch.full((k,), float("nan"))
        ok = torch.zeros(k, dtype=torch.bool)
        failed = torch.ones(k, dtype=torch.bool)
        for nid, rep in replies.items():
            pos = groups[nid]
            try:
                met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
                if [int(c) for c in met["clients"]] != [int(ids[i]) for i in pos]:
                    raise RecordError("the reply's clients are not the ones asked")
                got = record_to_tree(rep.content["update"], T.broadcast(self.template, 1), leading=True)  # type: ignore[arg-type]
                if any(x.shape[0] != len(pos) for x in T.leaves(got)):
                    raise RecordError(f"{len(pos)} clients asked, updates of another number came back")
                fin = torch.tensor([bool(f) for f in met["finite"]])
                loss = torch.tensor([float(v) for v in met["loss"]], dtype=torch.float64)
            except (RecordError, KeyError, TypeError, ValueError) as e:
                log.warning("round %d: SuperNode %s sent a malformed reply: %s", round_idx, nid, e)
                continue
            where = torch.tensor(pos, dtype=torch.long)
            for dst, src in zip(T.leaves(updates), T.leaves(got), strict=True):
                dst.index_copy_(0, where, src.to(dst.dtype))
            failed[where] = False
            ok[where] = fin
            losses[where] = torch.where(fin, loss, torch.tensor(float("nan"), dtype=torch.float64)).float()
        self.round = round_idx + 1
        return TrainOut(updates, losses, ok, failed)

    def evaluate(self, group: str, payload: Tree, server: Tree, ids: Tensor, adapt: Orders | None,
                 lr: float) -> dict[str, Any]:
        assert group == "seen"
        prec = tree_to_record(payload)
        groups = self._by_node(ids)
        msgs = {}
        for nid, pos in groups.items():
            content: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {
                "payload": prec, "config": self._config({"lr": lr, "round": self.round,
                                                         "clients": [int(ids[i]) for i in pos]})}
            if adapt is not None:
                content["order"] = order_record(adapt, pos)
            msgs[nid] = Message(RecordDict(content), dst_node_id=nid, message_type="evaluate", group_id="eval")
        replies = self._exchange(msgs, "evaluation")
        metrics = {}
        for nid, rep in replies.items():
            try:
                met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
                if [int(c) for c in met["clients"]] != [int(ids[i]) for i in groups[nid]]:
                    raise RecordError("the reply's clients are not the ones asked")
            except (RecordError, KeyError, TypeError, ValueError) as e:
                log.warning("evaluation: SuperNode %s sent a malformed reply: %s", nid, e)
                continue
            metrics[nid] = met
        names = sorted({key.rsplit("_", 1)[0] for met in metrics.values() for key in met if key != "clients"})
        out: dict[str, Any] = {}
        for name in names:
            cols = {f: torch.zeros(len(ids), dtype=torch.float64) for f in ("n", "correct", "nll")}
            for nid, met in metrics.items():
                where = torch.tensor(groups[nid], dtype=torch.long)
                for f in cols:
                    cols[f][where] = torch.tensor([float(v) for v in met[f"{name}_{f}"]], dtype=torch.float64)
            out[name] = per_client(cols["correct"], cols["nll"], cols["n"], ids)
        return out

    def gossip(self, fn: Callable[[Tree, Tree], tuple[Tree, Tree]], server: Tree, round_idx: int) -> Tree:
        """Server-relayed gossip (see the module docstring); ``fn`` is the nodes' business, not the server's."""
        every = self._by_node(torch.arange(len(self.nodes)))
        pulls = {nid: Message(RecordDict({"config": self._config({"round": round_idx})}), dst_node_id=nid,
                              message_type="train.pull", group_id=f"pull{round_idx}") for nid in every}
        replies = self._exchange(pulls, f"gossip round {round_idx}")
        if len(replies) < len(every):
            raise RuntimeError(f"gossip round {round_idx}: {len(every) - len(replies)} SuperNode(s) did not send "
                               "their clients' states; decentralized runs need every node every round")
        states: dict[int, tuple[list[int], ArrayRecord | MetricRecord | ConfigRecord]] = {}
        for nid, rep in replies.items():
            ks = [int(c) for c in from_record(rep.content["config"])["clients"]]  # type: ignore[arg-type]
            states[nid] = (ks, rep.content["states"])
        owner_pos = {k: (nid, j) for nid, (ks, _) in states.items() for j, k in enumerate(ks)}
        edges = self.alg.gossip_edges(server)
        n = len(self.nodes)
        neighbours: dict[int, set[int]] = {k: set() for k in range(n)}
        if edges is not None:
            for i, j in edges.tolist():
                neighbours[i].add(j)
                neighbours[j].add(i)
        else:  # no sparse graph known to the server: every client may read every other
            neighbours = {k: set(range(n)) - {k} for k in range(n)}
        decoded: dict[int, dict[str, Tensor]] = {}
        mixes = {}
        for nid, (ks, _) in states.items():
            want = sorted(set().union(*(neighbours[k] for k in ks)) - set(ks))
            content: dict[str, Any] = {"config": self._config({"round": round_idx, "neighbours": want})}
            if want:
                parts = []
                for k in want:
                    src, j = owner_pos[k]
                    if src not in decoded:
                        decoded[src] = _record_rows(states[src][1])
                    parts.append({name: rows[j : j + 1] for name, rows in decoded[src].items()})
                content["neighbours"] = ArrayRecord({name: torch.cat([p[name] for p in parts])
                                                     for name in parts[0]})
            mixes[nid] = Message(RecordDict(content), dst_node_id=nid, message_type="train.mix",
                                 group_id=f"mix{round_idx}")
        mixed = self._exchange(mixes, f"gossip round {round_idx}")
        if len(mixed) < len(mixes):
            raise RuntimeError(f"gossip round {round_idx}: {len(mixes) - len(mixed)} SuperNode(s) failed to mix")
        total: dict[str, Tensor] = {}
        for rep in mixed.values():
            for name, v in _record_rows(rep.content["sum"]).items():
                total[name] = total[name] + v if name in total else v
        ref = T.to_named(self.state_template)
        mean = {name: (v / n).to(ref[name].dtype) if name in ref else v for name, v in total.items()}
        try:
            mean_state = T.from_named(mean, self.state_template, next(iter(ref.values())).device)
        except T.TreeError as e:
            raise RecordError(f"gossip round {round_idx}: the nodes' sums do not match the client state: {e}") from None
        return self.alg.sync_average(server, mean_state)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "remote"}

    def commit(self) -> None:
        pass

    def close(self) -> None:
        pass


def _record_rows(rec: Any) -> dict[str, Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(rec[name].numpy())) for name in rec.keys()}
