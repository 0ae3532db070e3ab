"""``run.data_on_device``: where a run's examples live (``fedmtl.engine.resident``), its config key, and that the
stacked executor converts a round's features only after they reach the run's device, in their stored dtype.  The
GPU side (resident against host data on a CUDA device) is in ``tests/test_device.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmtl.algorithms import FedAvg
from fedmtl.cli import main
from fedmtl.config import ConfigError, load
from fedmtl.engine.resident import federation_bytes, fits, place, resident
from fedmtl.engine.spec import RunConfig
from fedmtl.hostsync import to_device
from fedmtl.models import build_model
from fedmtl.testing import run_rounds, simulator

from .test_models import _image_data
from .test_rundir import TINY


def test_federation_bytes_count_every_split_in_its_stored_dtype():
    data = _image_data(n_clients=4, per=24)  # 16 train + 8 test uint8 28x28 images per client, int64 labels
    assert federation_bytes(data) == 4 * 24 * 784 + 4 * 24 * 8


def test_auto_keeps_a_federation_resident_up_to_half_the_free_memory():
    assert fits(500, 1000) and not fits(501, 1000)
    assert fits(0, 0) and not fits(1, 0)


def test_on_a_cpu_the_data_stays_where_it_is_whatever_the_setting():
    data = _image_data()
    for mode in (True, False, "auto"):
        assert resident(data, torch.device("cpu"), mode)
        assert place(data, torch.device("cpu"), mode) is data
    x = torch.arange(6, dtype=torch.uint8)
    assert to_device(x, torch.device("cpu")) is x


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_run_config_refuses_anything_but_true_false_or_auto(bad):
    with pytest.raises(ValueError, match="run.data_on_device"):
        RunConfig(data_on_device=bad)


def test_the_config_key_is_read_and_checked(tmp_path: Path, capsys):
    good = tmp_path / "good.toml"
    good.write_text(TINY.format(rounds=1, every=0) + "data_on_device = false\n")
    assert load(good).run.data_on_device is False
    auto = tmp_path / "auto.toml"
    auto.write_text(TINY.format(rounds=1, every=0))
    cfg = load(auto)
    assert cfg.run.data_on_device == "auto" and "data_on_device" not in cfg.raw["run"]  # resolved form unchanged
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.format(rounds=1, every=0) + 'data_on_device = "' + "y" * 200 + '"\n')
    with pytest.raises(ConfigError):
        load(bad)
    assert main(["run", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(bad) in err and "data_on_device" in err
    assert not (tmp_path / "o").exists()


def test_stacked_features_reach_the_transform_on_the_run_device_in_their_stored_dtype():
    data = _image_data()
    model = build_model("mlp", data.feature_shape, data.num_classes, data.meta)
    seen: list[tuple[torch.dtype, str]] = []
    inner = model.input_transform
    assert inner is not None

    class Spy:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((x.dtype, x.device.type))
            return inner(x)

        def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            seen.append((x.dtype, x.device.type))
            return inner.into(x, out)  # type: ignore[attr-defined]

    object.__setattr__(model, "input_transform", Spy())
    eng = simulator(FedAvg(), data, model, runner="stacked", batch_size=4, data_on_device=False)
    run_rounds(eng, 1)
    assert seen and all(s == (torch.uint8, "cpu") for s in seen), seen
