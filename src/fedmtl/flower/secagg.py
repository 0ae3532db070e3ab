"""Secure aggregation of a round's updates with Flower's SecAgg+ (``flower.secure_aggregation = true``).

The server (``SecureRounds.train``, called by ``FlowerClients.train``) runs Flower's ``SecAggPlusWorkflow`` once
per round over every SuperNode: its four stages (keys, key shares, masked vectors, unmasking) are four exchanges
of one message per node, sent through the executor's fast-polling ``send_and_receive``.  The third stage's
message carries what a plain round's ``train`` message carries (payload, epoch orders, config) plus each of the
node's clients' weight; the node (``apps.handle_train`` then ``node_reply``) trains its clients and replies its
weighted sum (``fedmtl.secure_aggregation.node_contribution``), which Flower's ``secaggplus_mod``
(``relay_app.secure_mod``) quantizes and masks before it leaves the node.  The server gets the unmasked sum only
and hands the engine the recovered mean as every valid client's update (the weighting, the error bound and what
stays in the clear: ``fedmtl.secure_aggregation``).

A node that fails during a round, up to what ``reconstruction_threshold`` allows, is dropped like a failed node of
a plain round (its clients count as dropped) and the round goes on; with fewer surviving nodes than that, the round
has no update (logged), as a round whose every node failed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm
from ..algorithms.base import Context as AlgContext
from ..config import ExperimentConfig
from ..data.federated import Orders
from ..engine.clients import TrainOut
from ..robust.aggregators import reference_of
from ..secure_aggregation import WEIGHT_KEY, FlowerConfig, flat, node_contribution, recovered_mean
from ..tree import Tree
from .executor import order_record, send_and_receive
from .records import RecordError, tree_to_record

log = logging.getLogger("fedmtl")

#: the largest node report (JSON: client ids, losses, flags) the server reads
MAX_REPORT = 1 << 24


def is_protocol_message(msg: Message) -> bool:
    """Whether ``msg`` is the SecAgg+ stage that trains (it carries Flower's protocol config record)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return RECORD_KEY_CONFIGS in msg.content.config_records


def node_reply(cfg: ExperimentConfig, alg: Algorithm, ctx: AlgContext, server0: Tree, payload: Tree,
               out: TrainOut | None, ids: Tensor, conf: dict[str, Any], msg: Message) -> Message:
    """A node's answer to the training stage: its weighted sum and total weight as Flower's ``FitRes`` (weight 1:
    every node counts once in Flower's mean), which ``secaggplus_mod`` masks; the clients' losses and finite flags
    as a JSON report.  ``out`` None: no sampled client (zeros)."""
    from flwr.common import Code, FitRes, Parameters, Status, ndarray_to_bytes
    from flwr.compat.common import recorddict_compat as compat

    if out is None:
        updates: Tree = T.tmap(lambda x: x.unsqueeze(0)[:0], alg.update_like(ctx, payload))  # (0, ...)
        ok = torch.zeros(0, dtype=torch.bool)
        losses = torch.zeros(0, dtype=torch.float64)
    else:
        updates, ok = out.updates, out.ok.cpu()
        losses = torch.where(ok, out.losses.detach().double().cpu(), torch.zeros((), dtype=torch.float64))
    weights = torch.tensor([float(w) for w in conf.get("weights", [])], dtype=torch.float64)
    if weights.numel() != ids.numel():
        raise ValueError(f"the secure round's message has {weights.numel()} weights for {ids.numel()} clients")
    p = cfg.privacy
    sums, clipped = node_contribution(updates, reference_of(updates, payload), weights, ok,
                                      cfg.flower.clipping_range, p.clip_norm if p.enabled else 0.0)
    report = {"clients": ids.tolist(), "loss": losses.tolist(), "finite": ok.to(torch.long).tolist(),
              "clipped": clipped}
    params = Parameters([ndarray_to_bytes(v.numpy()) for v in sums.values()], "numpy.ndarray")
    fitres = FitRes(Status(Code.OK, ""), params, 1, {"fedmtl": json.dumps(report)})
    return Message(compat.fitres_to_recorddict(fitres, False), reply_to=msg)


class _Proxy:
    """What ``SecAggPlusWorkflow`` reads of a legacy ``ClientProxy``: the node id."""

    def __init__(self, node_id: int):
        self.node_id = node_id


class _Collect:
    """The legacy strategy ``SecAggPlusWorkflow`` calls: it samples every node (fedmtl's engine already sampled
    the clients) and keeps the unmasked result instead of aggregating."""

    def __init__(self, nodes: list[int]):
        self.nodes = nodes
        self.results: list[tuple[Any, Any]] | None = None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
        from flwr.common import FitIns, Parameters

        return [(_Proxy(n), FitIns(Parameters([], "numpy.ndarray"), {})) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]],
                      failures: list[Any]) -> tuple[None, dict[str, Any]]:
        self.results = results
        return None, {}


