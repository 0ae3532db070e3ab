"""User-level DP (``[privacy]``): the accountant is dp-accounting's, the noise has the right scale, and with no
noise and a huge clip norm a run equals the plain one."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms.feddyn import DynServer, FedDyn
from fedmtl.config import ConfigError, validate
from fedmtl.data.federated import FederatedData
from fedmtl.engine.steps.privacy import ClipAndNoise, add_gaussian_noise
from fedmtl.privacy import Accountant, PrivacyConfig, epsilon
from fedmtl.runs.driver import run_experiment
from fedmtl.testing import ContractError, check_algorithm

pytest.importorskip("dp_accounting")


@pytest.mark.slow
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


@pytest.mark.slow
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
    cfg = PrivacyConfig(clip_norm=2.0, noise_multiplier=1.5)
    step = ClipAndNoise(cfg, 1.5, 4.0, Accountant(cfg, 1.5, 10, 4, 0.4), "fedavg")
    out = step.noised_mean(ups, torch.ones(5), ref, torch.Generator().manual_seed(0))["w"].double()
    # the one place the noise is added: N(0, (noise_multiplier * clip_norm)^2) on the sum, from the generator given
    again = add_gaussian_noise(torch.zeros(200_000, dtype=torch.float64), 1.5, 2.0, torch.Generator().manual_seed(0))
    assert torch.equal(out, (again / 4.0).float().double())
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


@pytest.mark.slow
def test_the_release_audit_catches_server_state_computed_from_raw_updates(small_data):
    """FedDyn as it was: its server term h came from the plain mean of the clipped updates, not from the noised
    sum; the contract's private_release check names that leaf.  The fixed FedDyn passes."""
    @dataclass(frozen=True)
    class LeakyDyn(FedDyn):
        name: ClassVar[str] = "leaky_dyn"

        def aggregate(self, ctx, server, updates, weights, clients):
            ok = weights > 0
            mean = ctx.combine(updates, ok.to(weights.dtype))
            drift = T.sub(T.weighted_mean(updates, ok.to(weights.dtype)), server.params)
            h = T.tmap(lambda hh, d: hh - self.alpha * float(ok.sum()) / ctx.num_clients * d, server.h, drift)
            return DynServer(T.tmap(lambda m, hh: m - hh / self.alpha, mean, h), h)

    with pytest.raises(ContractError, match=r"\.h\["):
        check_algorithm(LeakyDyn, data=small_data, checks=("private_release",))
    assert check_algorithm(FedDyn, data=small_data, checks=("private_release",)) == {"private_release": "ok"}


def test_the_noise_cannot_be_recomputed_from_the_public_seed():
    """Finding: the noise came from round_generator(run.seed, round, 5), so anyone who knew run.seed (config.toml,
    summary.json) could subtract it.  Now it comes from the OS's CSPRNG: the same config twice gives different
    private models, and the noise regenerated from the seed does not recover the noise-free aggregate.  Only
    reproducible_noise = true (recorded in summary.json) repeats a run."""
    from fedmtl.engine.sampling import round_generator

    body = '\n[privacy]\nclip_norm = 0.5\nnoise_multiplier = 1.0\nsampling = "fixed"\n'
    a, b = _run(body), _run(body)
    assert not torch.equal(a.server.params["weight"], b.server.params["weight"])
    assert a.summary["reproducible_noise"] is False
    rep = [_run(body + "reproducible_noise = true\n") for _ in range(2)]
    assert torch.equal(rep[0].server.params["weight"], rep[1].server.params["weight"])
    assert rep[0].summary["reproducible_noise"] is True
    # the attack of the finding, on one round: subtract the noise regenerated from (seed, round 0, stream 5)
    one = CONFIG.replace("rounds = 5", "rounds = 1")
    plain = run_experiment(validate(tomllib.loads(one + body.replace("1.0\n", "0.0\n")), data_given=True),
                           progress=False, data=_equal_clients()).server.params

    def recovered(extra: str) -> float:
        noisy = run_experiment(validate(tomllib.loads(one + body + extra), data_given=True), progress=False,
                               data=_equal_clients()).server.params
        gen = round_generator(3, 0, 5)
        gap = 0.0
        for name, w in noisy.items():  # add_gaussian_noise's draws, leaf by leaf, scaled by sigma * clip / k
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float64) * 1.0 * 0.5 / 8
            gap = max(gap, float((w.double() - noise - plain[name].double()).abs().max()))
        return gap

    assert recovered("reproducible_noise = true\n") < 1e-5  # the attack works on the insecure option...
    assert recovered("") > 1e-2  # ...and not on the default


