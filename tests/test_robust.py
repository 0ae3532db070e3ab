"""Robust aggregation (``[robust]``) and the attack harness (``[attack]``): every aggregator and attack against a
closed form or a direct computation on hand-made updates, config validation, and end to end: the plain mean
collapses under scaled updates and Krum under IPM, centered clipping with bucketing does not."""

from __future__ import annotations

import itertools
import math
import tomllib
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.config import ConfigError, validate
from fedmtl.engine.sampling import round_generator
from fedmtl.robust.aggregators import (
    BUCKETING_STREAM,
    RobustConfig,
    bucketed,
    bulyan,
    centered_clip,
    clip_updates,
    krum,
    median,
    trimmed_mean,
)
from fedmtl.robust.attacks import AttackConfig, alie_z, corrupt, minmax_gamma
from fedmtl.runs.driver import run_experiment
from fedmtl.schema import Range, range_of, type_hints

ROBUST_SYNTHETIC = Path(__file__).resolve().parents[1] / "configs" / "robust" / "synthetic.toml"


def _updates():
    # five clients, a two-leaf update; client 3 is an outlier, client 4 excluded (weight 0, NaN)
    w = torch.tensor([[1.0, 2.0], [2.0, 0.0], [3.0, 1.0], [100.0, -50.0], [float("nan"), 0.0]])
    b = torch.tensor([[0.5], [1.5], [1.0], [-80.0], [float("nan")]])
    return {"w": w, "b": b}, torch.tensor([10.0, 20.0, 30.0, 40.0, 0.0], dtype=torch.float64)


def test_median_and_trimmed_mean_closed_forms():
    u, wt = _updates()
    m = median(u, wt)  # valid rows 0-3: even count, the mean of the two middle values per coordinate
    assert torch.allclose(m["w"], torch.tensor([2.5, 0.5])) and torch.allclose(m["b"], torch.tensor([0.75]))
    odd = median(u, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(odd["w"], torch.tensor([2.0, 1.0]))
    t = trimmed_mean(u, wt, 0.25)  # K = 4: drop one at each end
    assert torch.allclose(t["w"], torch.tensor([2.5, 0.5])) and torch.allclose(t["b"], torch.tensor([0.75]))
    t0 = trimmed_mean(u, wt, 0.0)  # nothing trimmed: the unweighted mean of the valid rows
    assert torch.allclose(t0["w"], torch.tensor([106.0 / 4, -47.0 / 4]))


def _krum_by_hand(points: np.ndarray, f: int) -> np.ndarray:
    k = len(points)
    scores = []
    for i in range(k):
        d = sorted(float(((points[i] - points[j]) ** 2).sum()) for j in range(k) if j != i)
        scores.append(sum(d[: k - f - 2]))
    return np.array(scores)


def test_krum_and_multi_krum_closed_forms():
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.normal(0, 1, (6, 3)), rng.normal(20, 1, (2, 3))])
    u = {"a": torch.tensor(pts[:, :2], dtype=torch.float32), "b": torch.tensor(pts[:, 2:], dtype=torch.float32)}
    wt = torch.arange(1, 9, dtype=torch.float64)
    scores = _krum_by_hand(pts, f=2)
    best = int(np.argmin(scores))
    k1 = krum(u, wt, 2, 1)
    assert np.allclose(torch.cat([k1["a"], k1["b"]]).numpy(), pts[best], atol=1e-5)
    chosen = np.argsort(scores, kind="stable")[:4]
    want = (pts[chosen] * wt.numpy()[chosen, None]).sum(0) / wt.numpy()[chosen].sum()
    km = krum(u, wt, 2, 4)
    assert np.allclose(torch.cat([km["a"], km["b"]]).numpy(), want, atol=1e-5)
    assert set(chosen.tolist()) <= set(range(6))  # the two far points are never chosen
    dflt = krum(u, wt, 2, None)  # multi-Krum's default m = K - f = 6
    chosen6 = np.argsort(scores, kind="stable")[:6]
    want6 = (pts[chosen6] * wt.numpy()[chosen6, None]).sum(0) / wt.numpy()[chosen6].sum()
    assert np.allclose(torch.cat([dflt["a"], dflt["b"]]).numpy(), want6, atol=1e-5)


