"""``fedmtl bench pfl`` (fedmtl beside pfl-research on its CIFAR-10 benchmark's workload) on a tiny federation: the
JSON's keys, both frameworks trained from the same weights on the same examples.  Its figures are never asserted."""

import json
import math
import subprocess
import sys

import pytest
import torch

from benchmarks.pfl_peer import initial_weights, make_arrays, pfl_module, sha256
from fedmtl.models import build_model


def test_the_shared_examples_and_weights_are_fixed_by_the_seed_and_fit_cnn_pfl():
    """The arrays both sides get are drawn once from the seed; the starting weights are pfl's module's, in
    cnn_pfl's parameter order and shapes, and both modules give the same logits under them (NHWC in for pfl)."""
    a, b = make_arrays(3, 4, 5, seed=7), make_arrays(3, 4, 5, seed=7)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert a[0].shape == (12, 3, 32, 32) and a[2].shape == (5, 3, 32, 32) and int(a[1].max()) < 10
    assert sha256([(a[0], a[1])]) != sha256([(make_arrays(3, 4, 5, seed=8)[0], a[1])])
    start = initial_weights(0)
    m = build_model("cnn_pfl", (3, 32, 32), 10)
    params = dict(zip([k for k, _ in m.module.named_parameters()], start, strict=True))
    assert [tuple(v.shape) for v in params.values()] == [tuple(p.shape) for p in m.module.parameters()]
    ref = pfl_module(False)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), start, strict=True):
            p.copy_(w)
        assert torch.allclose(ref(a[0].permute(0, 2, 3, 1)), m.apply(params, a[0]), atol=1e-4)


@pytest.mark.slow
def test_bench_pfl_writes_both_frameworks_side_by_side(tmp_path):
    pytest.importorskip("pfl")
    out = tmp_path / "pfl.json"
    r = subprocess.run([sys.executable, "-m", "fedmtl", "bench", "pfl", "--clients", "6", "--cohort", "3",
                        "--rounds", "2", "--eval-examples", "40", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for key in ("fedmtl_round_s", "pfl_round_s", "speedup_vs_pfl", "device", "torch", "pfl", "threads", "workload",
                "fedmtl_accuracy", "pfl_accuracy", "timestamp"):
        assert key in res, key
    assert res["speedup_vs_pfl"] == pytest.approx(res["pfl_round_s"] / res["fedmtl_round_s"])
    # the floor: a central epoch over a round's number of examples (3 x 50) at batch 10 and at batch 30, the faster
    assert res["central_round_s"] == min(res["central_round_s_batch10"], res["central_round_s_batch30"]) > 0
    assert res["fedmtl_round_vs_central"] == pytest.approx(res["fedmtl_round_s"] / res["central_round_s"])
    assert res["pfl_round_vs_central"] == pytest.approx(res["pfl_round_s"] / res["central_round_s"])
    assert len(res["fedmtl_rounds_s"]) == len(res["pfl_rounds_s"]) == 2  # the warm-up round left out
    assert res["workload"]["clients"] == 6 and res["threads"] == 1 and res["torch_threads"] == {"fedmtl": 1, "pfl": 1}
    assert all(math.isfinite(res[k]) and 0 <= res[k] <= 1 for k in ("fedmtl_accuracy", "pfl_accuracy"))
    # the same examples (each side's own hash of what it was given, equal to the arrays' own) ...
    x, y, xe, ye = make_arrays(6, 50, 40, seed=0)
    want = sha256([(x[k * 50:(k + 1) * 50], y[k * 50:(k + 1) * 50]) for k in range(6)] + [(xe, ye)])
    assert res["examples_sha256"] == {"fedmtl": want, "pfl": want} and res["same_examples"]
    # ... and the same starting model: before training both score the held-out set alike (one example may flip
    # between the two memory layouts' roundings)
    assert abs(res["fedmtl_accuracy_before"] - res["pfl_accuracy_before"]) <= 1 / 40 + 1e-9
