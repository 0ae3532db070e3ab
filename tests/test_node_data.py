"""Node-local data (``fedmtl.data.npz``): export and read back, and every malformed directory refused by name;
the Flower server's refusal of nodes that cannot form one federation (``federation_of``)."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest
import torch

from fedmtl.cli import main
from fedmtl.config import validate
from fedmtl.data.federated import DataError
from fedmtl.data.npz import export, load_dir, parse_range

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 5
n_test = 10
max_samples = 60
seed = 3

[model]
name = "linear"

[algorithm]
name = "fedavg"

[run]
rounds = 2
"""


@pytest.fixture(scope="module")
def data():
    return validate(tomllib.loads(CONFIG)).build_data()


def test_export_and_load_round_trip(data, tmp_path):
    export(data, tmp_path / "a", [1, 4])
    ids, back = load_dir(tmp_path / "a")
    assert ids.tolist() == [1, 4] and back.num_classes == data.num_classes
    for row, k in enumerate([1, 4]):
        for split in ("train", "test"):
            x, y = getattr(back.seen, split).client(row)
            x0, y0 = getattr(data.seen, split).client(k)
            assert torch.equal(x, x0) and torch.equal(y, y0)
    _, train_only = load_dir(tmp_path / "a", train_only=True)  # what a node reads for a train message
    assert torch.equal(train_only.seen.train.x, back.seen.train.x) and train_only.seen.test.x.shape[0] == 0
    info = json.loads((tmp_path / "a" / "dataset.json").read_text())
    assert info["format"] == "fedmtl-npz/1" and info["num_classes"] == data.num_classes