def test_clipping_scales_deviations_from_the_payload():
    payload = {"w": torch.tensor([1.0, 1.0])}
    ups = {"w": torch.tensor([[4.0, 5.0], [1.5, 1.0], [float("nan"), 0.0]])}
    out = clip_updates(ups, payload, torch.tensor([1.0, 1.0, 0.0]), 1.0)
    assert torch.allclose(out["w"][0], torch.tensor([1.0 + 3 / 5, 1.0 + 4 / 5]))  # |(3, 4)| = 5 -> 1
    assert torch.allclose(out["w"][1], torch.tensor([1.5, 1.0]))  # already within the bound
    absolute = clip_updates(ups, None, torch.tensor([1.0, 1.0, 0.0]), 2.0)
    assert torch.allclose(absolute["w"][0].norm(), torch.tensor(2.0))


def test_attacks_on_hand_made_updates():
    ref = {"w": torch.tensor([1.0, 1.0])}
    ups = {"w": torch.tensor([[2.0, 3.0], [0.0, 1.0]])}
    rows = torch.tensor([1])
    s = corrupt(AttackConfig("scale", 0.5, -100.0), ups, ref, rows, 0, 0)
    assert torch.equal(s["w"][0], ups["w"][0]) and torch.allclose(s["w"][1], torch.tensor([101.0, 1.0]))
    f = corrupt(AttackConfig("signflip", 0.5, 2.0), ups, ref, rows, 0, 0)
    assert torch.allclose(f["w"][1], torch.tensor([3.0, 1.0]))
    g1 = corrupt(AttackConfig("gaussian", 0.5, 3.0), ups, ref, rows, 0, 7)
    g2 = corrupt(AttackConfig("gaussian", 0.5, 3.0), ups, ref, rows, 0, 7)
    assert torch.equal(g1["w"], g2["w"]) and not torch.equal(g1["w"][1], ups["w"][1])
    att = AttackConfig("scale", 0.1, 5.0)
    assert torch.equal(att.attackers(30, 4), att.attackers(30, 4)) and len(att.attackers(30, 4)) == 3


def _flat(tree) -> np.ndarray:
    return torch.cat([x.reshape(-1).double() for x in T.leaves(tree)]).numpy()


def _rows(tree) -> np.ndarray:
    return torch.cat([x.reshape(x.shape[0], -1).double() for x in T.leaves(tree)], 1).numpy()


def _honest_setup():
    # 6 rows, two leaves; rows 4, 5 attack, row 3 is invalid (NaN, not honest); the reference is the payload
    rng = np.random.default_rng(3)
    w = torch.tensor(rng.normal(1.0, 1.0, (6, 2, 3)))
    b = torch.tensor(rng.normal(-2.0, 0.5, (6, 1)))
    w[3, 0, 0] = float("nan")
    ref = {"w": torch.full((2, 3), 0.5, dtype=torch.float64), "b": torch.tensor([0.25], dtype=torch.float64)}
    return {"w": w, "b": b}, ref, torch.tensor([4, 5]), torch.tensor([0, 1, 2])


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    ups, ref, rows, honest = _honest_setup()
    dev_mean = _rows(ups)[[0, 1, 2]].mean(0) - _flat(ref)
    for strength, eps in ((None, 0.1), (0.5, 0.5), (-2.0, -2.0)):
        out = corrupt(AttackConfig("ipm", 0.3, strength), ups, ref, rows, 0, 0, honest)
        sent = _rows(out)
        for r in (4, 5):  # payload - eps * the honest rows' mean deviation, whatever the attackers' own updates
            assert np.allclose(sent[r], _flat(ref) - eps * dev_mean, atol=1e-12)
        assert np.array_equal(sent[[0, 1, 2]], _rows(ups)[[0, 1, 2]])  # honest rows untouched
    # without a reference (updates not model-shaped) the deviation is the update itself
    plain = corrupt(AttackConfig("ipm", 0.3, 0.5), ups, None, rows, 0, 0, honest)
    assert np.allclose(_rows(plain)[4], -0.5 * _rows(ups)[[0, 1, 2]].mean(0))
    # no honest row: the attackers' own updates stand in for them
    alone = corrupt(AttackConfig("ipm", 0.3, 1.0), ups, ref, rows, 0, 0, torch.zeros(0, dtype=torch.long))
    assert np.allclose(_rows(alone)[5], _flat(ref) - (_rows(ups)[[4, 5]].mean(0) - _flat(ref)))


