"""The public Python API: FederatedData.from_arrays, Model.from_module, fedmtl.run, the registries and plugins
(``fedmtl run --import``, the ``fedmtl.plugins`` entry-point group), and the code on the handbook's Python API page
(``docs/guide/python-api.md``) and the README's example, run as written."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import DataError, FederatedData, Model, ModelError
from fedmtl.algorithms import FedAvg
from fedmtl.config import ConfigError
from fedmtl.registry import RegistryError

ROOT = Path(__file__).resolve().parents[1]


def _blobs(k=8, seed=0, d=5, classes=3):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, d)) * 3

    def client(n):
        y = rng.integers(0, classes, n)
        return centres[y] + rng.normal(size=(n, d)), y

    return [client(int(rng.integers(20, 40))) for _ in range(k)], [client(15) for _ in range(k)]


def test_from_arrays_takes_numpy_and_casts_float64():
    train, test = _blobs()
    assert train[0][0].dtype == np.float64
    data = FederatedData.from_arrays(train, test)
    assert data.seen.train.x.dtype == torch.float32 and data.num_classes == 3 and data.num_clients == 8
    assert data.seen.train.counts.tolist() == [len(y) for _, y in train]
    assert torch.equal(data.seen.train.client(2)[1], torch.from_numpy(train[2][1]))
    # integer-valued float labels are labels; tensors work as well as arrays; num_classes may be given
    data2 = FederatedData.from_arrays([(torch.tensor(x), torch.tensor(y, dtype=torch.float64)) for x, y in train], test,
                                      num_classes=5, unseen_train=train[:2], unseen_test=test[:2])
    assert data2.num_classes == 5 and data2.unseen.num_clients == 2 and data2.seen.train.y.dtype == torch.int64


def test_from_arrays_validates_each_client():
    train, test = _blobs()
    bad = [(x, y) for x, y in train]
    # client 1 has one label too many, client 2 one too few: the totals match, the clients do not
    bad[1] = (train[1][0], np.append(train[1][1], 0))
    bad[2] = (train[2][0], train[2][1][:-1])
    with pytest.raises(DataError, match="train client 1: .* feature rows but .* labels"):
        FederatedData.from_arrays(bad, test)
    with pytest.raises(DataError, match="train client 0: labels must be integer class indices, found \\[0.5"):
        FederatedData.from_arrays([(train[0][0], train[0][1] + 0.5)] + train[1:], test)
    x_nan = train[3][0].copy()
    x_nan[0, 0] = np.nan
    with pytest.raises(DataError, match="train client 3: features contain NaN"):
        FederatedData.from_arrays(train[:3] + [(x_nan, train[3][1])] + train[4:], test)
    with pytest.raises(DataError, match="test has 7 clients but train has 8"):
        FederatedData.from_arrays(train, test[:7])
    with pytest.raises(DataError, match="labels go up to 2 but num_classes = 2"):
        FederatedData.from_arrays(train, test, num_classes=2)
    with pytest.raises(DataError, match="feature shape"):
        FederatedData.from_arrays([train[0], (train[1][0][:, :4], train[1][1])], test[:2])
    with pytest.raises(DataError, match="no examples"):
        FederatedData.from_arrays([train[0], (train[1][0][:0], train[1][1][:0])], test[:2])
    with pytest.raises(DataError, match="sequence of \\(x, y\\) pairs"):
        FederatedData.from_arrays(train[0], test)
    with pytest.raises(DataError, match="labels must be >= 0"):
        FederatedData.from_arrays([(train[0][0], -train[0][1] - 1)], test[:1])
    reg = FederatedData.from_arrays([(x, y + 0.25) for x, y in train], test, regression=True)
    assert reg.is_regression and reg.seen.train.y.dtype == torch.float32


def test_model_from_module_and_its_checks():
    m = Model.from_module(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)), num_classes=3)
    assert m.output == "multiclass"
    assert Model.from_module(nn.Linear(5, 1), num_classes=2).output == "binary"
    assert Model.from_module(nn.Linear(5, 2), num_classes=2).output == "multiclass"
    m.check_features(torch.zeros(2, 5))
    with pytest.raises(ModelError, match="cannot run on the data's features \\(shape \\(7,\\)"):
        m.check_features(torch.zeros(2, 7))
    with pytest.raises(ModelError, match="returns shape \\(2, 4\\)"):
        Model.from_module(nn.Linear(5, 4), num_classes=3).check_features(torch.zeros(2, 5))
    with pytest.raises(ModelError, match="torch.nn.Module"):
        Model.from_module("linear", num_classes=3)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="num_classes must be an int >= 2"):
        Model.from_module(nn.Linear(5, 1), num_classes=1)


def test_a_run_can_start_from_the_modules_own_weights():
    """init="module": the run starts from the module's weights as they were when wrapped (e.g. pretrained); FedEM's
    first component is them and its others are fresh draws; the default draws seeded weights."""
    from fedmtl.algorithms import FedEM
    from fedmtl.testing import simulator

    train, test = _blobs(seed=1)
    data = FederatedData.from_arrays(train, test)
    module = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        module[0].weight.fill_(0.25)
    mine = Model.from_module(module, num_classes=3, init="module")
    with torch.no_grad():
        module[0].weight.fill_(-1.0)  # a later change of the module does not move the start
    st = simulator(FedEM(num_components=2), data, mine).init_state()
    comps = st.server.components
    assert torch.equal(comps["0.weight"][0], torch.full((16, 5), 0.25))
    assert not torch.equal(comps["0.weight"][1], comps["0.weight"][0])
    seeded = simulator(FedEM(num_components=2), data, Model.from_module(module, num_classes=3)).init_state()
    assert not torch.equal(seeded.server.components["0.weight"][0], torch.full((16, 5), 0.25))
    with pytest.raises(ModelError, match="init must be"):
        Model.from_module(module, num_classes=3, init="pretrained")  # type: ignore[arg-type]


def test_run_with_arrays_and_a_module():
    train, test = _blobs(seed=1)
    data = FederatedData.from_arrays(train, test)
    model = Model.from_module(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)), num_classes=3)
    res = fedmtl.run({"algorithm": {"name": "ditto", "lam": 0.5}, "optim": {"lr": 0.1},
                      "run": {"rounds": 15, "batch_size": 16, "eval_every": 5}}, data=data, model=model)
    assert isinstance(res, fedmtl.RunResult) and len(res.history) == 15
    assert res.final["seen_test_acc_mean"] > 0.8  # well-separated blobs
    assert set(res.per_client["seen"]) == {"train", "test"} and len(res.per_client["seen"]["test"]["acc"]) == 8
    v = res.client_states([0, 3]).v  # Ditto's personal models
    assert v["0.weight"].shape == (2, 16, 5)
    assert not torch.allclose(v["0.weight"][0], v["0.weight"][1])
    assert res.summary["config"]["data"]["name"] == "<python data>"
    # a model that does not fit the data is refused before any training
    with pytest.raises(ModelError, match="cannot run"):
        fedmtl.run({"algorithm": {"name": "fedavg"}}, data=data,
                   model=Model.from_module(nn.Linear(7, 3), num_classes=3))


@pytest.mark.slow
def test_run_from_a_toml_path_with_overrides(tmp_path):
    cfg = ROOT / "configs" / "synthetic" / "fedavg.toml"
    res = fedmtl.run(cfg, out=tmp_path / "r", run__rounds=2, **{"data.num_clients": 12, "run.eval_every": 1})
    assert res.summary["rounds"] == 2 and (tmp_path / "r" / "summary.json").exists()
    assert res.summary["config"]["data"]["num_clients"] == 12
    with pytest.raises(ConfigError, match="name the table"):
        fedmtl.run(cfg, rounds=2)
    with pytest.raises(ConfigError, match="given twice"):
        fedmtl.run(cfg, data=FederatedData.from_arrays(*_blobs()))
    with pytest.raises(ConfigError, match="needs a 'name'"):
        fedmtl.run({"algorithm": {"name": "fedavg"}})  # no data given, no [data] table


def test_registry_decorators_refuse_mistakes():
    with pytest.raises(RegistryError, match="already registered"):
        fedmtl.register_model("linear")(lambda input_shape, num_classes, meta=None: None)
    with pytest.raises(RegistryError, match="frozen dataclass"):
        fedmtl.register_algorithm(type("NotADataclass", (fedmtl.Algorithm,),
                                       {"name": "x_not_dc", "mu": 0.1, "__annotations__": {"mu": "float"}}))
    with pytest.raises(RegistryError, match="subclass of fedmtl.Algorithm"):
        fedmtl.register_algorithm(int)


PLUGIN = '''
"""A fedmtl plugin: an algorithm, a model and a dataset."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from torch import nn

