"""``fedmtl bench scale``: the cost of a round as the population grows from 10^3 to 10^6 clients.

Workload: ``linear_mixture`` federations (linear model, d = 60, 10 classes, 10-20 training and 5 test examples
per client, features stored as float16), 1,000 clients sampled per round, one local epoch of batch 128 (each
client's data is one batch), for ``fedavg``, ``fedem`` (M = 3) and ``ditto`` (a personal model per client) on
the default executor.  Each (population, algorithm) runs in a fresh process, so its peak RSS is its own: one
warm-up round, then ``--rounds`` timed rounds (median reported), then the evaluation of a fixed sample of 10^4
clients (``run.eval_clients``).  Ditto also runs at the largest population with ``client_store = "mmap"``.

Written to ``--out`` (JSON): ``round_s`` {alg: {N: s}}, ``ratio_1e6_vs_1e3`` {alg: ratio}, ``eval_10k_s``
{alg: {N: s}}, ``peak_rss_mb`` {alg: {N: MB}}, ``data_mb`` {N}, ``state_mb`` {alg: {N}}, ``rss_over_data_state``
and the mmap run.  Figures are measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import add_out, add_rounds, add_threads

ALGS = ("fedavg", "fedem", "ditto")
K = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p)
    add_threads(p)
    p.add_argument("--populations", default="1000,10000,100000,1000000", help="federation sizes (clients)")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(n: int, alg_name: str, store: str, rounds: int, threads: int) -> dict[str, Any]:
    """One population and algorithm, in this process."""
    import torch

    from fedmtl.algorithms import Ditto, FedAvg, FedEM
    from fedmtl.data.synthetic import linear_mixture
    from fedmtl.engine.spec import RunConfig, RunSpec
    from fedmtl.models import build_model
    from fedmtl.optim import SGD
    from fedmtl.runs.driver import make_engine

    torch.set_num_threads(threads)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    data = linear_mixture(n, dim=60, num_classes=10, min_train=10, max_train=20, n_test=5, feature_dtype="float16")
    build_s = time.perf_counter() - t0
    data_bytes = sum(s.x.numel() * s.x.element_size() + s.y.numel() * s.y.element_size() + s.offsets.numel() * 8
                     for s in data.seen.splits().values())
    alg = {"fedavg": FedAvg(), "fedem": FedEM(num_components=3), "ditto": Ditto(lam=0.1)}[alg_name]
    model = build_model("linear", data.feature_shape, 10, data.meta)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(rounds=rounds + 1, clients_per_round=min(K, n), batch_size=128, eval_clients=10_000,
                        client_store=store, checkpoint_every=0, seed=1)  # type: ignore[arg-type]
        eng = make_engine(alg, model, data, RunSpec(cfg, SGD(lr=0.1, momentum=0.9)), out_dir=Path(tmp))
        st = eng.init_state()
        eng.round(st)  # warm-up
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            eng.round(st)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        ev = eng.evaluate(st, ("seen",))
        eval_s = time.perf_counter() - t
        store_bytes = eng.clients.store.nbytes  # type: ignore[attr-defined]
        executor = eng.clients.executor.name  # type: ignore[attr-defined]
        eng.clients.close()
    return {
        "clients": n, "algorithm": alg_name, "client_store": store, "executor": executor,
        "round_s": statistics.median(times),
        "round_s_all": times, "eval_s": eval_s, "eval_clients": int(len(ev["seen"]["test"]["n"])),
        "build_s": build_s, "data_mb": data_bytes / 2**20, "state_mb": store_bytes / 2**20,
        "rss_before_data_mb": rss0, "peak_rss_mb": _rss_mb(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _run_worker(n: int, alg: str, store: str, rounds: int, threads: int) -> dict[str, Any]:
    # the worker imports this module as benchmarks.scale: the checkout's root on its path
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=path)
    cmd = [sys.executable, "-m", "benchmarks.scale", str(n), alg, store, str(rounds), str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"scale worker {n} {alg} {store} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> int:
    pops = [int(float(p)) for p in str(args.populations).split(",")]
    rounds, threads = args.rounds, args.threads
    runs: list[dict[str, Any]] = []
    for n in pops:
        for alg in ALGS:
            r = _run_worker(n, alg, "memory", rounds, threads)
            runs.append(r)
            print(f"N={n:>8d} {alg:7s} round {1000 * r['round_s']:7.1f} ms  eval({r['eval_clients']}) "
                  f"{r['eval_s']:.2f} s  peak RSS {r['peak_rss_mb']:7.0f} MB  build {r['build_s']:.1f} s", flush=True)
    mm = _run_worker(max(pops), "ditto", "mmap", rounds, threads)
    print(f"N={mm['clients']:>8d} ditto (mmap store) round {1000 * mm['round_s']:7.1f} ms  "
          f"peak RSS {mm['peak_rss_mb']:.0f} MB", flush=True)
    lo, hi = min(pops), max(pops)
    res: dict[str, Any] = {
        "benchmark": "scale", "sampled_per_round": K, "rounds_timed": rounds, "torch_threads": threads,
        "torch": runs[0]["torch"], "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "workload": "linear_mixture: linear model, d=60, 10 classes, 10-20 train / 5 test examples per client, "
                    "float16 features; batch 128, 1 local epoch; the default executor of each algorithm (executor)",
        "executor": {a: next(r["executor"] for r in runs if r["algorithm"] == a) for a in ALGS},
        "round_s": {a: {str(r["clients"]): r["round_s"] for r in runs if r["algorithm"] == a} for a in ALGS},
        "eval_10k_s": {a: {str(r["clients"]): r["eval_s"] for r in runs if r["algorithm"] == a} for a in ALGS},
        "peak_rss_mb": {a: {str(r["clients"]): r["peak_rss_mb"] for r in runs if r["algorithm"] == a} for a in ALGS},
        "state_mb": {a: {str(r["clients"]): r["state_mb"] for r in runs if r["algorithm"] == a} for a in ALGS},
        "data_mb": {str(r["clients"]): r["data_mb"] for r in runs if r["algorithm"] == "fedavg"},
        "build_s": {str(r["clients"]): r["build_s"] for r in runs if r["algorithm"] == "fedavg"},
        "rss_before_data_mb": runs[0]["rss_before_data_mb"],
        "ditto_mmap": {k: mm[k] for k in ("clients", "round_s", "eval_s", "peak_rss_mb", "state_mb", "data_mb")},
        "runs": runs,
    }
    res["ratio_1e6_vs_1e3"] = {a: res["round_s"][a][str(hi)] / res["round_s"][a][str(lo)] for a in ALGS}
    # peak RSS against the data plus the full client state (memory store: allocated, paged in only when written)
    res["rss_over_data_state"] = {a: {str(r["clients"]): r["peak_rss_mb"] / (r["data_mb"] + r["state_mb"])
                                      for r in runs if r["algorithm"] == a} for a in ALGS}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: res[k] for k in ("round_s", "ratio_1e6_vs_1e3", "eval_10k_s", "peak_rss_mb", "data_mb",
                                           "ditto_mmap")}, indent=1))
    return 0


if __name__ == "__main__":
    n_, alg_, store_, rounds_, threads_ = sys.argv[1:6]
    print(json.dumps(worker(int(n_), alg_, store_, int(rounds_), int(threads_))))