def test_alie_z_from_n_and_f_and_its_update():
    # z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f: values of the standard normal quantile
    assert alie_z(30, 6) == pytest.approx(0.430727, abs=1e-5)  # s = 10: Phi^-1(2 / 3)
    assert alie_z(50, 10) == pytest.approx(0.467699, abs=1e-5)  # s = 16: Phi^-1(0.68)
    assert alie_z(10, 3) == pytest.approx(0.524401, abs=1e-5)  # s = 3: Phi^-1(0.7)
    assert alie_z(10, 1) == pytest.approx(0.0, abs=1e-12)  # s = 5: Phi^-1(0.5)
    assert alie_z(4, 4) == pytest.approx(NormalDist().inv_cdf(0.999))  # attacker majority: capped
    ups, ref, rows, honest = _honest_setup()
    hon = _rows(ups)[[0, 1, 2]] - _flat(ref)
    z = alie_z(5, 2)  # 5 valid rows (3 honest + 2 attackers)
    out = corrupt(AttackConfig("alie", 0.3), ups, ref, rows, 0, 0, honest)
    want = _flat(ref) + hon.mean(0) - z * hon.std(0)  # population std per coordinate
    assert np.allclose(_rows(out)[4], want) and np.allclose(_rows(out)[5], want)
    given = corrupt(AttackConfig("alie", 0.3, 1.5), ups, ref, rows, 0, 0, honest)
    assert np.allclose(_rows(given)[4], _flat(ref) + hon.mean(0) - 1.5 * hon.std(0))


@pytest.mark.parametrize("bound", [1.0, 2.5])
def test_minmax_distance_constraint_holds_and_is_tight(bound):
    ups, ref, rows, honest = _honest_setup()
    hon = _rows(ups)[[0, 1, 2]] - _flat(ref)
    out = corrupt(AttackConfig("minmax", 0.3, bound if bound != 1.0 else None), ups, ref, rows, 0, 0, honest)
    mal = _rows(out)[4] - _flat(ref)
    d_max = max(np.linalg.norm(a - b) for a in hon for b in hon)
    far = max(np.linalg.norm(mal - h) for h in hon)
    assert far == pytest.approx(bound * d_max, rel=1e-9)  # the bound holds with equality: gamma is the largest
    step = mal - hon.mean(0)
    gamma = float(np.linalg.norm(step) / np.linalg.norm(hon.std(0)))
    assert gamma > 0 and np.allclose(step, -gamma * hon.std(0))  # along the inverse standard deviation
    beyond = hon.mean(0) - 1.001 * gamma * hon.std(0)
    assert max(np.linalg.norm(beyond - h) for h in hon) > bound * d_max  # any larger gamma breaks it
    assert np.allclose(_rows(out)[5], _rows(out)[4])  # the attackers collude: one vector
    # a zero direction (identical honest rows): the mean itself
    same = torch.ones(4, 3, dtype=torch.float64)
    assert minmax_gamma(same, same[0], torch.zeros(3)) == 0.0


