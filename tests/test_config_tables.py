"""The resolved config (``ExperimentConfig.raw``: a run directory's config.toml, a summary's and a checkpoint's
``config``) of configs that use every table, pinned: which tables are recorded, in which order, which keys are left
out at their defaults, and the values' types."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import pytest

from fedmtl import config
from fedmtl.schema import Range

CASES: dict[str, tuple[dict[str, Any], dict[str, bool]]] = {
    "minimal": ({"data": {"name": "fedem_synthetic"}, "model": {"name": "linear"}, "algorithm": {"name": "fedavg"}},
                {}),
    # every table, written out of order, with the keys recorded only away from their defaults set
    "everything": ({
        "flower": {"secure_aggregation": True, "num_shares": 3, "reconstruction_threshold": 2},
        "async": {"mode": "fedbuff", "buffer_size": 4},
        "server_opt": {"name": "adam", "lr": 0.01},
        "log": {"loggers": ["tensorboard"]},
        "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "reproducible_noise": True},
        "attack": {},
        "robust": {},
        "systems": {"variability": "high", "never_respond": [1, 2]},
        "run": {"rounds": 3, "seeds": [1, 2], "drop_last": True, "data_on_device": True, "sampling_rate": 0.5},
        "optim": {"lr": 0.05, "lr_milestone_rounds": [2]},
        "algorithm": {"name": "fedem", "num_components": 2},
        "model": {"name": "mlp", "hidden": [8], "adapters": {"rank": 2}},
        "data": {"name": "fedem_synthetic", "num_clients": 4},
    }, {}),
    # those keys written at their defaults; [robust] and [attack] given
    "robust": ({
        "privacy": {"clip_norm": 1.0},
        "attack": {"kind": "signflip", "fraction": 0.2},
        "robust": {"aggregator": "median"},
        "run": {"data_on_device": "auto", "seeds": [], "drop_last": False},
        "optim": {"lr_milestone_rounds": []},
        "async": {"mode": "off"},
        "algorithm": {"name": "fedavg"}, "model": {"name": "linear"}, "data": {"name": "fedem_synthetic"},
    }, {}),
    "python": ({"algorithm": {"name": "fedavg"}, "run": {"data_on_device": False}},
               {"data_given": True, "model_given": True}),
}
# config.dumps(cfg.raw): the config.toml a run directory records
EXPECTED_TOML = {
    'minimal': (
        '[data]\n'
        'name = "fedem_synthetic"\n'
        '\n'
        '[model]\n'
        'name = "linear"\n'
        '\n'
        '[algorithm]\n'
        'name = "fedavg"\n'
        '\n'
        '[optim]\n'
        'lr = 0.1\n'
        'momentum = 0.0\n'
        'weight_decay = 0.0\n'
        'lr_milestones = []\n'
        'lr_gamma = 0.1\n'
        '\n'
        '[run]\n'
        'rounds = 200\n'
        'seed = 1234\n'
        'batch_size = 128\n'
        'local_epochs = 1\n'
        'sampling_rate = 1.0\n'
        'clients_per_round = 0\n'
        'runner = "auto"\n'
        'chunk_size = 0\n'
        'bucketing = "steps"\n'
        'compile = "auto"\n'
        'device = "cpu"\n'
        'eval_every = 10\n'
        'checkpoint_every = 10\n'
        'eval_chunk_elems = 67108864\n'
        'eval_clients = 0\n'
        'client_store = "memory"\n'
        'threads = 0\n'
        '\n'
        '[systems]\n'
        'variability = "none"\n'
        'speed_low = 0.0\n'
        'drop_prob = 0.0\n'
        'never_respond = []\n'
        'mode = "deadline"\n'
        'network = "lte"\n'
        'device_flops = 1000000000.0\n'
    ),
    'everything': (
        '[data]\n'
        'name = "fedem_synthetic"\n'
        'num_clients = 4\n'
        '\n'
        '[model]\n'
        'name = "mlp"\n'
        'hidden = [8]\n'
        '\n'
        '[model.adapters]\n'
        'rank = 2\n'
        'alpha = 16.0\n'
        'dropout = 0.0\n'
        'target = []\n'
        'train = []\n'
        'base = ""\n'
        'base_seed = 0\n'
        '\n'
        '[algorithm]\n'
        'name = "fedem"\n'
        'num_components = 2\n'
        '\n'
        '[optim]\n'
        'lr = 0.05\n'
        'momentum = 0.0\n'
        'weight_decay = 0.0\n'
        'lr_milestones = []\n'
        'lr_gamma = 0.1\n'
        'lr_milestone_rounds = [2]\n'
        '\n'
        '[run]\n'
        'rounds = 3\n'
        'seed = 1234\n'
        'batch_size = 128\n'
        'local_epochs = 1\n'
        'drop_last = true\n'
        'sampling_rate = 0.5\n'
        'clients_per_round = 0\n'
        'runner = "auto"\n'
        'chunk_size = 0\n'
        'bucketing = "steps"\n'
        'compile = "auto"\n'
        'device = "cpu"\n'
        'data_on_device = true\n'
        'eval_every = 10\n'
        'checkpoint_every = 10\n'
        'eval_chunk_elems = 67108864\n'
        'eval_clients = 0\n'
        'client_store = "memory"\n'
        'threads = 0\n'
        'seeds = [1, 2]\n'
        '\n'
        '[systems]\n'
        'variability = "high"\n'
        'speed_low = 0.0\n'
        'drop_prob = 0.0\n'
        'never_respond = [1, 2]\n'
        'mode = "deadline"\n'
        'network = "lte"\n'
        'device_flops = 1000000000.0\n'
        '\n'
        '[privacy]\n'
        'clip_norm = 1.0\n'
        'noise_multiplier = 0.5\n'
        'sampling = "poisson"\n'
        'accountant = "rdp"\n'
        'delta = 1e-05\n'
        'target_epsilon = 0.0\n'
        'reproducible_noise = true\n'
        '\n'
        '[log]\n'
        'loggers = ["tensorboard"]\n'
        'tensorboard = false\n'
        'mlflow_uri = ""\n'
        'mlflow_experiment = ""\n'
        '\n'
        '[server_opt]\n'
        'name = "adam"\n'
        'lr = 0.01\n'
        'beta1 = 0.9\n'
        'beta2 = 0.99\n'
        'tau = 0.001\n'
        '\n'
        '[async]\n'
        'mode = "fedbuff"\n'
        'concurrency = 0\n'
        'buffer_size = 4\n'
        'mixing = 0.6\n'
        'staleness = "polynomial"\n'
        'staleness_a = 0.5\n'
        'staleness_b = 4\n'
        'server_lr = 1.0\n'
        '\n'
        '[flower]\n'
        'secure_aggregation = true\n'
        'num_shares = 3\n'
        'reconstruction_threshold = 2\n'
        'clipping_range = 8.0\n'
        'quantization_range = 4194304\n'
    ),
    'robust': (
        '[data]\n'
        'name = "fedem_synthetic"\n'
        '\n'
        '[model]\n'
        'name = "linear"\n'
        '\n'
        '[algorithm]\n'
        'name = "fedavg"\n'
        '\n'
        '[optim]\n'
        'lr = 0.1\n'
        'momentum = 0.0\n'
        'weight_decay = 0.0\n'
        'lr_milestones = []\n'
        'lr_gamma = 0.1\n'
        '\n'
        '[run]\n'
        'rounds = 200\n'
        'seed = 1234\n'
        'batch_size = 128\n'
        'local_epochs = 1\n'
        'sampling_rate = 1.0\n'
        'clients_per_round = 0\n'
        'runner = "auto"\n'
        'chunk_size = 0\n'
        'bucketing = "steps"\n'
        'compile = "auto"\n'
        'device = "cpu"\n'
        'eval_every = 10\n'
        'checkpoint_every = 10\n'
        'eval_chunk_elems = 67108864\n'
        'eval_clients = 0\n'
        'client_store = "memory"\n'
        'threads = 0\n'
        '\n'
        '[systems]\n'
        'variability = "none"\n'
        'speed_low = 0.0\n'
        'drop_prob = 0.0\n'
        'never_respond = []\n'
        'mode = "deadline"\n'
        'network = "lte"\n'
        'device_flops = 1000000000.0\n'
        '\n'
        '[robust]\n'
        'aggregator = "median"\n'
        'trim = 0.1\n'
        'num_byzantine = 0\n'
        'multi_krum_m = 0\n'
        'clip_norm = 0.0\n'
        'bucketing = 0\n'
        'cc_tau = 0.0\n'
        'cc_iterations = 3\n'
        '\n'
        '[attack]\n'
        'kind = "signflip"\n'
        'fraction = 0.2\n'
        '\n'
        '[privacy]\n'
        'clip_norm = 1.0\n'
        'noise_multiplier = 0.0\n'
        'sampling = "poisson"\n'
        'accountant = "rdp"\n'
        'delta = 1e-05\n'
        'target_epsilon = 0.0\n'
        '\n'
        '[async]\n'
        'mode = "off"\n'
        'concurrency = 0\n'
        'buffer_size = 10\n'
        'mixing = 0.6\n'
        'staleness = "polynomial"\n'
        'staleness_a = 0.5\n'
        'staleness_b = 4\n'
        'server_lr = 1.0\n'
    ),
    'python': (
        '[data]\n'
        'name = "<python data>"\n'
        '\n'
        '[model]\n'
        'name = "<python model>"\n'
        '\n'
        '[algorithm]\n'
        'name = "fedavg"\n'
        '\n'
        '[optim]\n'
        'lr = 0.1\n'
        'momentum = 0.0\n'
        'weight_decay = 0.0\n'
        'lr_milestones = []\n'
        'lr_gamma = 0.1\n'
        '\n'
        '[run]\n'
        'rounds = 200\n'
        'seed = 1234\n'
        'batch_size = 128\n'
        'local_epochs = 1\n'
        'sampling_rate = 1.0\n'
        'clients_per_round = 0\n'
        'runner = "auto"\n'
        'chunk_size = 0\n'
        'bucketing = "steps"\n'
        'compile = "auto"\n'
        'device = "cpu"\n'
        'data_on_device = false\n'
        'eval_every = 10\n'
        'checkpoint_every = 10\n'
        'eval_chunk_elems = 67108864\n'
        'eval_clients = 0\n'
        'client_store = "memory"\n'
        'threads = 0\n'
        '\n'
        '[systems]\n'
        'variability = "none"\n'
        'speed_low = 0.0\n'
        'drop_prob = 0.0\n'
        'never_respond = []\n'
        'mode = "deadline"\n'
        'network = "lte"\n'
        'device_flops = 1000000000.0\n'
    ),
}
# cfg.raw itself (as summaries and checkpoints hold it): key order, tuples and None included
EXPECTED_RAW = {
    'minimal': {'data': {'name': 'fedem_synthetic'},
              'model': {'name': 'linear'},
              'algorithm': {'name': 'fedavg'},
              'optim': {'lr': 0.1, 'momentum': 0.0, 'weight_decay': 0.0, 'lr_milestones': (), 'lr_gamma': 0.1},
              'run': {'rounds': 200,
                      'seed': 1234,
                      'batch_size': 128,
                      'local_epochs': 1,
                      'sampling_rate': 1.0,
                      'clients_per_round': 0,
                      'runner': 'auto',
                      'chunk_size': 0,
                      'bucketing': 'steps',
                      'compile': 'auto',
                      'device': 'cpu',
                      'eval_every': 10,
                      'checkpoint_every': 10,
                      'eval_chunk_elems': 67108864,
                      'eval_clients': 0,
                      'client_store': 'memory',
                      'threads': 0},
              'systems': {'variability': 'none',
                          'speed_low': 0.0,
                          'drop_prob': 0.0,
                          'never_respond': [],
                          'mode': 'deadline',
                          'network': 'lte',
                          'device_flops': 1000000000.0}},
    'everything': {'data': {'name': 'fedem_synthetic', 'num_clients': 4},
                 'model': {'name': 'mlp',
                           'hidden': (8,),
                           'adapters': {'rank': 2,
                                        'alpha': 16.0,
                                        'dropout': 0.0,
                                        'target': [],
                                        'train': [],
                                        'base': '',
                                        'base_seed': 0}},
                 'algorithm': {'name': 'fedem', 'num_components': 2},
                 'optim': {'lr': 0.05,
                           'momentum': 0.0,
                           'weight_decay': 0.0,
                           'lr_milestones': (),
                           'lr_gamma': 0.1,
                           'lr_milestone_rounds': (2,)},
                 'run': {'rounds': 3,
                         'seed': 1234,
                         'batch_size': 128,
                         'local_epochs': 1,
                         'drop_last': True,
                         'sampling_rate': 0.5,
                         'clients_per_round': 0,
                         'runner': 'auto',
                         'chunk_size': 0,
                         'bucketing': 'steps',
                         'compile': 'auto',
                         'device': 'cpu',
                         'data_on_device': True,
                         'eval_every': 10,
                         'checkpoint_every': 10,
                         'eval_chunk_elems': 67108864,
                         'eval_clients': 0,
                         'client_store': 'memory',
                         'threads': 0,
                         'seeds': (1, 2)},
                 'systems': {'variability': 'high',
                             'speed_low': 0.0,
                             'drop_prob': 0.0,
                             'never_respond': [1, 2],
                             'mode': 'deadline',
                             'network': 'lte',
                             'device_flops': 1000000000.0},
                 'privacy': {'clip_norm': 1.0,
                             'noise_multiplier': 0.5,
                             'sampling': 'poisson',
                             'accountant': 'rdp',
                             'delta': 1e-05,
                             'target_epsilon': 0.0,
                             'reproducible_noise': True},
                 'log': {'loggers': ('tensorboard',),
                         'tensorboard': False,
                         'mlflow_uri': '',
                         'mlflow_experiment': ''},
                 'server_opt': {'name': 'adam', 'lr': 0.01, 'beta1': 0.9, 'beta2': 0.99, 'tau': 0.001},
                 'async': {'mode': 'fedbuff',
                           'concurrency': 0,
                           'buffer_size': 4,
                           'mixing': 0.6,
                           'staleness': 'polynomial',
                           'staleness_a': 0.5,
                           'staleness_b': 4,
                           'server_lr': 1.0},
                 'flower': {'secure_aggregation': True,
                            'num_shares': 3,
                            'reconstruction_threshold': 2,
                            'clipping_range': 8.0,
                            'quantization_range': 4194304}},
    'robust': {'data': {'name': 'fedem_synthetic'},
             'model': {'name': 'linear'},
             'algorithm': {'name': 'fedavg'},
             'optim': {'lr': 0.1, 'momentum': 0.0, 'weight_decay': 0.0, 'lr_milestones': (), 'lr_gamma': 0.1},
             'run': {'rounds': 200,
                     'seed': 1234,
                     'batch_size': 128,
                     'local_epochs': 1,
                     'sampling_rate': 1.0,
                     'clients_per_round': 0,
                     'runner': 'auto',
                     'chunk_size': 0,
                     'bucketing': 'steps',
                     'compile': 'auto',
                     'device': 'cpu',
                     'eval_every': 10,
                     'checkpoint_every': 10,
                     'eval_chunk_elems': 67108864,
                     'eval_clients': 0,
                     'client_store': 'memory',
                     'threads': 0},
             'systems': {'variability': 'none',
                         'speed_low': 0.0,
                         'drop_prob': 0.0,
                         'never_respond': [],
                         'mode': 'deadline',
                         'network': 'lte',
                         'device_flops': 1000000000.0},
             'robust': {'aggregator': 'median',
                        'trim': 0.1,
                        'num_byzantine': 0,
                        'multi_krum_m': 0,
                        'clip_norm': 0.0,
                        'bucketing': 0,
                        'cc_tau': 0.0,
                        'cc_iterations': 3},
             'attack': {'kind': 'signflip', 'fraction': 0.2, 'strength': None},
             'privacy': {'clip_norm': 1.0,
                         'noise_multiplier': 0.0,
                         'sampling': 'poisson',
                         'accountant': 'rdp',
                         'delta': 1e-05,
                         'target_epsilon': 0.0},
             'async': {'mode': 'off',
                       'concurrency': 0,
                       'buffer_size': 10,
                       'mixing': 0.6,
                       'staleness': 'polynomial',
                       'staleness_a': 0.5,
                       'staleness_b': 4,
                       'server_lr': 1.0}},
    'python': {'data': {'name': '<python data>'},
             'model': {'name': '<python model>'},
             'algorithm': {'name': 'fedavg'},
             'optim': {'lr': 0.1, 'momentum': 0.0, 'weight_decay': 0.0, 'lr_milestones': (), 'lr_gamma': 0.1},
             'run': {'rounds': 200,
                     'seed': 1234,
                     'batch_size': 128,
                     'local_epochs': 1,
                     'sampling_rate': 1.0,
                     'clients_per_round': 0,
                     'runner': 'auto',
                     'chunk_size': 0,
                     'bucketing': 'steps',
                     'compile': 'auto',
                     'device': 'cpu',
                     'data_on_device': False,
                     'eval_every': 10,
                     'checkpoint_every': 10,
                     'eval_chunk_elems': 67108864,
                     'eval_clients': 0,
                     'client_store': 'memory',
                     'threads': 0},
             'systems': {'variability': 'none',
                         'speed_low': 0.0,
                         'drop_prob': 0.0,
                         'never_respond': [],
                         'mode': 'deadline',
                         'network': 'lte',
                         'device_flops': 1000000000.0}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_resolved_config_is_pinned(case: str) -> None:
    raw, kw = CASES[case]
    cfg = config.validate(raw, **kw)
    assert config.dumps(cfg.raw) == EXPECTED_TOML[case]
    assert repr(cfg.raw) == repr(EXPECTED_RAW[case])
    assert repr(config.validate(cfg.raw, cfg.source, **kw).raw) == repr(cfg.raw)  # the resolved form resolves to itself


def test_with_seed_is_pinned() -> None:
    cfg = config.validate(CASES["everything"][0])
    want = EXPECTED_TOML["everything"].replace("seed = 1234\n", "seed = 5\n").replace("seeds = [1, 2]\n", "")
    assert config.dumps(cfg.with_seed(5).raw) == want
    assert cfg.with_seed(5).run == dataclasses.replace(cfg.run, seed=5, seeds=())


def test_the_registry_drives_the_config_and_the_run_spec() -> None:
    from fedmtl.config import NAMED_TABLES, TABLES, ExperimentConfig
    from fedmtl.engine.spec import RunSpec

    assert list(TABLES) == ["optim", "run", "systems", "robust", "attack", "privacy", "log", "server_opt", "async",
                            "flower"]
    assert not set(NAMED_TABLES) & set(TABLES)
    assert sorted(f.name for f in dataclasses.fields(RunSpec)) == sorted(t.attr for t in TABLES.values() if t.engine)
    cfg = config.validate(CASES["everything"][0])
    for name, t in TABLES.items():
        assert getattr(cfg, t.attr) is cfg.tables[name]
        assert isinstance(cfg.tables[name], t.cls)
        assert getattr(ExperimentConfig, t.attr) is t
    spec = cfg.run_spec()
    assert all(getattr(spec, f.name) is getattr(cfg, f.name) for f in dataclasses.fields(RunSpec))
    assert cfg.asynchronous.mode == "fedbuff" and cfg.run.seeds == (1, 2)


@dataclasses.dataclass(frozen=True)
class _Example:
    """A table of the test's own."""

    #: how loud
    level: Annotated[int, Range(0, 9)] = 0
    #: a key recorded only away from its default
    tag: str = ""


def test_a_new_table_is_a_dataclass_and_one_line(monkeypatch, capsys) -> None:
    from fedmtl.cli import main
    from fedmtl.config import TABLES, ConfigError, Table, Tables

    monkeypatch.setattr(Tables, "example", Table(_Example, "example", when_given=True, defaults_left_out=("tag",),
                                                 engine=False), raising=False)
    monkeypatch.setitem(TABLES, "example", Tables.example)
    raw = {**CASES["minimal"][0], "example": {"level": 3}}
    cfg = config.validate(raw)
    assert cfg.example == _Example(level=3)
    assert config.dumps(cfg.raw) == EXPECTED_TOML["minimal"] + "\n[example]\nlevel = 3\n"
    assert "example" not in config.validate(CASES["minimal"][0]).raw  # recorded only when given
    with pytest.raises(ConfigError, match=r"\[example\]\.level must be in \[0, 9\], got 10"):
        config.validate({**raw, "example": {"level": 10}})
    assert main(["list", "--table", "example"]) == 0
    assert "level" in capsys.readouterr().out
