"""ClientStore: in place and O(sampled clients), lazy initial rows, memory-mapped files with an undo journal that
makes resuming exact; the engine's fixed evaluation sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import Ditto, FedEM
from fedmtl.cli import main
from fedmtl.engine.evaluation import summarize
from fedmtl.engine.store import ClientStore, StoreError
from fedmtl.testing import all_client_states, run_rounds, simulator


class State(NamedTuple):
    v: torch.Tensor
    k: torch.Tensor


def _init(ids):
    return State(ids.double().unsqueeze(1).repeat(1, 3), ids.clone())


@pytest.mark.parametrize("kind", ["memory", "mmap"])
def test_reads_are_lazy_and_writes_in_place(kind, tmp_path):
    s = ClientStore(1000, _init, kind, tmp_path / "store")
    ptrs = [leaf.data_ptr() for leaf in s.leaves]
    got = s.read(torch.tensor([5, 999]))
    assert torch.equal(got.v, torch.tensor([[5.0] * 3, [999.0] * 3], dtype=torch.float64))  # initial rows
    assert int(s.written.sum()) == 0  # reading writes nothing
    s.write(torch.tensor([7, 3]), State(torch.full((2, 3), -1.0, dtype=torch.float64), torch.tensor([70, 30])))
    assert [leaf.data_ptr() for leaf in s.leaves] == ptrs  # in place: no copy of the population
    assert s.written.nonzero().flatten().tolist() == [3, 7]
    got = s.read(torch.tensor([3, 4, 7]))
    assert got.k.tolist() == [30, 4, 70] and float(got.v[0, 0]) == -1.0 and float(got.v[1, 0]) == 4.0
    got.v.zero_()  # reads are copies
    assert float(s.read(torch.tensor([3])).v[0, 0]) == -1.0


def test_memory_checkpoint_holds_only_written_rows():
    s = ClientStore(10**6, _init)
    s.write(torch.tensor([12, 999_999]), State(torch.ones(2, 3, dtype=torch.float64), torch.tensor([1, 2])))
    sd = s.state_dict()
    assert sd["ids"].tolist() == [12, 999_999] and sd["leaf0"].shape == (2, 3)
    t = ClientStore(10**6, _init)
    t.load_state_dict(sd, 0)
    assert torch.equal(t.read(torch.tensor([12, 13])).k, torch.tensor([1, 13]))


@pytest.mark.parametrize("kind", ["memory", "mmap"])
def test_a_checkpoint_before_any_client_answered_resumes(kind, tmp_path):
    """A checkpoint written while no client's state has been written yet (every sampled client dropped, or never
    answers) reads back: the finite-values check of its rows has none to check (it once failed reshaping 0 rows)."""
    s = ClientStore(8, _init, kind, tmp_path / "store", journal=kind == "mmap")
    sd = s.state_dict()
    if kind == "mmap":
        s.commit()
        s.close()
    t = ClientStore(8, _init, kind, tmp_path / "store", journal=kind == "mmap", resume=kind == "mmap")
    t.load_state_dict(sd, 1)
    assert int(t.written.sum()) == 0 and torch.equal(t.read(torch.tensor([2, 5])).k, torch.tensor([2, 5]))


def test_journal_rolls_the_files_back_to_the_checkpoint(tmp_path):
    d = tmp_path / "store"
    s = ClientStore(50, _init, "mmap", d, journal=True)
    rng = np.random.default_rng(0)
    snapshot = None
    for r in range(6):
        ids = torch.from_numpy(np.sort(rng.choice(50, 7, replace=False)))
        s.write(ids, State(torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 9, (7,))), r)
        if r == 2:  # a checkpoint after round 2 (rounds 0-2 done)
            s.state_dict()
            s.commit()
            snapshot = (s.read_all(), s.written.clone())
    # a crash while journaling round 6: a record cut short, its in-place write never started
    with open(d / "undo.log", "ab") as f:
        f.write(b"FMUL" + b"\x06" + b"\x00" * 9)
    s.close()
    again = ClientStore(50, _init, "mmap", d, journal=True, resume=True)
    again.load_state_dict({"kind": "mmap"}, 3)  # resume from the checkpoint of round 3
    now = again.read_all()
    assert torch.equal(now.v, snapshot[0].v) and torch.equal(now.k, snapshot[0].k)
    assert torch.equal(again.written, snapshot[1])
    assert (d / "undo.log").stat().st_size == 0
    with pytest.raises(StoreError, match="do not match"):
        ClientStore(50, lambda ids: State(ids.float().unsqueeze(1), ids), "mmap", d, resume=True)
    with pytest.raises(StoreError, match="needs a run directory"):
        ClientStore(5, _init, "mmap")


def test_engine_with_mmap_store_equals_memory_store(small_data, tmp_path):
    res = []
    for store in ("memory", "mmap"):
        eng = simulator(Ditto(lam=0.5), small_data, sampling_rate=0.5, client_store=store)
        if store == "mmap":  # the engine's store lives in a run directory
            eng.clients.store_dir = tmp_path / "client_store"
        st, rows = run_rounds(eng, 4)
        res.append((st.server, all_client_states(eng), rows, summarize(eng.evaluate(st))))
    (sa, ca, ra, ea), (sb, cb, rb, eb) = res
    for a, b in zip(T.leaves((sa, ca)), T.leaves((sb, cb)), strict=True):
        assert torch.equal(a, b)
    assert ra == rb and ea == eb
    assert (tmp_path / "client_store" / "leaf0.npy").exists()


def test_rounds_touch_only_sampled_clients(small_data):
    eng = simulator(FedEM(num_components=2), small_data, clients_per_round=3)
    st = eng.init_state()
    eng.round(st)
    assert int(eng.clients.store.written.sum()) == 3  # one round: its 3 clients, nobody else
    for _ in range(3):
        eng.round(st)
    assert int(eng.clients.store.written.sum()) <= 12


@pytest.mark.slow
def test_evaluation_on_a_fixed_client_sample(small_data):
    eng = simulator(FedEM(num_components=2), small_data, eval_clients=5)
    st, _ = run_rounds(eng, 2)
    ev = eng.evaluate(st)
    ids = ev["seen"]["test"]["client"]
    assert len(ids) == 5 and len(set(ids.tolist())) == 5
    assert len(ev["unseen"]["test"]["client"]) == 4  # only 4 unseen clients: all of them
    eng.round(st)
    assert np.array_equal(eng.evaluate(st)["seen"]["test"]["client"], ids)  # the same clients every time
    full = simulator(FedEM(num_components=2), small_data)
    st2, _ = run_rounds(full, 2)
    every = full.evaluate(st2)["seen"]["test"]
    assert np.allclose(every["acc"][ids], ev["seen"]["test"]["acc"])  # same per-client numbers as a full pass


TINY = """
[data]
name = "fedem_synthetic"
num_clients = 30
dim = 8
n_test = 30
max_samples = 200
seed = 2