def _cc_by_hand(x: np.ndarray, w: np.ndarray, tau: float, iterations: int) -> np.ndarray:
    v = np.median(x, axis=0)
    wn = w / w.sum()
    for _ in range(iterations):
        step = np.zeros_like(v)
        for xi, wi in zip(x, wn, strict=True):
            d = xi - v
            n = np.linalg.norm(d)
            step += wi * (d if n <= tau else d * tau / n)
        v = v + step
    return v


def test_centered_clipping_by_hand():
    # four points in the plane, one far: the median centre is (0.5, 0.5); with tau = 1 only the far one is clipped
    u = {"a": torch.tensor([[0.0], [1.0], [0.0], [10.0]]), "b": torch.tensor([[0.0], [0.0], [1.0], [10.0]])}
    ones = torch.ones(4, dtype=torch.float64)
    one = _flat(centered_clip(u, ones, 1.0, 1))
    step = (-0.5 + 0.5 - 0.5 + math.sqrt(0.5)) / 4
    assert np.allclose(one, [0.5 + step, 0.5 + step])
    x = _rows(u)
    w = np.array([1.0, 2.0, 3.0, 4.0])
    for tau, it in ((1.0, 3), (0.3, 5), (4.0, 2)):
        got = centered_clip(u, torch.tensor(w), tau, it)
        assert np.allclose(_flat(got), _cc_by_hand(x, w, tau, it), atol=1e-6)
    # automatic tau: the median distance from the starting centre
    dist = np.linalg.norm(x - np.median(x, axis=0), axis=1)
    assert np.allclose(_flat(centered_clip(u, torch.tensor(w), None, 3)), _cc_by_hand(x, w, float(np.median(dist)), 3),
                       atol=1e-6)
    # tau infinite: the weighted mean (rows of weight 0, NaN included, never count)
    ups, wt = _updates()
    inf = centered_clip(ups, wt, math.inf, 2)
    mean = T.weighted_mean(ups, wt)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(T.leaves(inf), T.leaves(mean), strict=True))
    # a far outlier moves the result by at most tau per iteration times its weight share
    robust = centered_clip(ups, wt, 1.0, 1)
    assert np.isfinite(_flat(robust)).all() and abs(_flat(robust)[0] - 2.5) < 1.0


def test_bucketing_averages_random_buckets_reproducibly():
    rng = np.random.default_rng(1)
    u = {"a": torch.tensor(rng.normal(size=(7, 3))), "b": torch.tensor(rng.normal(size=(7, 2, 2)))}
    w = torch.tensor([1.0, 2.0, 0.0, 3.0, 1.0, 5.0, 2.0], dtype=torch.float64)  # row 2 excluded
    seen = {}

    def record(means, weights):
        seen["means"], seen["weights"] = means, weights
        return T.take(means, 0)

    bucketed(u, w, 2, record, torch.Generator().manual_seed(5))
    valid = [0, 1, 3, 4, 5, 6]
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(5)).tolist()
    x, wv = _rows(u)[valid], w.numpy()[valid]
    buckets = [perm[i : i + 2] for i in range(0, 6, 2)]
    assert np.allclose(seen["weights"].numpy(), [wv[b].sum() for b in buckets])
    want = np.stack([(x[b] * wv[b, None]).sum(0) / wv[b].sum() for b in buckets])
    assert np.allclose(_rows(seen["means"]), want)
    # s = 4: a full bucket and a smaller last one
    bucketed(u, w, 4, record, torch.Generator().manual_seed(5))
    assert seen["weights"].numel() == 2 and float(seen["weights"].sum()) == float(w.sum())
    # the combiner: s = 0 / 1 is the plain aggregator; bucketing in front of the mean is the weighted mean
    for s in (0, 1):
        for got in (RobustConfig(aggregator="median", bucketing=s).combiner()(u, w),
                    RobustConfig(aggregator="median", bucketing=s).combiner(torch.Generator())(u, w)):
            assert all(torch.equal(a, b) for a, b in zip(T.leaves(got), T.leaves(median(u, w)), strict=True))
    got = RobustConfig().combiner()(u, w)
    assert all(torch.equal(a, b) for a, b in zip(T.leaves(got), T.leaves(T.weighted_mean(u, w)), strict=True))
    mb = RobustConfig(bucketing=3).combiner(torch.Generator().manual_seed(0))(u, w)
    assert np.allclose(_flat(mb), _flat(T.weighted_mean(u, w)))
    # reproducible from (seed, round): the same round's generator gives the same buckets, another round others
    cfg = RobustConfig(aggregator="median", bucketing=2)

    def med(r):
        return _flat(cfg.combiner(round_generator(9, r, BUCKETING_STREAM))(u, w))

    assert np.array_equal(med(3), med(3))
    assert any(not np.array_equal(med(3), med(r)) for r in range(4, 10))


