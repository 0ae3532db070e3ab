"""Node-config and run-config fuzzing of the Flower apps (``fedmtl.flower.apps``), in this process: every key a
SuperNode's ``--node-config`` can carry (``partition-ids``, ``partition-id`` / ``num-partitions``, ``data-dir``,
``state-dir``) and every key of the run config (``fedmtl-config``, ``fedmtl-out``, ``fedmtl-num-nodes``,
``fedmtl-overwrite``), with ranges such as "9-999999999", numbers out of range, NaN, 20-digit values, paths that are
FIFOs, files, devices or missing.  A node must refuse with one error line naming the key (or the file), bounded in
time and memory (``fuzz_harness.bounded``: a range of 10^9 ids is never materialized); what it accepts must be a
share of the federation it can serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from fedmtl.flower import apps  # noqa: E402

from .fuzz_harness import TINY, bounded, expect_error, make_fifo, make_huge  # noqa: E402

CFG = TINY
N = 4  # the federation's seen clients



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Every case runs in its own folder: a relative path a case gives (--out 0, --results nan) lands there."""
    monkeypatch.chdir(tmp_path)

def _ctx(node_config: dict, run_config: dict | None = None) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config or {})


BAD_IDS = ["9-999999999", "0-" + "9" * 20, "-1", "5-1", "a-b", "", ",", "1e3", "0--5", "3-", "-", "0-4", "4",
           "0-1,2-999999999", "nan", "inf", "0x1", " ", "1,2,,3,99", "0-1-2", "9" * 5000]
BAD_PARTITION = [("x", "4"), ("-1", "4"), ("4", "4"), ("0", "0"), ("0", "5"), ("0", "9" * 20), ("9" * 20, "4"),
                 ("nan", "4"), ("inf", "4"), ("1e400", "4"), ("0", "-1"), ("0", "x"), ("", "4"), ("0.5", "4"),
                 (True, "4"), (1.5, 4), ("0", "")]


@pytest.mark.parametrize("spec", BAD_IDS, ids=lambda s: repr(s if len(s) < 24 else f"{s[:12]}...({len(s)})"))
def test_partition_ids_out_of_range_are_refused(spec):
    """partition-ids beyond the federation, reversed, malformed, or a range of 10^9: one line naming the key."""
    expect_error(lambda: apps.node_of(apps.NodeCache(), _ctx({"partition-ids": spec}), CFG), "partition-ids",
                 what=f"partition-ids={spec[:40]!r}", seconds=10)


@pytest.mark.parametrize("spec,want", [("0-1", [0, 1]), ("3", [3]), ("0,2", [0, 2]), (" 1 - 2 ", [1, 2]),
                                       ("0-3", [0, 1, 2, 3]), ("2,2", [2])])
def test_partition_ids_in_range_are_served(spec, want):
    with bounded(20, what=spec):
        node = apps.node_of(apps.NodeCache(), _ctx({"partition-ids": spec}), CFG)
    assert node.ids.tolist() == want


@pytest.mark.parametrize("pid,parts", BAD_PARTITION, ids=lambda v: repr(v if len(str(v)) < 24 else str(v)[:12]))
def test_partition_id_out_of_range_is_refused(pid, parts):
    nc = {"partition-id": pid, "num-partitions": parts}
    # the key at fault named: partition-id, or num-partitions where that is what is wrong
    expect_error(lambda: apps.node_of(apps.NodeCache(), _ctx(nc), CFG), "partition",
                 what=f"partition-id={pid!r} num-partitions={parts!r}", seconds=10)


def _data_dir_kinds(tmp: Path) -> dict[str, Path]:
    (tmp / "empty").mkdir()
    (tmp / "file").write_text("x")
    full = tmp / "full"
    full.mkdir()
    (full / "dataset.json").write_text('{"format": "fedmtl-npz/1", "num_classes": 3}')
    np.savez(full / "client_0.npz", x_train=np.zeros((3, 2), np.float32), y_train=np.zeros(3, np.int64),
             x_test=np.zeros((1, 2), np.float32), y_test=np.zeros(1, np.int64))
    fifo_json = tmp / "fifojson"
    fifo_json.mkdir()
    make_fifo(fifo_json / "dataset.json")
    fifo_npz = tmp / "fifonpz"
    fifo_npz.mkdir()
    (fifo_npz / "dataset.json").write_text('{"format": "fedmtl-npz/1", "num_classes": 3}')
    make_fifo(fifo_npz / "client_0.npz")
    huge = tmp / "huge"
    huge.mkdir()
    (huge / "dataset.json").write_text('{"format": "fedmtl-npz/1", "num_classes": 3}')
    make_huge(huge / "client_0.npz")
    return {"missing": tmp / "nope", "empty": tmp / "empty", "file": tmp / "file", "fifo": make_fifo(tmp / "fifo"),
            "devnull": Path("/dev/null"), "dataset.json FIFO": fifo_json, "client npz FIFO": fifo_npz,
            "client npz 1 TB": huge, "too long": tmp / ("x" * 300), "": Path("")}


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "fifo", "devnull", "dataset.json FIFO",
                                  "client npz FIFO", "client npz 1 TB", "too long"])
