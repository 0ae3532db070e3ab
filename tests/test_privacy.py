"""User-level DP (``[privacy]``): the accountant is dp-accounting's, the noise has the right scale, and with no
noise and a huge clip norm a run equals the plain one."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.config import ConfigError, validate
from fedmtl.data.federated import FederatedData
from fedmtl.engine.driver import run_experiment
from fedmtl.privacy import Accountant, PrivacyConfig, dp_combine, epsilon

pytest.importorskip("dp_accounting")


def test_epsilon_equals_the_library_for_a_known_setting():
    import dp_accounting as dpa
    from dp_accounting import pld, rdp

    cfg = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.1, delta=1e-5)
    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 1000))
    assert epsilon(cfg, 1.1, 1000, 10000, 100, 0.01) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    p = pld.PLDAccountant()
    p.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 1000))
    cfg_pld = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.1, accountant="pld")
    assert epsilon(cfg_pld, 1.1, 1000, 10000, 100, 0.01) == pytest.approx(p.get_epsilon(1e-5), rel=1e-6)
    # more noise, fewer rounds: less epsilon; the RDP bound is above the tighter PLD one
    assert epsilon(cfg, 2.0, 1000, 10000, 100, 0.01) < epsilon(cfg, 1.1, 1000, 10000, 100, 0.01)
    assert epsilon(cfg_pld, 1.1, 1000, 10000, 100, 0.01) < epsilon(cfg, 1.1, 1000, 10000, 100, 0.01)


def test_round_by_round_accountant_equals_the_library_and_stays_quiet(caplog):
    """The run's accountant (one round's RDP curve, scaled) equals the library composing r rounds, for both
    sampling schemes; the library's fractional-order convergence warnings are filtered out."""
    import logging

    for sampling, n, k, q in (("poisson", 100, 20, 0.2), ("fixed", 100, 20, 0.2)):
        cfg = PrivacyConfig(clip_norm=1.0, noise_multiplier=2.0, sampling=sampling)
        acc = Accountant(cfg, 2.0, n, k, q)
        with caplog.at_level(logging.WARNING, logger="absl"):
            got = [acc.epsilon_after(r) for r in (1, 7, 50, 3)]
        want = [epsilon(cfg, 2.0, r, n, k, q) for r in (1, 7, 50, 3)]
        assert got == pytest.approx(want, rel=1e-9)
        assert got[0] < got[3] < got[1] < got[2]
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    pld_cfg = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0, accountant="pld")
    assert Accountant(pld_cfg, 1.0, 100, 20, 0.2).epsilon_after(10) == pytest.approx(
        epsilon(pld_cfg, 1.0, 10, 100, 20, 0.2), rel=1e-9)


def test_noise_has_the_stated_scale():
    """Zero deviations: the combined update is pure noise of std sigma * clip / denominator per coordinate."""
    ref = {"w": torch.zeros(200_000)}
    ups = {"w": torch.zeros(5, 200_000)}
    gen = torch.Generator().manual_seed(0)
    out = dp_combine(ref, 2.0, 1.5, 4.0, gen)(ups, torch.ones(5))["w"].double()
    want = 1.5 * 2.0 / 4.0
    # std of the sample std of n normals: want / sqrt(2 n) ~ 0.0012; 5 of those are a failing tolerance
    assert abs(float(out.std()) - want) < 5 * want / math.sqrt(2 * out.numel())
    assert abs(float(out.mean())) < 5 * want / math.sqrt(out.numel())


def _equal_clients(n=8, per=40, dim=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, classes))
    pairs = []
    for _ in range(n):
        x = rng.normal(size=(per + 20, dim)).astype(np.float32)
        y = np.argmax(x @ w + 0.5 * rng.normal(size=(per + 20, classes)), 1)
        pairs.append(((x[:per], y[:per]), (x[per:], y[per:])))
    return FederatedData.from_arrays([p[0] for p in pairs], [p[1] for p in pairs], num_classes=classes)


CONFIG = """
[model]
name = "linear"

[algorithm]
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = 5
batch_size = 16
seed = 3
"""


def _run(extra=""):
    cfg = validate(tomllib.loads(CONFIG + extra), data_given=True)
    return run_experiment(cfg, progress=False, data=_equal_clients())


def test_no_noise_and_a_huge_clip_equal_the_plain_run_and_noise_changes_it():
    plain = _run()
    same = _run('\n[privacy]\nclip_norm = 1e9\nnoise_multiplier = 0.0\nsampling = "fixed"\n')
    for a, b in zip(T.leaves(plain.server), T.leaves(same.server), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert same.summary["epsilon"] == math.inf
    noisy = _run('\n[privacy]\nclip_norm = 0.5\nnoise_multiplier = 1.0\nsampling = "fixed"\n')
    assert max(float((a - b).abs().max()) for a, b in zip(T.leaves(plain.server), T.leaves(noisy.server),
                                                          strict=True)) > 1e-3
    eps = [row["epsilon"] for row in noisy.history]
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False))  # spent round by round
    assert noisy.summary["epsilon"] == pytest.approx(
        epsilon(PrivacyConfig(0.5, 1.0, "fixed"), 1.0, 5, 8, 8, 1.0), rel=1e-9)


def test_target_epsilon_calibrates_the_noise_before_the_run():
    res = _run('\n[privacy]\nclip_norm = 1.0\ntarget_epsilon = 8.0\n')
    assert res.summary["noise_multiplier"] > 0
    assert res.summary["epsilon"] <= 8.0 * (1 + 1e-3) and res.summary["epsilon"] > 7.0


def test_privacy_table_is_validated():
    for body, match in [("clip_norm = -1.0", "clip_norm"), ("clip_norm = 1.0\ndelta = 1.5", "delta"),
                        ("noise_multiplier = 1.0", "clip_norm > 0"), ("clip_norm = nan", "clip_norm"),
                        ('clip_norm = 1.0\nnoise_multiplier = 1.0\nsampling = "fixed"\naccountant = "pld"', "pld"),
                        ('clip_norm = 1.0\nsampling = "sometimes"', "sampling")]:
        with pytest.raises(ConfigError, match=match):
            validate(tomllib.loads(CONFIG + f"\n[privacy]\n{body}\n"), "x.toml", data_given=True)