@pytest.mark.parametrize("q,rounds", [(0.25, 30), (0.05, 30)])
def test_epsilon_uses_the_true_poisson_rate(q, rounds):
    """Finding: with q N not an integer the accountant was given round(q N) / N (N = 10, q = 0.25: 8.94 reported,
    10.96 true).  The run's epsilon is dp-accounting's for PoissonSampled(q) composed over the rounds."""
    import dp_accounting as dpa
    from dp_accounting import rdp

    cfg = validate(tomllib.loads(CONFIG.replace("rounds = 5", f"rounds = {rounds}").replace("seed = 3", "seed = 3\n"
                   f"sampling_rate = {q}") + "\n[privacy]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n"),
                   data_given=True)
    res = run_experiment(cfg, progress=False, data=_equal_clients(n=10))
    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)), rounds))
    assert res.summary["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    if q == 0.25:
        assert res.summary["epsilon"] == pytest.approx(10.96, abs=0.01)
    else:  # N = 10, q = 0.05: most rounds sample nobody, and each of them still releases its noise
        assert sum(row["clients"] == 0 for row in res.history) >= 10


@pytest.mark.slow
def test_fixed_size_sampling_is_accounted_without_replacement_and_events_are_written(tmp_path):
    import json

    import dp_accounting as dpa
    from dp_accounting import NeighboringRelation, rdp

    cfg = validate(tomllib.loads(CONFIG.replace("seed = 3", "seed = 3\nclients_per_round = 3")
                                 + '\n[privacy]\nclip_norm = 1.0\nnoise_multiplier = 1.5\nsampling = "fixed"\n'),
                   data_given=True)
    res = run_experiment(cfg, tmp_path / "run", progress=False, data=_equal_clients())
    acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(8, 3, dpa.GaussianDpEvent(1.5)), 5))
    assert res.summary["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    rec = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert rec["events"] == [{"rounds": [1, 5], "event": {
        "class_name": "SampledWithoutReplacementDpEvent", "source_dataset_size": 8, "sample_size": 3,
        "event": {"class_name": "GaussianDpEvent", "noise_multiplier": 1.5}}}]
    assert rec["neighboring_relation"] == "replace_one" and rec["epsilon"] == res.summary["epsilon"]


@pytest.mark.slow
def test_a_private_run_resumes_reproducibly_only_with_reproducible_noise(tmp_path, monkeypatch):
    """Killed after its round-2 checkpoint, a private run resumes: with reproducible noise to exactly the
    uninterrupted run; with secure noise correctly (its accounting and rounds continue), its model differing only
    through the noise of the rounds after the resume."""
    from fedmtl.runs import driver

    def run(body: str, out, kill: bool = False) -> object:
        raw = CONFIG.replace("rounds = 5", "rounds = 4\ncheckpoint_every = 2") + body
        cfg = validate(tomllib.loads(raw), data_given=True)
        if kill:
            calls = {"n": 0}
            real = driver._checkpoint

            def killed(*a, **k):
                real(*a, **k)
                calls["n"] += 1
                if calls["n"] == 1:
                    raise KeyboardInterrupt("killed after the round-2 checkpoint")

            monkeypatch.setattr(driver, "_checkpoint", killed)
            with pytest.raises(KeyboardInterrupt):
                run_experiment(cfg, out, progress=False, data=_equal_clients())
            monkeypatch.undo()
            return run_experiment(cfg, out, resume=True, progress=False, data=_equal_clients())
        return run_experiment(cfg, out, progress=False, data=_equal_clients())

    body = '\n[privacy]\nclip_norm = 0.5\nnoise_multiplier = 1.0\nsampling = "fixed"\n'
    rep = body + "reproducible_noise = true\n"
    whole, resumed = run(rep, tmp_path / "a"), run(rep, tmp_path / "b", kill=True)
    assert torch.equal(whole.server.params["weight"], resumed.server.params["weight"])
    assert whole.history == resumed.history
    secure = run(body, tmp_path / "c", kill=True)
    assert secure.summary["rounds"] == 4 and secure.summary["epsilon"] == pytest.approx(whole.summary["epsilon"])
    assert [r["epsilon"] for r in secure.history] == [r["epsilon"] for r in whole.history]
    assert not torch.equal(secure.server.params["weight"], whole.server.params["weight"])


def test_a_robust_aggregator_and_privacy_exclude_each_other():
    """The noised mean is the mechanism: a robust aggregator would replace it silently; it is refused instead."""
    with pytest.raises(ValueError, match="robust.aggregator = 'median'"):
        _run('\n[robust]\naggregator = "median"\n\n[privacy]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n')
    assert _run('\n[robust]\nclip_norm = 0.5\n\n[privacy]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n').summary[
        "epsilon"] > 0