def test_data_dir_of_every_kind_is_refused(tmp_path, kind):
    """data-dir that is missing, empty, a file, a FIFO, /dev/null, or holds a FIFO or a 1 TB sparse file: one line
    naming data-dir or the file, never a hang."""
    d = _data_dir_kinds(tmp_path)[kind]
    msg = expect_error(lambda: apps.node_of(apps.NodeCache(), _ctx({"data-dir": str(d)}), CFG), what=f"data-dir "
                       f"{kind}", seconds=10, fifo_roots=[tmp_path])
    assert "data-dir" in msg or str(d)[:60] in msg, msg


def test_a_node_with_a_good_data_dir_serves_it(tmp_path):
    _data_dir_kinds(tmp_path)  # builds "full" too
    with bounded(20, what="full data-dir"):
        node = apps.node_of(apps.NodeCache(), _ctx({"data-dir": str(tmp_path / "full")}), CFG)
    assert node.ids.tolist() == [0] and node.source == "data-dir"


@pytest.mark.parametrize("nc", [{}, {"state-dir": "/tmp"}, {"num-partitions": "4"}],
                         ids=["nothing", "state-dir only", "num-partitions only"])
def test_a_node_without_data_is_refused(nc):
    expect_error(lambda: apps.node_of(apps.NodeCache(), _ctx(nc), CFG), "data-dir", "partition-ids",
                 what=f"node config {nc}", seconds=10)


BAD_CONFIG = ["", "not toml [[[", "[data]\nname = 1", "\x00\xff", "[" * 5000, "x = " + "[" * 40 + "]" * 40,
              CFG.replace('"fedem"', '"nope"'), CFG + "\n[run]\nrounds = nan", "a" * 2_000_000]


@pytest.mark.parametrize("text", BAD_CONFIG, ids=lambda t: repr(t[:16]))
def test_run_config_fedmtl_config_garbage_is_refused(text):
    """The run config's fedmtl-config that is no valid experiment: one line naming fedmtl-config."""
    expect_error(lambda: apps.node_of(apps.NodeCache(), _ctx({"partition-ids": "0-1"}), text), "fedmtl-config",
                 what=f"fedmtl-config={text[:30]!r}", seconds=10)


BAD_SERVER = [("fedmtl-num-nodes", v) for v in ("x", "-1", "nan", "1e400", "9" * 20, "1.5", "", True)] + \
             [("fedmtl-overwrite", v) for v in ("maybe", "2", "", 5, 1.5)] + \
             [("fedmtl-out", v) for v in (5, "x" * 5000)]


@pytest.mark.parametrize("key,value", BAD_SERVER, ids=lambda v: repr(v if len(str(v)) < 24 else str(v)[:12]))
def test_run_config_server_keys_are_checked(key, value):
    """The ServerApp's run config keys: nonsense is one line naming the key, before any node is contacted."""
    expect_error(lambda: apps.server_options({"fedmtl-config": CFG, key: value}), key, what=f"{key}={value!r}",
                 seconds=10)


@pytest.mark.parametrize("run_config,want", [
    ({}, apps.ServerOptions()), ({"fedmtl-num-nodes": 3}, apps.ServerOptions(num_nodes=3)),
    ({"fedmtl-num-nodes": "3", "fedmtl-overwrite": "true", "fedmtl-out": "runs/x"},
     apps.ServerOptions(out="runs/x", num_nodes=3, overwrite=True)),
    ({"fedmtl-overwrite": False}, apps.ServerOptions())])
def test_run_config_server_keys_read(run_config, want):
    assert apps.server_options(run_config) == want


@pytest.mark.parametrize("content", [b"", b"garbage", b"PK\x03\x04" + b"\x00" * 64, "fifo", "dir", "nan"])
def test_a_corrupt_state_file_is_ignored_not_fatal(tmp_path, content):
    """A node's state file (state-dir) that is corrupt, a FIFO, a directory or NaN: ignored with a warning (the
    client starts afresh), never a hang or a crash."""
    import torch

    from fedmtl import tree as T

    ctx = _ctx({"partition-ids": "0-1", "state-dir": str(tmp_path / "state")})
    with bounded(30, fifo_roots=[tmp_path], what=f"state file {content!r}"):
        node = apps.node_of(apps.NodeCache(), ctx, CFG)
        conf = {"num_clients": N, "total_train": 100.0, "local_epochs": 1, "rounds": 1, "max_train": 30}
        lc, _ = apps._local_clients(node, conf)
        sub = tmp_path / "state" / apps._sha(CFG)[:16]
        sub.mkdir(parents=True)
        f = sub / "client0.r0.pt"
        if content == "fifo":
            make_fifo(f)
        elif content == "dir":
            f.mkdir()
        elif content == "nan":
            one = T.take(lc.read(node.ids[:1]), 0)
            torch.save({"round": 0, "state": {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                                              for k, v in T.to_named(one).items()}}, f)
        else:
            f.write_bytes(content)
        before = T.to_named(lc.read(node.ids))
        apps._restore(node, lc, ctx, CFG, before=5)
        after = T.to_named(lc.read(node.ids))
    assert all(torch.equal(before[k], after[k]) for k in before)