[model]
name = "linear"

[algorithm]
name = "ditto"
lam = 0.5

[optim]
lr = 0.1
momentum = 0.9

[run]
rounds = 60
batch_size = 16
sampling_rate = 0.3
eval_every = 20
checkpoint_every = 7
client_store = "mmap"
seed = 5
"""


@pytest.mark.slow
def test_mmap_store_resumes_exactly_after_a_kill(tmp_path):
    """SIGKILL a Ditto run with memory-mapped personal models between checkpoints; the resumed run ends with the
    uninterrupted run's metrics and per-client results (the journal undid the rounds after the checkpoint)."""
    p = tmp_path / "c.toml"
    p.write_text(TINY)
    # one torch thread in every run, those in this process included (an unrelated pytest may run on more)
    args = ["run", str(p), "--no-progress", "--set", "run.threads=1"]
    cmd = [sys.executable, "-m", "fedmtl.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    assert main([*args, "--out", str(tmp_path / "full")]) == 0  # in this process
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, "--out", str(cut)], env=env)
    journal = cut / "client_store" / "undo.log"
    deadline = time.time() + 300
    while time.time() < deadline:  # after a checkpoint, with journaled rounds past it
        if (cut / "checkpoint.pt").exists() and journal.exists() and journal.stat().st_size > 0:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "summary.json").exists(), "the run was not interrupted"
    assert main([*args, "--out", str(cut), "--resume"]) == 0
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((cut / "summary.json").read_text())
    assert a["final"] == b["final"]
    assert (tmp_path / "full" / "clients.csv").read_text() == (cut / "clients.csv").read_text()
    assert (tmp_path / "full" / "metrics.csv").read_text() == (cut / "metrics.csv").read_text()
