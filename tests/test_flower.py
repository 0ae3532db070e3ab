"""fedmtl over Flower: record conversion, simulation-engine equivalence with the in-process simulator,
dropped clients and server resume."""

from __future__ import annotations

import os
import stat
import time
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("flwr")

from fedmtl import tree as T  # noqa: E402
from fedmtl.config import dumps, validate  # noqa: E402
from fedmtl.engine.evaluation import summarize  # noqa: E402
from fedmtl.flower.records import (  # noqa: E402
    RecordError,
    from_record,
    record_to_tree,
    to_config,
    to_metrics,
    tree_to_record,
)
from fedmtl.runs.driver import build_local  # noqa: E402


class State(NamedTuple):
    pi: torch.Tensor
    steps: torch.Tensor


def test_record_round_trip_of_stacked_tensors_and_namedtuples():
    tree = {"components": {"fc.weight": torch.randn(3, 2, 5), "fc.bias": torch.randn(3, 2)},
            "state": State(torch.softmax(torch.randn(3), 0), torch.tensor([7], dtype=torch.long))}
    rec = tree_to_record(tree)
    assert "['components']['fc.weight']" in rec.keys()
    back = record_to_tree(rec, T.tmap(torch.zeros_like, tree))
    assert isinstance(back["state"], State)
    for a, b in zip(T.leaves(tree), T.leaves(back), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(RecordError, match="expected"):
        record_to_tree(rec, {"other": torch.zeros(1)})
    wrong = T.tmap(torch.zeros_like, tree)
    wrong["components"]["fc.bias"] = torch.zeros(3, 3)
    with pytest.raises(RecordError, match="fc.bias"):
        record_to_tree(rec, wrong)
    # a node's reply of another dtype is refused, never cast (float64 1e299 would become Inf in float32; ints truncate)
    for bad in (torch.full((3, 2), 1e299, dtype=torch.float64), torch.ones(3, 2, dtype=torch.int64)):
        forged = tree_to_record({**tree, "components": {**tree["components"], "fc.bias": bad}})
        with pytest.raises(RecordError, match=rf"fc.bias.*{bad.dtype}.*expected.*float32"):
            record_to_tree(forged, T.tmap(torch.zeros_like, tree))


def test_scalar_records_keep_integers_exact():
    big = 2**62 + 1  # a node id: never through float
    c = from_record(to_config({"client": big, "lr": 0.1, "counts": [3, 4, 5], "name": "fedem"}))
    assert c["client"] == big and isinstance(c["client"], int) and c["counts"] == [3, 4, 5]
    m = from_record(to_metrics({"loss": torch.tensor(0.25), "n": 12}))
    assert m == {"loss": 0.25, "n": 12}
    with pytest.raises(RecordError):
        to_metrics({"name": "x"})
    with pytest.raises(RecordError):
        to_config({"mixed": [1, 0.5]})


CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 5
dim = 6
n_test = 20
max_samples = 120
seed = 2

[model]
name = "linear"

[algorithm]
name = "{alg}"
{extra}

[optim]
lr = 0.1
momentum = 0.9

[run]
rounds = 3
batch_size = 32
clients_per_round = {k}
seed = 5
"""


def _flower_equals_in_process(raw, tmp_path, nodes=0):
    """The ServerApp and the ClientApps' handlers of config ``raw`` over ``fedmtl.flower.loopback.WireGrid`` give the
    in-process run's server state and final metrics: every message through Flower's protobuf both ways, one
    ``Context`` and node cache per SuperNode (``nodes``, default one per client) kept across rounds, without Ray.
    (The simulation engine's own path: the interrupted-run, crash and Ray-cluster tests.)"""
    import tomllib

    from fedmtl.flower.apps import ServerOptions, server_main
    from fedmtl.flower.loopback import WireGrid, server_identity

    text = dumps(validate(tomllib.loads(raw)).raw)
    n = validate(tomllib.loads(text)).build_data().seen.num_clients
    with server_identity():
        res = server_main(WireGrid.spread(text, n, nodes or n), text,
                          ServerOptions(out=str(tmp_path / "run"), num_nodes=nodes or n))
    st, final = _in_process(text)
    for a, b in zip(T.leaves(res.server), T.leaves(st.server), strict=True):
        assert torch.allclose(a.double(), b.double(), atol=1e-5)
    for key, v in final.items():
        assert abs(res.final[key] - v) < 1e-5, key
    return res


def _in_process(text):
    import tomllib

    cfg = validate(tomllib.loads(text))
    sim = build_local(cfg)
    st = sim.init_state()
    for _ in range(cfg.run.rounds):
        sim.round(st)
    return st, summarize({"seen": sim.evaluate(st, ("seen",))["seen"]})


MOCHA_CONFIG = """
[data]
name = "related_tasks"
m = 5
d = 4
seed = 2

[model]
name = "linear"
bias = false

[algorithm]
name = "mocha"
lam = 0.1
omega_every = 2

[optim]
lr = 1.0

[run]
rounds = 3
batch_size = 1000
seed = 5

[systems]
variability = "high"
"""


@pytest.mark.slow
@pytest.mark.parametrize("alg,extra,k", [("fedem", "num_components = 2", 3), ("fedavg", "", 0),
                                         ("clustered", "warmup_rounds = 1\neps1 = 10.0\neps2 = 0.01", 0),
                                         ("mocha", "", 0),
                                         ("dfedem", 'num_components = 2\ntopology = "ring"', 0),
                                         ("dsgd", 'topology = "erdos_renyi"\nedge_prob = 0.4', 0)])
def test_flower_simulation_equals_simulator(alg, extra, k, tmp_path):
    """The Flower executor runs the engine's loop: the same server state and metrics as in-process, for a
    global model, FedEM's mixture, Clustered FL's split clusters, MOCHA with stragglers, and D-FedEM / D-SGD
    as server-relayed gossip (their personalized models live on the nodes: the metrics are the check)."""
    raw = MOCHA_CONFIG if alg == "mocha" else CONFIG.format(alg=alg, extra=extra, k=k)
    # every message over WireGrid (Flower's protobuf both ways, one Context per SuperNode); the simulation engine's
    # own path (Ray actors), the same for every method, is taken by the interrupted-run test (FedEM, compared
    # exactly with the in-process run), the crash and the Ray-cluster tests
    res = _flower_equals_in_process(raw, tmp_path)
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "checkpoint.pt").exists()
    if alg == "clustered":
        assert int(res.server.assign.max()) >= 1  # the split happened, and reached the clients over Flower


@pytest.mark.slow
@pytest.mark.parametrize("tables", [
    '[robust]\naggregator = "centered_clip"\nbucketing = 2\nclip_norm = 5.0\n\n'
    '[attack]\nkind = "ipm"\nfraction = 0.2\n',
    '[robust]\nclip_norm = 5.0\n\n[attack]\nkind = "signflip"\nfraction = 0.2\nstrength = 3.0\n\n[privacy]\n'
    'clip_norm = 2.0\nnoise_multiplier = 0.3\nsampling = "fixed"\nreproducible_noise = true\n',
], ids=["robust", "private"])
def test_robust_aggregation_attacks_and_privacy_over_flower_equal_the_simulator(tmp_path, tables):
    """[robust], [attack] and [privacy] act in the engine on the server: over Flower they give the simulator's
    result (an omniscient attack and bucketing's per-round permutation included; DP noise drawn from the run's
    seed with reproducible_noise: the secure default differs between any two runs).  A robust aggregator and
    [privacy] exclude each other (the noised mean is the mechanism)."""
    raw = CONFIG.format(alg="fedem", extra="num_components = 2", k=0) + "\n" + tables
    # both over WireGrid, on 2 SuperNodes: [robust], [attack] and [privacy] act in the ServerApp, whatever carries
    # the messages (the simulation engine's own path: the interrupted-run, crash and Ray-cluster tests)
    res = _flower_equals_in_process(raw, tmp_path, nodes=2)
    assert len(res.summary["attackers"]) == 1
    if "[privacy]" in tables:
        assert 0 < res.summary["epsilon"] < float("inf")


@pytest.mark.slow
def test_flower_crashing_client_is_dropped_and_server_resumes(tmp_path, monkeypatch):
    import tomllib

    from fedmtl.flower.simulation import simulate

    monkeypatch.setenv("FEDMTL_FLOWER_FAIL", "1:1,3:2")
    text = dumps(validate(tomllib.loads(CONFIG.format(alg="fedavg", extra="", k=0))).raw)
    res = simulate(text, out=tmp_path / "run", round_timeout=120)
    assert [h["dropped"] for h in res.history] == [0, 1, 1]
    assert res.summary["dropped_updates"] == 2
    st, final = _in_process(text)  # the same run without crashes
    assert abs(res.final["seen_test_acc"] - final["seen_test_acc"]) < 0.15
    assert max(float((a - b).abs().max()) for a, b in zip(T.leaves(res.server), T.leaves(st.server),
                                                          strict=True)) > 1e-4  # the drops changed the model
    # a restarted server finds the checkpoint of round 3 and only evaluates: the ServerApp's own resume, here with
    # its nodes over WireGrid (a resume over the simulation engine is the interrupted-run test's)
    from fedmtl.flower.apps import ServerOptions, server_main
    from fedmtl.flower.loopback import WireGrid, server_identity

    n = validate(tomllib.loads(text)).build_data().seen.num_clients
    with server_identity():
        again = server_main(WireGrid.spread(text, n, n), text,
                            ServerOptions(out=str(tmp_path / "run"), num_nodes=n, round_timeout=120))
    assert len(again.history) == 3
    for a, b in zip(T.leaves(again.server), T.leaves(res.server), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_deployment_with_node_local_data_tls_node_authentication_and_secure_aggregation(tmp_path, request):
    """A real SuperLink (TLS, node authentication) and three SuperNodes on 127.0.0.1, each with its warm worker and
    only its own clients' .npz files (disjoint folders), run two apps through ``flwr run``, one after the other:

    - 2 FedEM rounds, whose app config describes another federation (other seed, other size), so no node could
      rebuild its data from it.  The result equals the in-process simulator on the original data; an unregistered
      node is refused by the SuperLink; private keys are 0600 and the CA key is not among the files a node receives.
    - a FedAvg round with SecAgg+ (the project's ClientApp applies the secure aggregation mod, the worker trains):
      the result equals the simulator's to the quantization bound.

    Readiness is polled (every second, up to FEDMTL_DEPLOY_TIMEOUT, default 300 s); once the nodes are up, every
    process the deployment started runs.  A KeyboardInterrupt ends the ``with`` block (``__exit__`` stops on every
    way out alike), and then no process the deployment started, nor any they spawned (the SuperExecs run in sessions
    of their own), still runs.  (One deployment for both apps and the interrupt: starting one is most of each app's
    time.)"""
    import json
    import stat
    import tomllib

    from fedmtl.data.npz import export
    from fedmtl.flower.deploy import LocalDeployment, running
    from fedmtl.flower.project import write_project
    from fedmtl.runs import checkpoint
    from fedmtl.secure_aggregation import mean_error_bound

    from .test_flower_secagg import _text as secure_text
    from .test_flower_trust import _alive, _kill_leftovers

    text = CONFIG.format(alg="fedem", extra="num_components = 2", k=3).replace("rounds = 3", "rounds = 2")
    cfg = validate(tomllib.loads(text))
    data = cfg.build_data()
    sites = [tmp_path / "site_a", tmp_path / "site_b", tmp_path / "site_c"]
    for site, ks in zip(sites, ([0, 1], [2, 3], [4]), strict=True):
        export(data, site, ks)
    other = validate(tomllib.loads(text.replace("num_clients = 5", "num_clients = 2").replace("seed = 2", "seed = 77")))
    app = write_project(other, tmp_path / "app", 5)
    secure = validate(tomllib.loads(secure_text("fedavg")))
    assert secure.raw["data"] == cfg.raw["data"]  # the same federation: the nodes' files serve both apps
    secure_app = write_project(secure, tmp_path / "secure_app", 3)
    up: list[int] = []
    pids: list[int] = []
    request.addfinalizer(lambda: _kill_leftovers([*up, *pids]))  # hygiene, after the assertions: what a failure left
    # every SuperNode with its warm worker (the project's ClientApp relays each message to it over a Unix socket); the
    # block ends with a KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt), LocalDeployment(tmp_path / "dep", data_dirs=sites, workers=True) as dep:
        dep.wait_for_nodes(3)
        up = dep.pids()
        # every process it started runs, and more: the SuperLink's SuperExec (in a session of its own)
        assert set(dep.started) <= set(up) and len(up) > len(dep.started), (dep.started, up)
        intruder = dep.start_unregistered_node()
        log = dep.run(app, tmp_path / "out")
        intruder.wait(300)
        # the ServerApp's log (here streamed by flwr run --stream) has fedmtl's lines: nodes, rounds, the end
        assert "flower server: 3 SuperNodes hold 5 clients" in log, log[-3000:]
        assert "fedem round 2/2  loss" in log and "fedem finished round 2/2" in log, log[-3000:]
        assert f"results in {tmp_path / 'out'}" in log
        # started as DEPLOY.md tells an operator: the SuperLink on every interface with a database, each node on a
        # port of its own
        link_cmd = dep.commands["superlink"]
        assert link_cmd[link_cmd.index("--host") + 1] == "0.0.0.0" and "--database" in link_cmd
        ports = [dep.commands[f"supernode{i}"][dep.commands[f"supernode{i}"].index("--port") + 1] for i in range(3)]
        assert len(set(ports)) == 3
        assert dep.online_nodes() == 3  # the unregistered key never joined
        # refused by the SuperLink, for its key: the link logs the intruder's public key as unknown, and the
        # node exits with Flower's exit code 305 (SuperNode activation refused)
        from cryptography.hazmat.primitives import serialization

        priv = serialization.load_ssh_private_key(dep.keys[-1][0].read_bytes(), None)
        pem = priv.public_key().public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        link = (tmp_path / "dep" / "superlink.log").read_text()
        refused = [ln for ln in link.splitlines() if "No SuperNode found with the given public key" in ln]
        assert refused and repr(pem.encode())[2:-1] in refused[0], link[-3000:]
        assert intruder.returncode != 0
        assert "Exit Code: 305" in (tmp_path / "dep" / "unregistered.log").read_text()
        for key in [tmp_path / "dep" / "certs" / "server.key", tmp_path / "dep" / "certs-ca" / "ca.key",
                    *(priv for priv, _ in dep.keys)]:
            assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert not (tmp_path / "dep" / "certs" / "ca.key").exists()
        # the second app on the same nodes: one FedAvg round with SecAgg+
        secure_log = dep.run(secure_app, tmp_path / "secure_out")
        assert "secure aggregation (SecAgg+) over 3 SuperNodes" in secure_log, secure_log[-3000:]
        assert "fedavg finished round 1/1" in secure_log, secure_log[-3000:]
        pids = dep.pids()
        # the SuperLink, its SuperExec, three SuperNodes with their SuperExecs, 3 workers
        assert len(pids) >= 10, pids
        for i in range(3):  # the messages went through the workers: they built the nodes' data
            assert "serving" in (tmp_path / "dep" / f"worker{i}.log").read_text()
            assert stat.S_IMODE((tmp_path / "dep" / f"worker{i}" / "worker.sock").stat().st_mode) == 0o600
        raise KeyboardInterrupt  # the way out a Ctrl-C takes: every process stops all the same
    assert not [pid for pid in {*up, *pids} if _alive(pid) or running(pid)]
    assert not (tmp_path / "out" / ".lock").exists()  # the ServerApp released its run directory
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    server = checkpoint.load(tmp_path / "out" / "checkpoint.pt")["server"]
    st, final = _in_process(dumps(cfg.raw))
    for a, b in zip(server.values(), T.to_named(st.server).values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    for key, v in final.items():
        assert abs(summary["final"][key] - v) < 1e-5, key
    # SecAgg+: the simulator's round, to the quantization bound (and not exactly: the sum went through the masks)
    server = checkpoint.load(tmp_path / "secure_out" / "checkpoint.pt")["server"]
    sim = build_local(secure)
    st = sim.init_state()
    payload = T.to_named(T.tmap(lambda x: x.clone(), st.server))
    sim.round(st)
    for (name, a), b in zip(server.items(), T.to_named(st.server).values(), strict=True):
        m = float((b.double() - payload[name].double()).abs().max())
        assert 0 < float((a.double() - b.double()).abs().max()) <= mean_error_bound(3, 1.0, 1 << 16, 1.0, m) + 1e-6
    # metrics.csv has the simulator's columns in the simulator's order
    import fedmtl

    fedmtl.run(cfg.raw, out=tmp_path / "sim")
    assert ((tmp_path / "out" / "metrics.csv").read_text().splitlines()[0]
            == (tmp_path / "sim" / "metrics.csv").read_text().splitlines()[0])
    assert summary["rounds"] == 2 and len((tmp_path / "out" / "metrics.csv").read_text().splitlines()) == 3


def test_cli_writes_a_flower_app_project(tmp_path):
    import tomllib

    from fedmtl.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(alg="fedavg", extra="", k=0))
    assert main(["flower", "app", str(cfg), "--out", str(tmp_path / "app")]) == 0
    py = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    assert py["tool"]["flwr"]["app"]["components"]["serverapp"] == "fedmtl_app.server_app:app"
    embedded = tomllib.loads(py["tool"]["flwr"]["app"]["config"]["fedmtl-config"])
    assert embedded["algorithm"]["name"] == "fedavg" and embedded["data"]["num_clients"] == 5
    assert "enable-supernode-auth" in (tmp_path / "app" / "DEPLOY.md").read_text()
    assert main(["flower", "app", str(cfg), "--clients", "7", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the deliberate kill
def test_interrupted_flower_run_resumes_exactly_from_node_state_files(tmp_path, monkeypatch):
    """A server killed after round 3 (checkpoint of round 2) resumes in a new Flower run: the nodes find
    their clients' states (FedEM's pi) in their state directory, take the version written before the
    checkpoint's round (not the newer one), and the run ends exactly as an uninterrupted one."""
    import stat
    import tomllib

    from fedmtl.engine.round import Engine
    from fedmtl.flower.simulation import simulate

    raw = CONFIG.format(alg="fedem", extra="num_components = 2", k=0).replace("rounds = 3", "rounds = 4")
    text = dumps(validate(tomllib.loads(raw + "checkpoint_every = 2\n")).raw)
    monkeypatch.setenv("FEDMTL_FLOWER_STATE_DIR", str(tmp_path / "state"))
    real = Engine.round

    def dies_in_round_4(self, state):
        if state.round == 3:
            raise KeyboardInterrupt("server killed")
        return real(self, state)

    monkeypatch.setattr(Engine, "round", dies_in_round_4)
    with pytest.raises(BaseException):  # noqa: B017 (the server's death, however Flower reports it)
        simulate(text, out=tmp_path / "run")
    files = sorted((tmp_path / "state").rglob("client0.r*.pt"))
    assert [f.name for f in files] == ["client0.r0.pt", "client0.r1.pt", "client0.r2.pt"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    monkeypatch.setattr(Engine, "round", real)
    res = simulate(text, out=tmp_path / "run")
    st, final = _in_process(text)
    for a, b in zip(T.leaves(res.server), T.leaves(st.server), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    for key, v in final.items():
        assert abs(res.final[key] - v) < 1e-5, key


def test_simulation_resources_reach_the_backend(monkeypatch):
    """`fedmtl flower simulate` reserves --cpus-per-node / --gpus-per-node per virtual node of a Ray cluster it starts
    with --cpus CPUs, or joins one by --ray-address (then without CPU counts, which Ray refuses there)."""
    from fedmtl.flower.simulation import backend_config

    assert backend_config(4, 2.0) == {"client_resources": {"num_cpus": 2.0, "num_gpus": 0.0},
                                      "init_args": {"num_cpus": 4, "address": "local"}}
    joined = backend_config(1, 0.5, 0.0, "127.0.0.1:6379")
    assert joined["init_args"] == {"address": "127.0.0.1:6379"}
    assert joined["client_resources"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    with pytest.raises(ValueError, match="cpus-per-node 3 is more than the 2"):
        backend_config(2, 3.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            backend_config(2, 1.0, 0.5)


@pytest.mark.slow
def test_simulation_joins_a_running_ray_cluster(tmp_path):
    """A Ray head started with `ray start --head` on loopback; `fedmtl flower simulate --ray-address` runs its virtual
    SuperNodes there, 2 CPUs each, and gives the in-process result.  The head has a folder of its own and only its
    processes are stopped at the end (`ray stop` would stop every Ray instance on the machine, other tests' too); a
    simulation started meanwhile without --ray-address starts its own instance, never joins this one."""
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import tomllib
    from pathlib import Path

    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        ray = Path(shutil.which("ray") or "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = dumps(validate(tomllib.loads(CONFIG.format(alg="fedavg", extra="", k=0))).raw)
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    env = {"RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    start = subprocess.run([str(ray), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                            "--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats",
                            "--temp-dir", temp], capture_output=True, text=True, timeout=180,
                           env={**env, "FEDMTL_TEST_RAY_HEAD": temp})
    try:
        assert start.returncode == 0, start.stderr[-2000:]
        p = subprocess.run([sys.executable, "-m", "fedmtl", "flower", "simulate", str(cfg), "--out",
                            str(tmp_path / "run"), "--ray-address", f"127.0.0.1:{port}", "--cpus-per-node", "2", "-q"],
                           capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:]
    finally:
        mark = f"FEDMTL_TEST_RAY_HEAD={temp}".encode()
        for proc in Path("/proc").iterdir():  # this head's processes: they inherit its environment, marked
            try:
                if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
    import json

    got = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    _, final = _in_process(text)
    for key, v in final.items():
        assert abs(got[key] - v) < 1e-5, key


def _message(content, kind, run_id=7):
    from flwr.app.message.message import make_message
    from flwr.app.metadata import Metadata

    return make_message(Metadata(run_id=run_id, message_id="m1", src_node_id=1, dst_node_id=2, reply_to_message_id="",
                                 group_id="g", created_at=time.time(), ttl=3600.0, message_type=kind), content)


def test_warm_worker_serves_the_relay_app(tmp_path):
    """The project's ClientApp (``relay_app``) forwards a message to ``fedmtl flower worker`` over its socket and
    gets the reply the in-process handler gives; the worker keeps the node warm across messages of a run; a worker
    refuses a socket directory others may enter, a non-socket file in its place, and a malformed frame."""
    import os
    import socket as socketlib
    import threading
    import tomllib

    from flwr.app import ConfigRecord, Context, RecordDict

    from fedmtl.flower import relay_app
    from fedmtl.flower.apps import NodeCache, handle_query
    from fedmtl.flower.worker import Worker, WorkerError, recv_frame, send_frame

    text = dumps(validate(tomllib.loads(CONFIG.format(alg="fedavg", extra="", k=0))).raw)
    sock = tmp_path / "w" / "worker.sock"
    worker = Worker(sock)
    stop, ready = threading.Event(), threading.Event()
    th = threading.Thread(target=worker.serve, args=(stop, ready.set), daemon=True)
    th.start()
    assert ready.wait(30)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600 and stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        node_config = {"partition-ids": "0-2", "fedmtl-worker": str(sock)}
        ctx = Context(run_id=7, node_id=2, node_config=node_config, state=RecordDict(),
                      run_config={"fedmtl-config": text})
        msg = _message(RecordDict({"config": ConfigRecord({"x": 1})}), "query")
        got = relay_app.relay(msg, ctx)
        want = handle_query(msg, Context(run_id=7, node_id=2, node_config={"partition-ids": "0-2"},
                                         state=RecordDict(), run_config={}), text, NodeCache())
        assert dict(got.content["info"]) == dict(want.content["info"])
        assert got.metadata.reply_to_message_id == "m1"
        relay_app.relay(msg, ctx)
        assert worker.served == 2 and len(worker.contexts) == 1 and len(worker.runs.of(7).nodes) == 1  # built once
        # an error on the worker reaches the ClientApp as one line naming it
        bad = Context(run_id=7, node_id=2, node_config={"fedmtl-worker": str(sock)}, state=RecordDict(),
                      run_config={"fedmtl-config": text})
        with pytest.raises(RuntimeError, match="fedmtl worker at .*this SuperNode has no data"):
            relay_app.relay(_message(RecordDict(), "query", run_id=8), bad)
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as c:  # not a frame
            c.connect(str(sock))
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            header, _ = recv_frame(c)
            assert header["ok"] is False and "not a fedmtl worker frame" in header["error"]
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as c:  # a frame, not a Flower message
            c.connect(str(sock))
            send_frame(c, {"node_config": {}, "run_config": {}}, b"\xff\x00garbage")
            header, _ = recv_frame(c)
            assert header["ok"] is False
        with pytest.raises(WorkerError, match="another worker is listening"):
            Worker(sock).bind()
    finally:
        stop.set()
        th.join(10)
    assert not sock.exists()
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(WorkerError, match="closed to others"):
        Worker(tmp_path / "open" / "w.sock").bind()
    (tmp_path / "w" / "worker.sock").write_text("not a socket")
    with pytest.raises(WorkerError, match="not a socket"):
        Worker(tmp_path / "w" / "worker.sock").bind()


def test_warm_nodes_are_kept_per_run():
    """Flower 1.42's simulation builds the ClientApp anew for every message: the nodes stay warm in the process,
    per run (a new run, a resumed server's included, starts from fresh nodes, never another run's client states)."""
    from fedmtl.flower.apps import RunCaches

    runs = RunCaches(keep=2)
    a = runs.of(1)
    assert runs.of(1) is a
    b = runs.of(2)
    assert b is not a and runs.of(1) is a
    runs.of(3)  # the least recently used run (2) goes
    assert list(runs.runs) == [1, 3] and runs.of(2) is not b


@pytest.mark.slow
# the methods whose payloads or replies differ from a global model's (normalized updates, per-client tables,
# prototypes, a probe of the loss, several parts); FedLC's payload and reply are FedAvg's, checked above
@pytest.mark.parametrize("alg,extra", [("fednova", ""), ("qffl", ""), ("fedamp", "sigma = 10.0"), ("fedproto", ""),
                                       ("fedfomo", "num_models = 2"), ("gpfl", ""), ("fedpac", ""), ("fedcp", "")])
def test_the_field_s_shared_baselines_over_flower_equal_the_simulator(alg, extra, tmp_path):
    """The methods every peer library ships run over Flower as in-process: the same server state and metrics (an MLP,
    so that the body/head methods have a head)."""
    _flower_equals_in_process(CONFIG.format(alg=alg, extra=extra, k=0).replace(
        '[model]\nname = "linear"', '[model]\nname = "mlp"\nhidden = [8]'), tmp_path)


@pytest.mark.slow
@pytest.mark.correctness(
    ("fedsa_lora",), "over Flower on a model with adapters: the same server state and metrics as in-process, the "
    "server state (what is sent) holding only the adapters; every node builds the same frozen base from the config",
    guards="a base drawn differently on each node, base weights crossing the network, personal B matrices lost "
    "between rounds on a node")
def test_adapters_over_flower_equal_the_simulator(tmp_path):
    raw = CONFIG.format(alg="fedsa_lora", extra="", k=0).replace(
        '[model]\nname = "linear"', '[model]\nname = "mlp"\nhidden = [8]\n\n[model.adapters]\nrank = 2\nalpha = 4.0')
    res = _flower_equals_in_process(raw, tmp_path)
    assert {k.rsplit(".", 1)[-1].strip("[]'\"") for k in T.to_named(res.server)} == {"lora_A", "lora_B"}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["world-writable", "file", "symlink", "live", "too-long", "under-a-file"])
def test_worker_refuses_a_bad_socket_path_in_one_line_before_serving(tmp_path, case):
    """``fedmtl flower worker --socket PATH`` refuses, before it says it serves: a socket in a directory others may
    enter, an existing file, a symbolic link (even to a live socket), a socket another worker listens on, a path too
    long for a Unix socket, a directory that cannot be made; each one line on stderr naming the path, exit 2."""
    import os
    import socket as socketlib
    import subprocess

    home = tmp_path / "w"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    path = home / "worker.sock"
    live = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    if case == "world-writable":
        (tmp_path / "open").mkdir()
        os.chmod(tmp_path / "open", 0o1777)
        path = tmp_path / "open" / "worker.sock"
    elif case == "file":
        path.write_text("precious")
    elif case in ("symlink", "live"):
        target = home / "live.sock"
        live.bind(str(target))
        live.listen(1)
        if case == "symlink":
            path.symlink_to(target)
        else:
            path = target
    elif case == "too-long":
        path = home / ("d" * 120) / "worker.sock"
    else:
        (home / "plain").write_text("a file")
        path = home / "plain" / "worker.sock"
    # the command in this process (a worker that served instead of refusing is stopped by the alarm)
    import contextlib
    import io
    import signal

    from fedmtl.cli import main

    def served(signum, frame):
        raise AssertionError(f"{case}: the worker served instead of refusing")

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, served)
    signal.alarm(60)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["flower", "worker", "--socket", str(path)])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        live.close()
    p = subprocess.CompletedProcess([], code, out.getvalue(), err.getvalue())
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "serving" not in p.stdout and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("fedmtl: error: "), p.stderr
    assert len(p.stderr) < 400 and (path.name in p.stderr or "..." in p.stderr)
    if case == "file":
        assert path.read_text() == "precious"
    if case == "symlink":
        assert path.is_symlink()


def test_worker_replaces_a_dead_workers_socket(tmp_path):
    """A socket file left by a worker that died (nothing listens) is replaced, and the new worker listens there."""
    import os
    import socket as socketlib

    from fedmtl.flower.worker import Worker

    home = tmp_path / "w"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    path = home / "worker.sock"
    dead = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nothing listens
    sock = Worker(path).bind()
    try:
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as c:
            c.connect(str(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        sock.close()