def _bulyan_direct(x: np.ndarray, f: int) -> np.ndarray:
    k = len(x)
    remaining, selected = list(range(k)), []
    for _ in range(k - 2 * f):
        scores = []
        for i in remaining:
            d = sorted(float(((x[i] - x[j]) ** 2).sum()) for j in remaining if j != i)
            near = max(1, min(len(remaining) - f - 2, len(remaining) - 1))
            scores.append(sum(d[:near]) if d else 0.0)
        selected.append(remaining.pop(int(np.argmin(scores))))
    s = x[selected]
    med = np.median(s, axis=0)
    beta = len(selected) - 2 * f
    out = np.empty(x.shape[1])
    for c in range(x.shape[1]):
        order = np.argsort(np.abs(s[:, c] - med[c]), kind="stable")[:beta]
        out[c] = s[order, c].mean()
    return out


def test_bulyan_hand_example_and_direct_computation():
    # 1-d, f = 1, K = 7 = 4f + 3: repeated Krum selects 2, 3, 1, 4, 0 (never 100); the 3 values closest to
    # their median 2 are 1, 2, 3
    u = {"a": torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [100.0]])}
    assert float(bulyan(u, torch.ones(7), 1)["a"][0]) == pytest.approx(2.0)
    u2 = {"a": torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.5], [5.0], [100.0]])}
    assert float(bulyan(u2, torch.ones(7), 1)["a"][0]) == pytest.approx(2.0)  # selects 3, 2, 4.5, 0, 1 -> 1, 2, 3
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(0, 1, (9, 4)), rng.normal(8, 1, (2, 4))])
    u3 = {"a": torch.tensor(x[:, :3]), "b": torch.tensor(x[:, 3:])}
    got = bulyan(u3, torch.ones(11, dtype=torch.float64), 2)
    assert np.allclose(_flat(got), _bulyan_direct(x, 2), atol=1e-12)
    # excluded rows never count; below 4f + 3 updates it uses the largest f allowed (here 0: the plain mean)
    w = torch.tensor([1.0] * 6 + [0.0] * 5, dtype=torch.float64)
    low = bulyan(u3, w, 2)
    assert np.allclose(_flat(low), x[:6].mean(0), atol=1e-12)


CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 30
dim = 10
n_test = 100
max_samples = 200
seed = 4

[model]
name = "linear"

[algorithm]
name = "{alg}"
{extra}

[optim]
lr = 0.1

