"""The Flower executor: ``FlowerClients`` implements the round loop's ``Clients`` interface by messages to
SuperNodes, so a Flower ServerApp runs the same ``Engine`` and driver as a simulation (sampling, systems
model, NaN exclusion, aggregation, evaluation, checkpoints, resume).

Per round, every sampled client gets one ``train`` message: the payload (an ``ArrayRecord`` of named tensors),
its own epoch order of local examples and its straggler limit (so it runs exactly the batches a simulation
would), and the scalars of the algorithm's context.  Its node replies with the client's update (its state
stays on the node).  A reply that carries an error, never arrives within ``round_timeout`` seconds or cannot
be decoded is a *failed* client: dropped for that round, logged and counted.  A node's client whose update,
state or loss is not finite reports it (``finite = 0``), keeps its old state, and is *excluded*.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
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


def order_record(orders: Orders, i: int) -> ArrayRecord:
    """Client i's epoch order (E, n_i) of its own examples, and its step limit."""
    s, e = int(orders.starts[i]), int(orders.starts[i + 1])
    rec = {"local": orders.local[:, s:e].contiguous()}
    if orders.limit is not None:
        rec["limit"] = orders.limit[i : i + 1].to(torch.long)
    return ArrayRecord(rec)


def orders_of(rec: ArrayRecord) -> Orders:
    local = torch.from_numpy(np.ascontiguousarray(rec["local"].numpy())).to(torch.long)
    limit = torch.from_numpy(rec["limit"].numpy()).to(torch.long) if "limit" in rec else None
    return Orders(local, torch.tensor([0, local.shape[1]]), limit)


class FlowerClients:
    """The seen clients of a Flower federation, reached through ``grid`` (the ServerApp's ``Grid``).

    ``nodes`` maps each client id to the SuperNode that serves it.  Client state lives on the nodes: the server
    keeps none (``state_dict`` is empty), so a checkpoint holds the server's side only.
    """

    groups = ("seen",)

    def __init__(self, grid: Any, nodes: dict[int, int], alg: Algorithm, feature_shape: tuple[int, ...],
                 feature_dtype: torch.dtype, round_timeout: float = 600.0):
        if alg.syncs_clients:
            raise ValueError(f"algorithm {alg.name!r} gossips between neighbours after each round; Flower runs are "
                             "hub-and-spoke and decentralized methods are not offered over Flower yet")
        self.grid, self.nodes, self.alg = grid, nodes, alg
        self.feature_shape, self.feature_dtype = feature_shape, feature_dtype
        self.round_timeout = round_timeout
        self.ctx: Context | None = None
        self.template: Tree = None

    def start(self, ctx: Context, server0: Tree, resume: dict[str, Any] | None = None, round_idx: int = 0) -> None:
        self.ctx = ctx
        self.template = update_template(self.alg, ctx, server0, self.feature_shape, self.feature_dtype)

    def _send(self, msgs: list[Message]) -> list[Message]:
        return list(self.grid.send_and_receive(msgs, timeout=self.round_timeout))

    def _replies(self, msgs: list[Message], ids: Tensor, what: str) -> dict[int, Message]:
        position = {int(k): i for i, k in enumerate(ids.tolist())}
        out: dict[int, Message] = {}
        for rep in self._send(msgs):
            if rep.has_error():
                log.warning("%s: a client on node %s failed: %s", what, rep.metadata.src_node_id,
                            rep.error.reason[:200])
                continue
            try:
                k = int(from_record(rep.content["metrics"])["client"])  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError):
                log.warning("%s: node %s sent a reply without a client id", what, rep.metadata.src_node_id)
                continue
            if k in position:
                out[position[k]] = rep
        return out

    def train(self, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut:
        assert self.ctx is not None
        prec = tree_to_record(payload)
        base = {"round": round_idx, "lr": lr, **context_config(self.ctx)}
        msgs = [Message(RecordDict({"payload": prec, "order": order_record(orders, i),
                                    "config": to_config({**base, "client": int(k)})}),
                        dst_node_id=self.nodes[int(k)], message_type="train", group_id=str(round_idx))
                for i, k in enumerate(ids.tolist())]
        replies = self._replies(msgs, ids, f"round {round_idx}")
        k = len(ids)
        updates: list[Tree | None] = [None] * k
        losses = torch.full((k,), float("nan"))
        ok = torch.zeros(k, dtype=torch.bool)
        failed = torch.ones(k, dtype=torch.bool)
        for i, rep in replies.items():
            met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
            failed[i] = False
            if not met.get("finite", 0):
                continue
            try:
                updates[i] = record_to_tree(rep.content["update"], self.template)  # type: ignore[arg-type]
            except (RecordError, KeyError) as e:
                log.warning("round %d: client %d sent a malformed update: %s", round_idx, int(ids[i]), e)
                failed[i] = True
                continue
            ok[i] = True
            losses[i] = float(met["loss"])
        zeros = T.zeros_like(self.template)
        stacked = T.stack([u if u is not None else zeros for u in updates])
        return TrainOut(stacked, losses, ok, failed)

    def evaluate(self, group: str, payload: Tree, server: Tree, ids: Tensor, adapt: Orders | None,
                 lr: float) -> dict[str, Any]:
        assert self.ctx is not None and group == "seen"
        prec = tree_to_record(payload)
        base = {"lr": lr, **context_config(self.ctx)}
        msgs = []
        for i, k in enumerate(ids.tolist()):
            content = {"payload": prec, "config": to_config({**base, "client": int(k)})}
            if adapt is not None:
                content["order"] = order_record(adapt, i)
            msgs.append(Message(RecordDict(content), dst_node_id=self.nodes[int(k)], message_type="evaluate",
                                group_id="eval"))
        replies = self._replies(msgs, ids, "evaluation")
        names = sorted({key.rsplit("_", 1)[0] for rep in replies.values()
                        for key in from_record(rep.content["metrics"]) if key != "client"})  # type: ignore[arg-type]
        out: dict[str, Any] = {}
        for name in names:
            cols = {f: torch.zeros(len(ids), dtype=torch.float64) for f in ("n", "correct", "nll")}
            for i, rep in replies.items():
                met = from_record(rep.content["metrics"])  # type: ignore[arg-type]
                for f in cols:
                    cols[f][i] = float(met.get(f"{name}_{f}", 0.0))
            out[name] = per_client(cols["correct"], cols["nll"], cols["n"], ids)
        return out

    def gossip(self, fn: Callable[[Tree, Tree], tuple[Tree, Tree]], server: Tree, round_idx: int) -> Tree:
        raise NotImplementedError("decentralized methods are not offered over Flower")

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "remote"}

    def commit(self) -> None:
        pass

    def close(self) -> None:
        pass