def test_cli_export_writes_the_requested_clients(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    assert main(["data", "export", str(cfg), "--out", str(tmp_path / "d"), "--clients", "2-4"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").glob("*.npz")) == ["client_2.npz", "client_3.npz", "client_4.npz"]
    assert main(["data", "export", str(cfg), "--out", str(tmp_path / "e"), "--clients", "4-9"]) == 2
    assert main(["data", str(cfg)]) == 0
    assert parse_range("0-2,5", 6) == [0, 1, 2, 5]


def _dir(tmp_path, data, ids=(0, 1)):
    d = tmp_path / "site"
    export(data, d, list(ids))
    return d


def test_corrupt_and_malformed_directories_are_refused_by_name(data, tmp_path):
    d = _dir(tmp_path, data)
    (d / "client_1.npz").write_bytes(b"PK\x03\x04 not a zip at all")
    with pytest.raises(DataError, match="client_1.npz"):
        load_dir(d)
    d = _dir(tmp_path / "b", data)
    np.savez(d / "client_1.npz", x_train=np.zeros((3, 5), np.float32), y_train=np.zeros(3, np.int64))
    with pytest.raises(DataError, match=r"client_1.npz: missing array 'x_test'"):
        load_dir(d)
    d = _dir(tmp_path / "c", data)
    obj = np.empty(2, dtype=object)
    obj[:] = [{"a": 1}, {"b": 2}]
    np.savez(d / "client_1.npz", x_train=obj, y_train=np.zeros(2, np.int64), x_test=obj, y_test=np.zeros(2))
    with pytest.raises(DataError, match="client_1.npz"):  # object arrays need pickle: refused, never loaded
        load_dir(d)
    d = _dir(tmp_path / "d", data, ids=(0, 1, 2))  # the odd one out of three (with two, either could be)
    np.savez(d / "client_1.npz", x_train=np.zeros((3, 7), np.float32), y_train=np.zeros(3, np.int64),
             x_test=np.zeros((1, 7), np.float32), y_test=np.zeros(1, np.int64))
    with pytest.raises(DataError, match=r"client_1.npz: feature shape \(7,\)"):
        load_dir(d)
    d = _dir(tmp_path / "e", data)
    np.savez(d / "client_0.npz", x_train=np.zeros((3, 5), np.float32), y_train=np.array([0, 1, 99]),
             x_test=np.zeros((0, 5), np.float32), y_test=np.zeros(0, np.int64))
    with pytest.raises(DataError, match="labels go up to 99"):
        load_dir(d)
    d = _dir(tmp_path / "f", data)
    (d / "dataset.json").write_text('{"format": "fedmtl-npz/1", "num_classes": 1}')
    with pytest.raises(DataError, match="num_classes"):
        load_dir(d)
    (d / "dataset.json").unlink()
    with pytest.raises(DataError, match="no dataset.json"):
        load_dir(d)
    d = _dir(tmp_path / "g", data)
    (d / "client_one.npz").write_bytes(b"")
    with pytest.raises(DataError, match="client_one.npz"):
        load_dir(d)
    # a FIFO where a file belongs is refused by its kind before it is opened (opening one would wait forever)
    import os

    d = _dir(tmp_path / "h", data)
    (d / "client_1.npz").unlink()
    os.mkfifo(d / "client_1.npz")
    with pytest.raises(DataError, match=r"client_1.npz: a FIFO"):
        load_dir(d)
    d = _dir(tmp_path / "i", data)
    (d / "dataset.json").unlink()
    os.mkfifo(d / "dataset.json")
    with pytest.raises(DataError, match="dataset.json"):
        load_dir(d)


def _info(ids, counts, shape=(5,), classes=3, sha=None):
    from fedmtl.flower.apps import _sha

    return {"client_ids": ids, "train_counts": counts, "config_sha": sha or _sha("cfg"), "source": "data-dir",
            "feature_shape": list(shape), "feature_dtype": "float32", "num_classes": classes, "meta": "{}"}


def test_server_refuses_nodes_that_do_not_form_one_federation():
    pytest.importorskip("flwr")
    from fedmtl.flower.apps import NodeError, federation_of

    fed, dtype, owner = federation_of({7: _info([0, 2], [5, 6]), 9: _info([1], [4])}, "cfg")
    assert fed.train_counts.tolist() == [5, 4, 6] and owner == {0: 7, 1: 9, 2: 7} and dtype == torch.float32
    with pytest.raises(NodeError, match=r"SuperNode 9 reports feature shape \[6\] but SuperNode 7 reports \[5\]"):
        federation_of({7: _info([0], [5]), 9: _info([1], [4], shape=(6,))}, "cfg")
    with pytest.raises(NodeError, match="number of classes"):
        federation_of({7: _info([0], [5]), 9: _info([1], [4], classes=10)}, "cfg")
    with pytest.raises(NodeError, match="both hold client 1"):
        federation_of({7: _info([0, 1], [5, 5]), 9: _info([1], [4])}, "cfg")
    with pytest.raises(NodeError, match=r"no node holds client\(s\) \[1\]"):
        federation_of({7: _info([0], [5]), 9: _info([2], [4])}, "cfg")
    with pytest.raises(NodeError, match="another experiment config"):
        federation_of({7: _info([0], [5], sha="x")}, "cfg")


def test_deploy_guide_matches_the_code():
    """DEPLOY.md's fedmtl commands parse, and the node-config keys it tells operators to set are the ones the
    ClientApp reads."""
    import re
    import shlex
    from pathlib import Path

    from fedmtl.cli import build_parser

    text = (Path(__file__).resolve().parents[1] / "DEPLOY.md").read_text()
    commands = [ln.split("#")[0].strip().removesuffix("&") for ln in text.splitlines()
                if ln.strip().startswith("fedmtl ")]
    assert len(commands) >= 3
    for c in commands:
        build_parser().parse_args(shlex.split(c)[1:])
    flower = Path(__file__).resolve().parents[1] / "src" / "fedmtl" / "flower"
    apps = (flower / "apps.py").read_text() + (flower / "relay_app.py").read_text()
    for key in set(re.findall(r"--node-config '([^']*)'", text)[0].split()):
        name = key.split("=")[0]
        assert f'"{name}"' in apps, name


def _flower_commands(text: str, program: str) -> list[list[str]]:
    """Every ``program ...`` command of a markdown text (continuation lines joined, a trailing ``&`` dropped), as
    argument lists."""
    import shlex

    out, lines = [], text.splitlines()
    for i, ln in enumerate(lines):
        if ln.strip().startswith(program + " "):
            cmd = ln.strip()
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            args = shlex.split(cmd.removesuffix("&"))[1:]
            out.append(args)
    return out


@pytest.mark.slow
def test_deploy_guides_give_the_tested_host_ports_and_database(tmp_path):
    """DEPLOY.md and the project's generated DEPLOY.md start the SuperLink and SuperNodes with exactly the options the
    loopback-tested ``LocalDeployment`` uses (parsed by Flower's own parsers): the SuperLink listens on every interface
    with a database, every SuperNode names its own port, and two SuperNodes on one machine take different ports."""
    pytest.importorskip("flwr")
    from pathlib import Path

    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    from fedmtl.config import load
    from fedmtl.flower.deploy import superlink_args, supernode_args
    from fedmtl.flower.project import write_project

    def given(parser, args):  # the options on the command line (which Flower's parser accepts), by destination
        parser.parse_args(args)
        return {parser._option_string_actions[a.split("=")[0]].dest for a in args if a.startswith("--")}

    link, node = _parse_args_run_superlink(), _parse_args_run_supernode()
    tested_link = given(link, superlink_args(tmp_path, 9091, tmp_path / "db"))
    tested_node = given(node, supernode_args("127.0.0.1:9091", tmp_path / "ca.crt", tmp_path / "k", 'a="1"', 9094))
    assert {"host", "port", "database", "enable_supernode_auth"} <= tested_link
    assert {"port", "superlink", "root_certificates", "auth_supernode_private_key"} <= tested_node
    write_project(load("synthetic/fedem"), tmp_path / "app", 2, home=tmp_path)
    guides = {"DEPLOY.md": (Path(__file__).resolve().parents[1] / "DEPLOY.md").read_text(),
              "app/DEPLOY.md": (tmp_path / "app" / "DEPLOY.md").read_text()}
    for name, text in guides.items():
        links = _flower_commands(text, "flower-superlink")
        nodes = _flower_commands(text, "flower-supernode")
        assert links and nodes, name
        for args in links:
            assert given(link, args) == tested_link, (name, args)
            assert link.parse_args(args).host == "0.0.0.0", name
        for args in nodes:
            assert given(node, args) == tested_node, (name, args)
    sequence = guides["DEPLOY.md"].split("## The whole sequence")[1].split("\n## ")[0]
    ports = [node.parse_args(a).port for a in _flower_commands(sequence, "flower-supernode")]
    assert len(ports) == 2 and len(set(ports)) == 2
    assert str(tmp_path / "certs" / "ca.crt") in (tmp_path / "app" / "flwr-config.toml").read_text()
    assert f"fedmtl-out='{tmp_path}/runs/exp1'" in guides["app/DEPLOY.md"]


@pytest.mark.slow
def test_npz_folder_runs_own_data_from_the_command_line(tmp_path, capsys):
    """[data] name = "npz_folder" reads what `fedmtl data export` writes: the same federation trains to the same
    numbers as the config it was exported from."""
    import fedmtl
    from fedmtl.config import read_toml

    sets = ["--set", "data.num_clients=8"]
    assert main(["data", "export", "synthetic/fedavg", *sets, "--out", str(tmp_path / "d")]) == 0
    raw = read_toml("synthetic/fedavg")
    raw["data"]["num_clients"] = 8
    raw["run"].update(rounds=3, eval_every=3, checkpoint_every=0)
    built = fedmtl.run(raw)
    raw["data"] = {"name": "npz_folder", "path": str(tmp_path / "d")}
    own = fedmtl.run(raw)
    assert own.final == pytest.approx(built.final, abs=1e-6)
    raw["data"]["path"] = str(tmp_path / "missing")
    with pytest.raises(DataError, match="no such directory"):
        fedmtl.run(raw)


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_cli_export_into_an_existing_export_is_refused_without_overwrite(tmp_path, capsys):
    """A second export into a site's folder (here another dataset for the same clients) is refused, one line naming
    the folder, exit 2, every file byte-identical; with --overwrite the folder holds the new export only."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    other = tmp_path / "o.toml"
    other.write_text(CONFIG.replace("seed = 3", "seed = 4"))
    d = tmp_path / "d"
    assert main(["data", "export", str(cfg), "--out", str(d), "--clients", "2-4"]) == 0
    before = _snapshot(d)
    capsys.readouterr()
    assert main(["data", "export", str(other), "--out", str(d), "--clients", "2-4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(d) in err and "--overwrite" in err, err
    assert _snapshot(d) == before
    assert main(["data", "export", str(other), "--out", str(d), "--clients", "3", "--overwrite"]) == 0
    after = _snapshot(d)
    assert sorted(after) == ["client_3.npz", "dataset.json"]  # the old export's clients 2 and 4 are gone
    assert after["client_3.npz"] != before["client_3.npz"]
    ids, back = load_dir(d)
    ref = validate(tomllib.loads(CONFIG.replace("seed = 3", "seed = 4"))).build_data()
    assert ids.tolist() == [3] and torch.equal(back.seen.train.x, ref.seen.train.client(3)[0])


def test_export_writes_dataset_json_last(data, tmp_path, monkeypatch):
    """An export cut short leaves no dataset.json, so the folder is never read as a (mixed) data directory."""
    import fedmtl.data.npz as npz

    calls = []
    real = np.savez

    def failing(fh, **arrays):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fh, **arrays)

    monkeypatch.setattr(npz.np, "savez", failing)
    with pytest.raises(OSError):
        export(data, tmp_path / "cut", [0, 1, 2])
    assert not (tmp_path / "cut" / "dataset.json").exists()
    with pytest.raises(DataError, match="no dataset.json"):
        load_dir(tmp_path / "cut")