[run]
rounds = 8
batch_size = 32
seed = 6
eval_every = 8
"""


def _run(alg, tables="", extra=""):
    cfg = validate(tomllib.loads(CONFIG.format(alg=alg, extra=extra) + tables))
    return run_experiment(cfg, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("alg,extra", [("fedavg", ""), ("fedem", "num_components = 2")])
def test_scaled_attackers_break_the_mean_and_not_the_median(alg, extra):
    clean = _run(alg, extra=extra).final["seen_test_acc_mean"]
    attack = '\n[attack]\nkind = "scale"\nfraction = 0.1\nstrength = -100.0\n'
    broken = _run(alg, attack, extra)
    assert len(broken.summary["attackers"]) == 3
    hit = broken.final["seen_test_acc_mean"]
    assert hit < clean - 0.3  # the plain mean is dragged away
    for agg in ("median", "trimmed_mean", "krum", "multi_krum"):
        rob = _run(alg, attack + f'\n[robust]\naggregator = "{agg}"\ntrim = 0.2\nnum_byzantine = 3\n', extra)
        acc = rob.final["seen_test_acc_mean"]
        # coordinate-wise rules and Krum pay for robustness on heterogeneous clients even without attackers;
        # multi-Krum, which averages the K - f most central updates, keeps the clean accuracy
        assert acc > hit + 0.3 and acc > clean - (0.03 if agg == "multi_krum" else 0.09), (agg, acc, clean)


@pytest.mark.slow
def test_defaults_leave_results_unchanged_and_a_huge_clip_is_a_no_op():
    plain = _run("fedem", extra="num_components = 2")
    explicit = _run("fedem", '\n[robust]\naggregator = "mean"\nclip_norm = 0.0\nbucketing = 1\ncc_tau = 0.0\n'
                    "cc_iterations = 3\n", "num_components = 2")
    clipped = _run("fedem", "\n[robust]\nclip_norm = 1e12\n", "num_components = 2")
    none = _run("fedem", '\n[attack]\nkind = "ipm"\nfraction = 0.0\n', "num_components = 2")  # no attackers
    for a, b, c, d in zip(T.leaves(plain.server), T.leaves(explicit.server), T.leaves(clipped.server),
                          T.leaves(none.server), strict=True):
        assert torch.equal(a, b) and torch.equal(a, d) and torch.allclose(a, c, atol=1e-6)


def test_robust_and_attack_tables_are_validated():
    base = CONFIG.format(alg="fedavg", extra="")
    bad = [("robust", "aggregator", '"mode"'), ("robust", "trim", "0.5"), ("robust", "clip_norm", "nan"),
           ("robust", "num_byzantine", "-1"), ("attack", "kind", '"poison"'), ("attack", "fraction", "1.5"),
           ("attack", "strength", "inf"), ("robust", "bucketing", "-1"), ("robust", "bucketing", "1001"),
           ("robust", "bucketing", "2.5"), ("robust", "cc_tau", "-0.1"), ("robust", "cc_tau", "nan"),
           ("robust", "cc_iterations", "0"), ("robust", "cc_iterations", "101"), ("robust", "clip_norm", "-1.0"),
           ("robust", "multi_krum_m", "-2"), ("attack", "kind", '"sign_flip"'), ("attack", "kind", '"label_flip"'),
           ("attack", "strength", "1e7"), ("attack", "fraction", "-0.1")]
    for (table, key, value), _ in itertools.product(bad, [0]):
        with pytest.raises(ConfigError, match=rf"\[{table}\]|{table}\.{key}"):
            validate(tomllib.loads(base + f"\n[{table}]\n{key} = {value}\n"), "x.toml")
    with pytest.raises(ConfigError, match="minmax"):
        validate(tomllib.loads(base + '\n[attack]\nkind = "minmax"\nstrength = 0.0\n'), "x.toml")
    for kind in ("ipm", "alie", "minmax", "signflip", "labelflip", "scale", "gaussian", "none"):
        validate(tomllib.loads(base + f'\n[attack]\nkind = "{kind}"\nfraction = 0.2\n'), "x.toml")
    for agg in ("bulyan", "centered_clip"):
        validate(tomllib.loads(base + f'\n[robust]\naggregator = "{agg}"\nbucketing = 2\ncc_tau = 0.5\n'), "x.toml")
    # Python callers get the same refusals; every numeric key declares its range
    with pytest.raises(ValueError, match="robust.bucketing"):
        RobustConfig(bucketing=-1)
    with pytest.raises(ValueError, match="attack.fraction"):
        AttackConfig("ipm", 2.0)
    hints = type_hints(RobustConfig)
    assert range_of(hints["bucketing"]) == Range(0, 1000) and range_of(hints["cc_iterations"]) == Range(1, 100)
    assert all(range_of(hints[k]) is not None for k in ("trim", "num_byzantine", "multi_krum_m", "clip_norm", "cc_tau"))
    assert all(range_of(type_hints(AttackConfig)[k]) is not None for k in ("fraction", "strength"))
    with pytest.raises(ValueError, match="does not average"):
        cfg = validate(tomllib.loads(CONFIG.format(alg="local", extra="") + '\n[robust]\naggregator = "median"\n'))
        run_experiment(cfg, progress=False)
    with pytest.raises(ValueError, match="does not average"):
        cfg = validate(tomllib.loads(CONFIG.format(alg="local", extra="") + "\n[robust]\nbucketing = 2\n"))
        run_experiment(cfg, progress=False)
    with pytest.raises(ValueError, match=r"4f \+ 3"):  # 30 clients a round: f <= 6
        run_experiment(validate(tomllib.loads(base + '\n[robust]\naggregator = "bulyan"\nnum_byzantine = 7\n')),
                       progress=False)
    with pytest.raises(ValueError, match="bucket means"):  # 15 buckets: f <= 3
        run_experiment(validate(tomllib.loads(base + '\n[robust]\naggregator = "bulyan"\nnum_byzantine = 4\n'
                                              "bucketing = 2\n")), progress=False)
    assert RobustConfig().is_plain and not RobustConfig(bucketing=2).is_plain and RobustConfig(bucketing=1).is_plain


def _synthetic(sets: list[str]) -> float:
    from fedmtl.config import load

    return 100 * run_experiment(load(ROBUST_SYNTHETIC, sets), progress=False).final["seen_test_acc_mean"]


@pytest.mark.slow
def test_centered_clipping_with_bucketing_withstands_ipm_where_krum_does_not():
    """The handbook's robustness setting (docs/results/robustness.md: 30 clients, 30 rounds, FedAvg), 20% IPM
    attackers (epsilon 0.1)."""
    clean = _synthetic([])
    ipm = ["attack.kind=ipm", "attack.fraction=0.2", "attack.strength=0.1"]
    ccb = ["robust.aggregator=centered_clip", "robust.bucketing=2"]
    defended = _synthetic([*ipm, *ccb])
    assert abs(defended - clean) < 2.0, (defended, clean)
    broken = _synthetic([*ipm, "robust.aggregator=krum", "robust.num_byzantine=6"])
    assert broken < clean - 5.0, (broken, clean)  # Krum picks the attackers' common update
    assert _synthetic([*ipm, *ccb]) == defended  # bucketing's permutations come from the seed: reproducible


@pytest.mark.slow
def test_reproduce_robustness_writes_its_tables(tmp_path):
    from fedmtl.experiments.robustness import AGGREGATORS, clean_label

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.toml").write_text(CONFIG.format(alg="fedavg", extra="").replace("num_clients = 30",
                                                                                                "num_clients = 10"))
    from fedmtl.experiments.robustness import run

    res = run(tmp_path / "out", quick=True, datasets=("tiny",), config_dir=tmp_path / "cfg")
    acc = res["tiny"]["accuracy"]
    assert set(acc) == {*(clean_label(a, 0.2) for a in AGGREGATORS), *(f"ipm0.1/20%/{a}" for a in AGGREGATORS)}
    assert all(0 <= v <= 100 for row in acc.values() for v in row.values())
    eps = [p["epsilon"] for p in res["tiny"]["fedavg_privacy"]]
    assert len(eps) == 2 and all(e > 0 for e in eps)
    for f in ("robustness.md", "robustness.json", "privacy.png", "robustness.png", "summary.json"):
        assert (tmp_path / "out" / f).exists()
    md = (tmp_path / "out" / "robustness.md").read_text()
    assert "| centered_clip+b2 |" in md and "ipm 0.1" in md
