"""The speed benchmarks' plumbing (their figures are measured by ``fedmtl bench``, never asserted): device checks,
and the keys the Per-FedAvg and MLP workloads write, on a toy federation."""

import time

import pytest
import torch

from benchmarks.fedem import perfedavg_ratios
from benchmarks.models import bench_mlp
from fedmtl.models import build_model
from fedmtl.testing import toy_data


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device, msg", [("cuda", "no CUDA device"), ("gpu", "'cpu', 'cuda' or 'cuda:N'")])
def test_bench_refuses_a_device_it_cannot_use(tmp_path, device, msg, capsys):
    from fedmtl.cli import main

    assert main(["bench", "engine", "--device", device, "--out", str(tmp_path / "x.json")]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_perfedavg_ratios_are_measured_against_fedavg_in_the_same_run():
    data = toy_data()
    out = perfedavg_ratios(data, build_model("linear", 10, 2), rounds=1)
    for v in ("fo", "hf"):
        assert out[f"perfedavg_{v}_vs_fedavg"] == out[f"perfedavg_{v}_round_s"] / out["fedavg_round_s"] > 0
    n = data.seen.train.counts.double()
    assert out["perfedavg_fo_examples_vs_fedavg"] == pytest.approx(float(20 * n.clamp_max(128).sum() / n.sum()))
    assert out["perfedavg_hf_examples_vs_fedavg"] == pytest.approx(2 * out["perfedavg_fo_examples_vs_fedavg"])


@pytest.mark.slow
def test_mlp_workload_reports_floor_ratios_for_fedavg_and_fedem():
    data = toy_data()
    out = bench_mlp(data, rounds=1, gflops=100.0)
    params = 10 * 200 + 200 + 200 * 1 + 1  # binary: one logit
    assert out["mlp_params"] == params and out["mlp_default_runner"] == "stacked"
    for alg, flops in (("fedavg", 6), ("fedem", 24)):
        floor = flops * params * int(data.seen.train.counts.sum()) / 100e9
        assert out[f"mlp_{alg}_floor_s"] == pytest.approx(floor)
        assert out[f"mlp_{alg}_floor_ratio"] == pytest.approx(out[f"mlp_{alg}_round_s"] / floor)
        assert out[f"mlp_{alg}_speedup_vs_autograd"] > 0


@pytest.mark.slow
def test_peers_workload_and_its_baselines_are_what_the_benchmark_says(tmp_path, monkeypatch):
    """``fedmtl bench peers``: the federation (20 Dirichlet(0.1) clients of 12,000 Fashion-MNIST images, 75/25),
    the per-client loops train (their global model moves and stays finite), and the keys are written.  The loops
    checked are the benchmark's own: its run, each measurement timed once here (without its untimed first round),
    runs FedAvg, lean, Ditto and FedEM once each on the PeerLoop it builds, over the federation checked above."""
    import argparse
    import os

    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        pytest.skip("Fashion-MNIST is not installed (make datasets)")
    from benchmarks import peers as bp

    data = bp.peers_data()
    counts = data.seen.train.counts
    assert data.seen.num_clients == 20 and int(counts.sum() + data.seen.test.counts.sum()) == 12_000
    assert int(counts.min()) >= 30 and int(counts.max()) > 5 * int(counts.min())  # Dirichlet(0.1): skewed sizes
    monkeypatch.setattr(bp, "peers_data", lambda seed=0: data)  # the benchmark's federation: the one checked above

    loops = []  # the PeerLoops the benchmark builds, with their global model's parameters when built

    class Recorded(bp.PeerLoop):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.before = [p.detach().clone() for p in self.global_.parameters()]
            loops.append(self)

    steps = []

    def once(step, rounds, device):
        steps.append(step)
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    monkeypatch.setattr(bp, "PeerLoop", Recorded)
    monkeypatch.setattr(bp, "_median_round", once)
    res = bp.run(argparse.Namespace(threads=1, device="cpu", rounds=1, models="mlp", runners="default"))
    assert len(loops) == 1
    loop = loops[0]
    ran = [s.__name__ for s in steps if getattr(s, "__self__", None) is loop]
    assert ran == ["fedavg_round", "lean_round", "ditto_round", "fedem_round"], ran
    after = list(loop.global_.parameters())
    assert all(torch.isfinite(p).all() for p in after) and not torch.equal(after[0], loop.before[0])
    for key in ("speedup_vs_per_client_mlp", "speedup_vs_lean_loop_mlp", "round_vs_centralized_mlp"):
        assert res[key] > 0
    assert res["path_mlp"] == "stacked" and res["torch_threads"] == 1


@pytest.mark.parametrize("name, has, lacks", [
    ("engine", ("--rounds", "--threads", "--device"), ("--sizes", "--populations", "--fraction")),
    ("models", ("--fraction", "--models", "--runners", "--device"), ("--sizes", "--repeats")),
    ("seeds", ("--repeats", "--device"), ("--rounds", "--populations")),
    ("scale", ("--populations", "--rounds"), ("--device", "--sizes")),
    ("flower", ("--clients", "--rounds"), ("--device", "--threads")),
    ("networked", ("--sizes", "--cvxpy-max"), ("--rounds", "--device", "--threads")),
    ("pfl", ("--rounds", "--threads", "--device", "--cohort", "--pfl-dropout"), ("--sizes", "--populations")),
])
def test_each_benchmark_has_its_own_flags(capsys, name, has, lacks):
    from fedmtl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert f"fedmtl bench {name}" in text and "--out" in text
    assert all(f in text for f in has) and not any(f in text for f in lacks), text


def test_every_benchmark_module_defines_flags_and_main():
    import benchmarks

    for name in benchmarks.BENCHMARKS:
        module = benchmarks.load(name)
        assert callable(module.add_arguments) and callable(module.main), name


def test_bench_outside_a_checkout_says_where_it_runs(monkeypatch, capsys):
    from fedmtl import cli

    monkeypatch.setattr(cli, "_benchmarks", lambda: None)
    assert cli.main(["bench", "engine", "--out", "x.json"]) == 2
    assert "runs from a source checkout (the benchmarks/ package)" in capsys.readouterr().err


def test_readme_bench_commands_parse():
    """Every ``fedmtl bench NAME ...`` the README and the handbook show parses with that benchmark's own flags."""
    import re
    import shlex
    from pathlib import Path

    from fedmtl.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))])
    commands = {m.strip() for m in re.findall(r"fedmtl bench [a-z]+ [^`#\n]*", text)
                if "|" not in m and "--out" in m}
    assert len(commands) >= 8
    for c in commands:
        args = build_parser().parse_args(shlex.split(c)[1:])
        assert args.command == "bench" and args.out, c
