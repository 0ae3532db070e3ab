"""Robust aggregation (``[robust]``) against closed forms on hand-made updates, and the attack harness
(``[attack]``) end to end: the plain mean collapses under scaled updates, a robust aggregator does not."""

from __future__ import annotations

import itertools
import tomllib

import numpy as np
import pytest
import torch

from fedmtl import tree as T
from fedmtl.config import ConfigError, validate
from fedmtl.engine.driver import run_experiment
from fedmtl.robust.aggregators import RobustConfig, clip_updates, krum, median, trimmed_mean
from fedmtl.robust.attacks import AttackConfig, corrupt


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
    f = corrupt(AttackConfig("sign_flip", 0.5, 2.0), ups, ref, rows, 0, 0)
    assert torch.allclose(f["w"][1], torch.tensor([3.0, 1.0]))
    g1 = corrupt(AttackConfig("gaussian", 0.5, 3.0), ups, ref, rows, 0, 7)
    g2 = corrupt(AttackConfig("gaussian", 0.5, 3.0), ups, ref, rows, 0, 7)
    assert torch.equal(g1["w"], g2["w"]) and not torch.equal(g1["w"][1], ups["w"][1])
    att = AttackConfig("scale", 0.1, 5.0)
    assert torch.equal(att.attackers(30, 4), att.attackers(30, 4)) and len(att.attackers(30, 4)) == 3


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
    explicit = _run("fedem", '\n[robust]\naggregator = "mean"\nclip_norm = 0.0\n', "num_components = 2")
    clipped = _run("fedem", "\n[robust]\nclip_norm = 1e12\n", "num_components = 2")
    for a, b, c in zip(T.leaves(plain.server), T.leaves(explicit.server), T.leaves(clipped.server), strict=True):
        assert torch.equal(a, b) and torch.allclose(a, c, atol=1e-6)


def test_robust_and_attack_tables_are_validated():
    base = CONFIG.format(alg="fedavg", extra="")
    bad = [("robust", "aggregator", '"mode"'), ("robust", "trim", "0.5"), ("robust", "clip_norm", "nan"),
           ("robust", "num_byzantine", "-1"), ("attack", "kind", '"poison"'), ("attack", "fraction", "1.5"),
           ("attack", "strength", "inf")]
    for (table, key, value), _ in itertools.product(bad, [0]):
        with pytest.raises(ConfigError, match=rf"\[{table}\]|{table}\.{key}"):
            validate(tomllib.loads(base + f"\n[{table}]\n{key} = {value}\n"), "x.toml")
    with pytest.raises(ValueError, match="does not average"):
        cfg = validate(tomllib.loads(CONFIG.format(alg="local", extra="") + '\n[robust]\naggregator = "median"\n'))
        run_experiment(cfg, progress=False)
    assert RobustConfig().is_plain


@pytest.mark.slow
def test_reproduce_robustness_writes_its_tables(tmp_path):
    from fedmtl.robust.reproduce import run

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.toml").write_text(CONFIG.format(alg="fedavg", extra="").replace("num_clients = 30",
                                                                                                "num_clients = 10"))
    res = run(tmp_path / "out", quick=True, datasets=("tiny",), config_dir=tmp_path / "cfg")
    acc = res["tiny"]["accuracy"]
    assert set(acc) == {"clean", *(f"scale/30%/{a}" for a in ("mean", "median", "trimmed_mean", "krum",
                                                              "multi_krum"))}
    assert all(0 <= v <= 100 for row in acc.values() for v in row.values())
    eps = [p["epsilon"] for p in res["tiny"]["fedavg_privacy"]]
    assert len(eps) == 2 and all(e > 0 for e in eps)
    for f in ("robustness.md", "robustness.json", "privacy.png", "summary.json"):
        assert (tmp_path / "out" / f).exists()