import fedmtl
from fedmtl.algorithms import FedAvg


@fedmtl.register_algorithm
@dataclass(frozen=True)
class ServerLR(FedAvg):
    """FedAvg whose server moves only part of the way to the clients' average."""

    name: ClassVar[str] = "serverlr"
    server_lr: float = 0.5

    def aggregate(self, ctx, server, updates, weights, clients):
        new = super().aggregate(ctx, server, updates, weights, clients)
        return new._replace(params={k: (1 - self.server_lr) * server.params[k] + self.server_lr * v
                                    for k, v in new.params.items()})


@fedmtl.register_model("tinymlp")
def tinymlp(input_shape, num_classes, meta=None, width: int = 8):
    d = int(np.prod(input_shape))
    return fedmtl.Model.from_module(nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, num_classes)),
                                    num_classes=num_classes)


@fedmtl.register_dataset("blobs")
def blobs(num_clients: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    def client(n):
        y = rng.integers(0, 3, n)
        return np.eye(3)[y] * 3 + rng.normal(size=(n, 3)), y
    return fedmtl.FederatedData.from_arrays([client(30) for _ in range(num_clients)],
                                            [client(10) for _ in range(num_clients)])
'''

PLUGIN_CONFIG = """
[data]
name = "blobs"
num_clients = 5

[model]
name = "tinymlp"
width = 12

[algorithm]
name = "serverlr"
server_lr = 0.7

[optim]
lr = 0.1

[run]
rounds = 3
batch_size = 8
"""


def _cli(args, cwd, **env):
    e = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "fedmtl.cli", *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cli_loads_plugins_with_import_and_entry_points(tmp_path, monkeypatch, capsys):
    from fedmtl.cli import main

    (tmp_path / "myplug.py").write_text(PLUGIN)
    (tmp_path / "c.toml").write_text(PLUGIN_CONFIG)
    path = {"PYTHONPATH": str(tmp_path)}
    # the refusals, in this process (nothing gets registered): without the plugin, a missing module, a broken file
    monkeypatch.chdir(tmp_path)
    assert main(["run", "c.toml", "--out", "out2", "--no-progress"]) == 2
    assert "'blobs' is not one of" in capsys.readouterr().err
    assert main(["run", "c.toml", "--import", "no_such_module_xyz"]) == 2
    assert "cannot import" in capsys.readouterr().err
    (tmp_path / "broken.py").write_text("raise TypeError('plugin bug')\n")
    assert main(["run", "c.toml", "--import", "./broken.py"]) == 2
    err = capsys.readouterr().err
    assert "raised TypeError: plugin bug" in err and "Traceback" not in err
    # a module in the current folder without PYTHONPATH (python -m puts the current folder first on sys.path, so
    # the same run with PYTHONPATH set to that folder would find the same file the same way), and a file by its path
    r = _cli(["run", "c.toml", "--import", "myplug", "--out", "out4", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out4" / "summary.json").read_text())
    assert s["algorithm"] == "serverlr" and s["config"]["model"] == {"name": "tinymlp", "width": 12}
    assert s["final"]["seen_test_acc_mean"] > 0.5
    r = _cli(["run", "c.toml", "--import", "./myplug.py", "--out", "out5", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    # the entry-point group fedmtl.plugins: an installed distribution that declares the module
    dist = tmp_path / "fedmtl_demo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedmtl-demo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedmtl.plugins]\ndemo = myplug\n")
    r = _cli(["list"], tmp_path, **path)
    assert r.returncode == 0 and "serverlr" in r.stdout and "tinymlp" in r.stdout and "blobs" in r.stdout
    r = _cli(["run", "c.toml", "--out", "out3", "--no-progress"], tmp_path, **path)
    assert r.returncode == 0, r.stderr


def _run_python_blocks(text, tmp_path, name, min_blocks=1):
    """Every ```python block of ``text``, in order, as one script run in a fresh interpreter (``configs/`` linked
    into its working directory, as in a checkout)."""
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= min_blocks, f"{name}: {len(blocks)} python blocks"
    script = tmp_path / f"{name}.py"
    script.write_text("\n".join(blocks))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_python_api_docs_page_runs_as_written(tmp_path):
    """The handbook's Python API page (docs/guide/python-api.md): every code block runs as written."""
    _run_python_blocks((ROOT / "docs" / "guide" / "python-api.md").read_text(), tmp_path, "python_api", 3)


@pytest.mark.slow
def test_readme_example_runs_as_written(tmp_path):
    """The README front page's example on your own arrays runs as written and prints its comparison."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own arrays", 1)[1].split("\n## ", 1)[0]
    out = _run_python_blocks(section, tmp_path, "readme_example", 1)
    assert "Ditto" in out and "FedAvg" in out


@dataclasses.dataclass(frozen=True)
class Damped(FedAvg):
    """A plugin whose field documents itself with metadata."""

    name: ClassVar[str] = "damped_doc_test"
    damping: float = dataclasses.field(default=0.5, metadata={"doc": "how far the server moves"})


def test_plugin_fields_carry_descriptions_and_the_contract_is_in_help():
    """A plugin's field documents itself with a #: comment or with metadata={"doc": ...}; help(fedmtl.Algorithm)
    shows the contract."""
    import pydoc

    from fedmtl.registry import field_table

    rows = {r[0]: r for r in field_table(Damped)}
    assert rows["damping"][3] == "how far the server moves"
    text = pydoc.render_doc(fedmtl.Algorithm, renderer=pydoc.plaintext)
    assert "client_update" in text and "needs_adaptation" in text and "check_algorithm" in text


@pytest.mark.slow
def test_compare_from_python_and_errors_that_speak_python(tmp_path):
    """fedmtl.compare puts finished runs side by side; a run directory refused from Python names the Python
    arguments (resume=True, overwrite=True) beside the flags."""
    cfg = {"data": {"name": "fedem_synthetic", "num_clients": 6, "dim": 5, "n_test": 20, "max_samples": 60},
           "model": {"name": "linear"}, "algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1},
           "run": {"rounds": 2, "batch_size": 16, "eval_every": 1, "checkpoint_every": 1}}
    fedmtl.run(cfg, out=tmp_path / "a")
    fedmtl.run({**cfg, "algorithm": {"name": "local"}}, out=tmp_path / "b")
    rows = fedmtl.compare([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    assert rows and (tmp_path / "cmp" / "compare.md").exists()
    with pytest.raises(Exception, match=r"resume=True \(--resume\).*overwrite=True \(--overwrite\)"):
        fedmtl.run(cfg, out=tmp_path / "a")
