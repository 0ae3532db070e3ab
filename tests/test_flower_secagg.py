"""Secure aggregation over Flower (``flower.secure_aggregation = true``, Flower's SecAgg+).

Most tests drive ``server_main`` over ``fedmtl.flower.loopback.WireGrid``: SuperNodes in this process whose
messages cross a serialization boundary (Flower's protobuf, both ways, as on the wire) and pass through the
ClientApp's mods (``relay_app.secure_mod`` wrapping Flower's ``secaggplus_mod``) before the handler, each node with a
``Context`` kept across messages as a SuperNode keeps it.  What the server receives is recorded.  One test runs a
real SuperLink with TLS and node authentication."""

from __future__ import annotations

import tomllib
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedmtl import tree as T  # noqa: E402
from fedmtl.config import ConfigError, dumps, validate  # noqa: E402
from fedmtl.flower import apps  # noqa: E402
from fedmtl.flower.apps import NodeCache, ServerOptions, server_main  # noqa: E402
from fedmtl.flower.loopback import WireGrid  # noqa: E402
from fedmtl.runs.driver import build_local  # noqa: E402
from fedmtl.secure_aggregation import FlowerConfig, mean_error_bound, node_contribution  # noqa: E402

from .test_flower import CONFIG as FLOWER_CONFIG  # noqa: E402


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity Flower gives a ServerApp process (a new message reads its run, node and task ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


SECURE = "\n[flower]\nsecure_aggregation = true\nclipping_range = {c}\nquantization_range = {q}\n"


def _text(alg: str = "fedavg", extra: str = "", k: int = 0, rounds: int = 1, c: float = 1.0, q: int = 1 << 16,
          tables: str = "") -> str:
    raw = FLOWER_CONFIG.format(alg=alg, extra=extra, k=k).replace("rounds = 3", f"rounds = {rounds}")
    return dumps(validate(tomllib.loads(raw + SECURE.format(c=c, q=q) + tables)).raw)


THREE = {11: {"partition-ids": "0-1"}, 22: {"partition-ids": "2-3"}, 33: {"partition-ids": "4"}}
FOUR = {11: {"partition-ids": "0-1"}, 22: {"partition-ids": "2"}, 33: {"partition-ids": "3"},
        44: {"partition-ids": "4"}}


def _simulated_round(text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    """The in-process simulator's state after its rounds, and the first round's payload, sampled ids, counts and
    per-client updates (what each client sent, in the clear)."""
    from fedmtl.engine.round import Engine

    seen: dict[str, Any] = {}
    real = Engine.finish

    def spy(self: Engine, state: Any, plan: Any, out: Any) -> Any:
        if not seen:
            seen.update(payload=plan.payload, ids=plan.ids.clone(), counts=plan.counts.clone(),
                        updates=T.tmap(lambda x: x.clone(), out.updates))
        return real(self, state, plan, out)

    monkeypatch.setattr(Engine, "finish", spy)
    cfg = validate(tomllib.loads(text))
    sim = build_local(cfg)
    st = sim.init_state()
    for _ in range(cfg.run.rounds):
        sim.round(st)
    monkeypatch.setattr(Engine, "finish", real)
    return st, seen


@pytest.mark.parametrize("alg,extra,k,tables", [
    ("fedavg", "", 0, ""), ("fedprox", "mu = 0.1", 0, ""), ("ditto", "", 0, ""), ("fedem", "num_components = 2", 2, ""),
    ("fedavg", "", 0, "\n[privacy]\nclip_norm = 0.5\nnoise_multiplier = 0.3\nsampling = \"fixed\"\n"
                      "reproducible_noise = true\n"),
], ids=["fedavg", "fedprox", "ditto", "fedem-sampled", "dp-fedavg"])
def test_secure_round_equals_the_simulator_within_the_quantization_bound(alg, extra, k, tables, monkeypatch, caplog):
    """One round over three SuperNodes with SecAgg+ gives the simulator's server state (FedAvg's and FedProx's
    model, Ditto's global model, FedEM's components with 2 of 5 clients sampled, so a node masks zeros; DP-FedAvg
    clipped on the nodes, noised on the server) to within ``mean_error_bound``: 2 n (C + |m|) / (Q A) with n = 3
    nodes, C = 1, Q = 2^16.  The error is not zero (the sum was quantized) and nothing was clipped."""
    text = _text(alg, extra, k, tables=tables)
    res = server_main(WireGrid(text, THREE), text, ServerOptions(num_nodes=3))
    st, seen = _simulated_round(text, monkeypatch)
    assert "clipped" not in caplog.text
    if k:  # 2 of 5 clients sampled: a node had none and masked zeros
        assert any(set(block).isdisjoint(seen["ids"].tolist()) for block in ([0, 1], [2, 3], [4])), seen["ids"]
    assert res.history[0]["dropped"] == 0 and res.history[0]["excluded"] == 0
    diffs, bound = [], 0.0
    for a, b, p in zip(T.leaves(res.server), T.leaves(st.server), T.leaves(T.to(seen["payload"], "cpu")),
                       strict=True):
        m = float((b.double() - p.double()).abs().max())  # the mean deviation's largest entry
        bound = max(bound, mean_error_bound(3, 1.0, 1 << 16, 1.0, m) + 1e-6 * (1 + float(b.abs().max())))
        diffs.append(float((a.double() - b.double()).abs().max()))
    # DP: the server adds the same noise draw to the same sum (reproducible_noise), so the bound is the mean's
    assert 0 < max(diffs) <= bound, (diffs, bound)


def test_dropped_node_within_the_threshold_does_not_stop_the_round_and_the_server_sees_only_masked_sums(
        monkeypatch, caplog):
    """Four SuperNodes (threshold 3); the node of client 2 crashes in the first round's training stage.  The round
    goes on: client 2 counts as dropped, and the model is the weighted mean of the other four clients' updates (as
    the simulator's clients sent them in the clear), to the quantization bound.  On the wire: no reply the server
    received holds a float array, and each node's masked vector is not its plain quantized update (a plain vector
    lies in [0, Q]; a masked one is spread over [0, 2^32))."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    monkeypatch.setenv("FEDMTL_FLOWER_FAIL", "2:0")
    text = _text("fedavg")
    grid = WireGrid(text, FOUR)
    res = server_main(grid, text, ServerOptions(num_nodes=4))
    assert res.history[0]["dropped"] == 1 and res.history[0]["clients"] == 4
    monkeypatch.delenv("FEDMTL_FLOWER_FAIL")
    _, seen = _simulated_round(text, monkeypatch)
    keep = seen["ids"] != 2
    w = seen["counts"].double() * keep
    expect = {n: torch.tensordot(w / w.sum(), u.double(), dims=1) for n, u in T.to_named(seen["updates"]).items()}
    got = T.to_named(res.server.params)
    share = float(w.sum() / seen["counts"].double().sum())  # A: the weight that arrived
    for name, e in expect.items():
        p = T.to_named(seen["payload"])[name].double()
        bound = mean_error_bound(3, 1.0, 1 << 16, share, float((e - p).abs().max())) + 1e-6
        assert float((got[name].double() - e).abs().max()) <= bound, name
    # what crossed the wire to the server
    masked = []
    for rep in grid.received:
        if rep.has_error():
            continue
        for rec in rep.content.array_records.values():  # no reply carries an array: updates leave nodes masked
            assert all(rec[k].numpy().size == 0 for k in rec.keys())
        cfg = rep.content.config_records.get(RECORD_KEY_CONFIGS)
        if cfg is not None and Key.MASKED_PARAMETERS in cfg:
            masked.append(np.concatenate([bytes_to_ndarray(b).ravel() for b in cfg[Key.MASKED_PARAMETERS]]))
    assert len(masked) == 3  # the three nodes that survived the training stage
    for vec in masked:
        assert (vec[1:] <= 1 << 16).mean() < 0.05  # uniform masks: an entry lands in [0, Q] with probability 2^-16
    # the plain contributions the server never saw: inside [0, Q] once quantized
    payload = T.to(seen["payload"], "cpu")
    for nodes_ids in ([0, 1], [3], [4]):
        rows = torch.tensor(nodes_ids)
        sums, _ = node_contribution(T.tmap(lambda x, r=rows: x.index_select(0, r), seen["updates"]), payload,
                                    w.index_select(0, rows) / seen["counts"].double().sum(),
                                    torch.ones(len(nodes_ids), dtype=torch.bool), 1.0)
        plain = np.concatenate([((v.numpy().ravel() + 1.0) * (1 << 15)) for v in sums.values()])
        assert ((plain >= 0) & (plain <= 1 << 16)).all()
        assert not any(np.allclose(vec[1:].astype(np.float64), plain, atol=2) for vec in masked)


def test_too_many_dropped_nodes_leave_the_round_without_update_and_the_run_goes_on(monkeypatch, caplog):
    """Three SuperNodes (threshold 2); two crash in the first round: the protocol cannot unmask, so that round has no
    update (every client dropped, the model unchanged, logged) and the next round runs normally."""
    monkeypatch.setenv("FEDMTL_FLOWER_FAIL", "0:0,4:0")
    text = _text("fedavg", rounds=2)
    res = server_main(WireGrid(text, THREE), text, ServerOptions(num_nodes=3))
    assert [h["dropped"] for h in res.history] == [5, 0], res.history
    assert "secure aggregation halted" in caplog.text


def test_entries_beyond_the_clipping_range_are_clipped_and_logged(caplog):
    """A clipping range far below the updates' deviations: the nodes clip, and the server's log names the count and
    flower.clipping_range (the round still runs)."""
    text = _text("fedavg", c=1e-4)
    res = server_main(WireGrid(text, THREE), text, ServerOptions(num_nodes=3))
    assert res.history[0]["dropped"] == 0
    assert "raise flower.clipping_range" in caplog.text and "secure aggregation clipped" in caplog.text


def test_a_node_configured_for_secure_aggregation_refuses_a_plain_train_message():
    """A train message outside the protocol would have the node send its clients' updates in the clear: a node whose
    config asks for secure aggregation refuses it, naming the setting."""
    from fedmtl.flower.records import to_config

    text = _text("fedavg")
    ctx = Context(run_id=1, node_id=11, node_config={"partition-ids": "0-1"}, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"config": to_config({"clients": [0, 1], "round": 0})}), dst_node_id=11,
                  message_type="train")
    with pytest.raises(ValueError, match="flower.secure_aggregation = true"):
        apps.handle_train(msg, ctx, text, NodeCache())


@pytest.mark.parametrize("tables,what", [
    ('[algorithm]\nname = "fedavg"\n[robust]\naggregator = "median"\n', "robust.aggregator = 'median'"),
    ('[algorithm]\nname = "fedavg"\n[robust]\naggregator = "krum"\nnum_byzantine = 1\n', "'krum'"),
    ('[algorithm]\nname = "fedavg"\n[robust]\naggregator = "centered_clip"\n', "'centered_clip'"),
    ('[algorithm]\nname = "fedfomo"\n', "algorithm 'fedfomo'"),
    ('[algorithm]\nname = "clustered"\n', "algorithm 'clustered'"),
    ('[algorithm]\nname = "fedavg"\n[robust]\nclip_norm = 1.0\n', "robust.clip_norm"),
], ids=["median", "krum", "centered_clip", "fedfomo", "clustered", "server-clip"])
def test_algorithms_that_need_individual_updates_are_refused_before_any_node_is_contacted(tables, what, tmp_path,
                                                                                          capsys):
    """A config asking for secure aggregation with an aggregator or algorithm that reads each update is refused in
    one line naming the file and the setting: by ``fedmtl flower simulate`` (exit 2, no traceback, no Ray
    started) and by a ServerApp before it sends any message."""
    from fedmtl.cli import main

    base = FLOWER_CONFIG.format(alg="fedavg", extra="", k=0)
    base = base.replace('[algorithm]\nname = "fedavg"\n', "")
    raw = base + "\n" + tables + "\n[flower]\nsecure_aggregation = true\n"
    path = tmp_path / "exp.toml"
    path.write_text(raw)
    assert main(["flower", "simulate", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err and "flower.secure_aggregation" in err and what in err, err
    assert not (tmp_path / "out").exists()
    grid = WireGrid("", THREE)
    with pytest.raises(ConfigError, match="flower.secure_aggregation"):
        server_main(grid, raw, ServerOptions(num_nodes=3))
    assert grid.pushed == []


@pytest.mark.slow
def test_too_few_nodes_for_secure_aggregation_are_refused_in_one_line(tmp_path, capsys):
    """``fedmtl flower simulate --nodes 2`` and ``fedmtl flower app --nodes 2`` with secure aggregation: one line, exit
    2, nothing started or written."""
    from fedmtl.cli import main

    path = tmp_path / "exp.toml"
    path.write_text(FLOWER_CONFIG.format(alg="fedavg", extra="", k=0) + "\n[flower]\nsecure_aggregation = true\n")
    for action in ("simulate", "app"):
        assert main(["flower", action, str(path), "--nodes", "2", "--out", str(tmp_path / action)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "at least 3 SuperNodes" in err and str(path) in err, err
        assert not (tmp_path / action).exists()


def test_flower_table_is_validated_with_the_key_named():
    """[flower]'s numbers have declared ranges and the protocol's own constraints; with too few nodes, or so many
    that the masked sum overflows 2^32, a run is refused."""
    for bad, key in (("num_shares = 2", "num_shares"), ("reconstruction_threshold = 1", "reconstruction_threshold"),
                     ("num_shares = 5\nreconstruction_threshold = 5", "reconstruction_threshold"),
                     ("clipping_range = 0.0", "clipping_range"), ("quantization_range = 10", "quantization_range")):
        raw = FLOWER_CONFIG.format(alg="fedavg", extra="", k=0) + "\n[flower]\nsecure_aggregation = true\n" + bad
        with pytest.raises(ConfigError, match=key):
            validate(tomllib.loads(raw), "exp.toml")
    f = FlowerConfig(secure_aggregation=True)
    assert f.protocol(3) == (3, 2) and f.protocol(4) == (4, 3) and f.protocol(10) == (10, 6)
    with pytest.raises(ValueError, match="at least 3 SuperNodes"):
        f.protocol(2)
    with pytest.raises(ValueError, match="overflow"):
        f.protocol(1024)
    assert FlowerConfig(num_shares=5, reconstruction_threshold=3).protocol(20) == (5, 3)


# SecAgg+ over a real deployment (TLS, node authentication, three SuperNodes with their workers):
# test_flower.py::test_deployment_with_node_local_data_tls_node_authentication_and_secure_aggregation, which runs it
# on the same deployment as its FedEM app