class _Grid:
    """The ServerApp's grid with the executor's fast polling for the workflow's ``send_and_receive``."""

    def __init__(self, grid: Any, timeout: float):
        self.grid, self.timeout = grid, timeout

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        return send_and_receive(self.grid, list(messages), timeout or self.timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


def _workflow(contents: dict[int, RecordDict], **kwargs: Any) -> Any:
    """Flower's ``SecAggPlusWorkflow`` whose training stage sends ``contents[node]`` (fedmtl's train message) in
    place of a legacy ``FitIns``."""
    from flwr.server.workflow import SecAggPlusWorkflow

    class Workflow(SecAggPlusWorkflow):
        def setup_stage(self, grid: Any, context: Any, state: Any) -> bool:
            ok: bool = super().setup_stage(grid, context, state)
            state.nid_to_fitins = dict(contents)
            return ok

    return Workflow(**kwargs)


class SecureRounds:
    """The server's side of secure aggregation: one SecAgg+ run per round (see the module docstring).
    ``counts`` (N,): every seen client's training examples; ``private``: the run is under ``[privacy]``
    (uniform weights, the nodes clip to ``clip_norm``)."""

    def __init__(self, cfg: FlowerConfig, counts: Tensor, private: bool, clip_norm: float = 0.0):
        self.cfg, self.counts, self.private, self.clip_norm = cfg, counts.to(torch.float64), private, clip_norm

    def weights(self, ids: Tensor) -> Tensor:
        """(K,) the weight a_k of each sampled client (``fedmtl.secure_aggregation``)."""
        if self.private:
            return torch.full((len(ids),), 1.0 / max(len(ids), 1), dtype=torch.float64)
        c = self.counts.index_select(0, ids.cpu())
        return c / c.sum()

    def train(self, fc: Any, payload: Tree, ids: Tensor, orders: Orders, lr: float, round_idx: int) -> TrainOut:
        """One round over ``fc`` (the ``FlowerClients``): the engine's ``TrainOut`` with the recovered mean as every
        valid client's update."""
        from flwr.app import ArrayRecord, ConfigRecord
        from flwr.app import Context as FlowerContext
        from flwr.app import RecordDict as Records
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

        nodes = sorted(set(fc.nodes.values()))
        shares, threshold = self.cfg.protocol(len(nodes))
        groups = fc._by_node(ids)
        a = self.weights(ids)
        prec = tree_to_record(payload)
        contents = {}
        for nid in nodes:
            pos = groups.get(nid, [])
            c: dict[str, Any] = {"payload": prec, "config": fc._config({
                "round": round_idx, "lr": lr, "clients": [int(ids[i]) for i in pos],
                "weights": [float(a[i]) for i in pos]})}
            if pos:
                c["order"] = order_record(orders, pos)
            contents[nid] = Records(c)
        strategy = _Collect(nodes)
        state = Records({MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: round_idx + 1}),
                         MAIN_PARAMS_RECORD: ArrayRecord()})
        ctx = LegacyContext(FlowerContext(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=strategy)  # type: ignore[arg-type]
        wf = _workflow(contents, num_shares=shares, reconstruction_threshold=threshold, max_weight=1.0,
                       clipping_range=self.cfg.clipping_range, quantization_range=self.cfg.quantization_range,
                       timeout=fc.round_timeout)
        k = len(ids)
        try:
            wf(_Grid(fc.grid, fc.round_timeout), ctx)
        except (ValueError, TypeError, IndexError, KeyError) as e:  # a node's malformed masked vector or keys
            log.warning("round %d: secure aggregation failed (%s: %s): the round has no update", round_idx,
                        type(e).__name__, str(e)[:200])
            strategy.results = None
        template = flat(fc.template)
        updates = T.tmap(lambda x: x.clone(), T.broadcast(T.zeros_like(fc.template), k)) if template else fc.template
        losses = torch.full((k,), float("nan"))
        ok = torch.zeros(k, dtype=torch.bool)
        failed = torch.ones(k, dtype=torch.bool)
        if not strategy.results:
            log.warning("round %d: secure aggregation halted (fewer SuperNodes than flower.reconstruction_threshold = "
                        "%d answered): the round has no update", round_idx, threshold)
            return TrainOut(updates, losses, ok, failed)
        try:
            sums, reports = _decode(strategy.results, template, groups, ids)
        except (RecordError, KeyError, TypeError, ValueError, RuntimeError) as e:
            # a node's vector is in the sum already: a malformed report or sum makes the whole round unusable
            log.warning("round %d: secure aggregation: %s; the round has no update", round_idx, str(e)[:300])
            return TrainOut(updates, losses, ok, failed)
        clipped = 0
        for nid, (fin, loss, nclip) in reports.items():
            where = torch.tensor(groups.get(nid, []), dtype=torch.long)
            failed[where] = False
            ok[where] = fin
            losses[where] = torch.where(fin, loss, torch.tensor(float("nan"), dtype=torch.float64)).float()
            clipped += nclip
        if clipped:
            log.warning("round %d: secure aggregation clipped %d entries of the nodes' weighted updates to "
                        "[-%g, %g]: raise flower.clipping_range", round_idx, clipped, self.cfg.clipping_range,
                        self.cfg.clipping_range)
        mean, total = recovered_mean(sums, self.cfg.clipping_range, template)
        one = T.from_named(mean, fc.template)
        ref = reference_of(T.broadcast(fc.template, 1), payload)
        if ref is not None:
            one = T.tmap(lambda m, r: (r.double() + m.double()).to(m.dtype), one, ref)
        valid = torch.nonzero(ok).flatten()
        if valid.numel() and total > 0:
            for dst, src in zip(T.leaves(updates), T.leaves(one), strict=True):
                dst.index_copy_(0, valid, src.unsqueeze(0).expand(len(valid), *src.shape).to(dst.dtype))
        return TrainOut(updates, losses, ok, failed)


def _decode(results: list[tuple[Any, Any]], template: dict[str, Tensor], groups: dict[int, list[int]],
            ids: Tensor) -> tuple[dict[str, Tensor], dict[int, tuple[Tensor, Tensor, int]]]:
    """The unmasked sums over the ``n`` nodes in ``results`` (Flower's mean over them times n), named like
    ``node_contribution``'s output; and per node id its clients' finite flags, losses and clipped entries."""
    from flwr.common import parameters_to_ndarrays

    n = len(results)
    arrays = parameters_to_ndarrays(results[0][1].parameters)
    names = [*template, WEIGHT_KEY]
    sizes = [int(t.numel()) for t in template.values()] + [1]
    if [int(np.asarray(a).size) for a in arrays] != sizes:
        raise RecordError(f"the unmasked sum has arrays of sizes {[int(np.asarray(a).size) for a in arrays][:8]}, "
                          f"expected {sizes[:8]}")
    sums = {name: torch.from_numpy(np.asarray(arr, dtype=np.float64) * n) for name, arr in zip(names, arrays,
                                                                                             strict=True)}
    reports = {}
    for proxy, fitres in results:
        nid = int(proxy.node_id)
        pos = groups.get(nid, [])
        text = str(fitres.metrics["fedmtl"])
        if len(text) > MAX_REPORT:
            raise RecordError(f"SuperNode {nid} sent a report of {len(text)} characters")
        rep = json.loads(text)
        if [int(c) for c in rep["clients"]] != [int(ids[i]) for i in pos]:
            raise RecordError(f"SuperNode {nid} reported other clients than the ones asked")
        fin = torch.tensor([bool(f) for f in rep["finite"]], dtype=torch.bool).reshape(len(pos))
        loss = torch.tensor([float(v) for v in rep["loss"]], dtype=torch.float64).reshape(len(pos))
        reports[nid] = (fin, loss, int(rep["clipped"]))
    return sums, reports


__all__ = ["SecureRounds", "is_protocol_message", "node_reply"]
