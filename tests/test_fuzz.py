"""Config fuzzing: 200 seeded random mutations of a valid config through ``fedmtl run``.  Every case must end in
bounded time either with a clear one-line error naming the file or the key (exit 2), or with a sane result
(exit 0: finite metrics on a non-empty test set, at least one usable update per round).  Never a traceback,
never a hang, never nonsense reported as a result.  Also: a model whose updates are always NaN is stopped."""

from __future__ import annotations

import json
import math
import random
import signal
import tomllib

import pytest
import torch
from torch import nn

from fedmtl.cli import main
from fedmtl.config import dumps

BASE = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 5
n_test = 20
max_samples = 60
seed = 1

[model]
name = "linear"

[algorithm]
name = "fedem"
num_components = 2

[optim]
lr = 0.1
momentum = 0.5
weight_decay = 0.0001

[run]
rounds = 2
batch_size = 16
eval_every = 1
checkpoint_every = 1
seed = 3

[robust]
aggregator = "mean"

[attack]
kind = "none"
"""

VALUES = [float("nan"), float("inf"), float("-inf"), -1, 0, -1000, 1e30, -1e30, 1e300, 10**12, 2**63 - 1, "",
          "lstm", "text", [], [1, 2], {"x": 1}, True, False, 1.5, -0.5, 0.999, 3]


def _mutate(rng: random.Random, raw: dict) -> tuple[dict, str]:
    raw = json.loads(json.dumps(raw))
    table = rng.choice(sorted(raw))
    op = rng.random()
    if op < 0.8 and raw[table]:
        key = rng.choice(sorted(raw[table]))
        value = rng.choice(VALUES)
        raw[table][key] = value
        return raw, f"{table}.{key} = {value!r}"
    if op < 0.9:
        raw[table]["bogus_key"] = rng.choice(VALUES)
        return raw, f"{table}.bogus_key"
    if raw[table]:
        key = rng.choice(sorted(raw[table]))
        del raw[table][key]
        return raw, f"del {table}.{key}"
    return raw, "unchanged"


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _toml(raw: dict) -> str:
    try:
        return dumps(raw)
    except Exception:  # values dumps cannot write (dicts in tables): write them by hand
        lines = []
        for t, kv in raw.items():
            lines.append(f"[{t}]")
            for k, v in kv.items():
                lines.append(f"{k} = {json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else v}")
        return "\n".join(lines).replace("Infinity", "inf").replace("NaN", "nan")


@pytest.mark.slow
def test_200_config_mutations_end_cleanly(tmp_path, capsys):
    rng = random.Random(20261123)
    base = tomllib.loads(BASE)
    ok = refused = 0
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(200):
            raw, what = _mutate(rng, base)
            if rng.random() < 0.3:  # a second mutation
                raw, what2 = _mutate(rng, raw)
                what += "; " + what2
            text = _toml(raw)
            cfg = tmp_path / f"case{case}.toml"
            cfg.write_text(text)
            out = tmp_path / f"out{case}"
            signal.alarm(60)
            try:
                code = main(["run", str(cfg), "--out", str(out), "-q"])
            except _Timeout:
                pytest.fail(f"case {case} ({what}) ran past 60 s")
            except BaseException as e:  # a traceback: a bug
                pytest.fail(f"case {case} ({what}) raised {type(e).__name__}: {e}")
            finally:
                signal.alarm(0)
            err = capsys.readouterr().err.strip()
            if code == 0:
                ok += 1
                s = json.loads((out / "summary.json").read_text())
                acc = s["final"].get("seen_test_acc_mean")
                assert acc is not None and math.isfinite(acc), (case, what, s["final"])
                assert s["excluded_updates"] < s["rounds"] * 6, (case, what)
            else:
                refused += 1
                assert code == 2, (case, what, code, err)
                lines = err.splitlines()
                assert len(lines) == 1, (case, what, err)
                assert str(cfg) in err, (case, what, err)  # the file, and (tested elsewhere) the key
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ok >= 10 and refused >= 100, (ok, refused)  # the mutations exercise both outcomes


@pytest.mark.parametrize("setting,named", [
    ("optim.weight_decay=nan", "weight_decay"), ("optim.weight_decay=inf", "weight_decay"),
    ("optim.weight_decay=1e30", "weight_decay"), ("optim.lr=1e300", "lr"), ("optim.lr_gamma=5.0", "lr_gamma"),
    ("data.n_test=0", "n_test"), ("data.n_test=-1000", "n_test"), ("data.n_test=1000000000", "[data]"),
    ("data.dim=100000000", "[data]"), ("data.noise=inf", "noise"), ("run.eval_chunk_elems=-1000", "eval_chunk_elems"),
    ("algorithm.unseen_tol=inf", "unseen_tol"), ("algorithm.unseen_tol=-inf", "unseen_tol"),
    ("algorithm.num_components=1000000", "num_components"), ("model.name=lstm", "token ids"),
])
def test_the_reported_nonsense_is_refused_in_one_line(tmp_path, capsys, setting, named):
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    try:
        code = main(["run", str(cfg), "--set", setting, "--out", str(tmp_path / "o"), "-q"])
    except _Timeout:
        pytest.fail(f"{setting} ran past 120 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err and str(cfg) in err, err


def test_toml_nested_5000_deep_is_refused(tmp_path, capsys):
    cfg = tmp_path / "deep.toml"
    cfg.write_text(BASE + "\n[systems]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "nested 5000 deep" in capsys.readouterr().err


class _NaNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) * float("nan")


def test_a_run_whose_every_update_is_nan_stops_instead_of_reporting(tmp_path):
    import numpy as np

    import fedmtl
    from fedmtl.engine.round import TrainingDiverged

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(4)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)
    model = fedmtl.Model.from_module(_NaNModel(), 3)
    with pytest.raises(TrainingDiverged, match="every client update was NaN/Inf"):
        fedmtl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 10}}, data=data, model=model)
    torch.manual_seed(0)
