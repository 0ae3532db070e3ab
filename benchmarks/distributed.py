"""``fedmtl bench distributed``: one simulation on 1 and on 2 ranks of torchrun (gloo, one thread per rank).

Workloads:

* ``cnn``: the CNN round of ``fedmtl bench models`` (Fashion-MNIST, 100 clients by label groups, ``--fraction`` of
  the images, FedAvg, batch 128, every client every round, the default executor of each rank);
* ``scale``: a 10^5-client population of ``fedmtl bench scale`` (``linear_mixture``, d = 60, 1,000 clients a
  round, batch 128) with Ditto, whose personal models fill the client store.

Each (workload, ranks) runs as its own ``torchrun --standalone --nproc-per-node R`` job: one warm-up round, then
``--rounds`` (``--scale-rounds``) timed rounds (the ranks meet at a barrier before each; the median of rank 0's
times).  Every rank reports its peak RSS and the bytes of its client-store shard.  Written to ``--out`` (JSON):
``round_s`` {workload: {ranks: s}}, ``throughput_2_vs_1_cnn``, ``throughput_2_vs_1_scale`` (round time on 1 rank /
on 2), ``store_mb_per_rank`` and ``peak_rss_mb_per_rank`` {workload: {ranks: [per rank]}},
``store_per_rank_2_vs_1`` {workload: largest shard on 2 ranks / the store of 1}.  With ``--device cuda`` the
workloads run on 1 rank on this machine's GPU (NCCL).  Figures are measured, never asserted.
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

from .common import add_out, add_rounds

WORKLOADS = ("cnn", "scale")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p)
    p.add_argument("--workloads", default="cnn,scale", help="which workloads (cnn, scale)")
    p.add_argument("--ranks", default="1,2", help="rank counts to run (CPU: one thread each)")
    p.add_argument("--fraction", type=float, default=0.25, help="fraction of Fashion-MNIST used by the CNN")
    p.add_argument("--clients", type=int, default=100_000, help="population of the scale workload")
    p.add_argument("--scale-rounds", type=int, default=20, help="rounds timed of the scale workload (its rounds take "
                   "milliseconds: more of them for a stable median)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one rank on this machine's GPU")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(workload: str, rounds: int, fraction: float, clients: int, device: str, out: str) -> None:
    """One rank of a job (started by torchrun): build the workload, time its rounds, write this rank's figures."""
    import torch

    from fedmtl.algorithms import Ditto, FedAvg
    from fedmtl.engine.distributed import Group
    from fedmtl.engine.spec import RunConfig, RunSpec
    from fedmtl.models import build_model
    from fedmtl.optim import SGD
    from fedmtl.runs.driver import make_engine

    group = Group.start(device)
    rss0 = _rss_mb()
    try:
        if workload == "cnn":
            from fedmtl.data.vision import fashion_mnist

            data = fashion_mnist(num_clients=100, partition="label_groups", fraction=fraction, download=False)
            model = build_model("cnn_femnist", data.feature_shape, 10, data.meta)
            cfg = RunConfig(rounds=rounds + 1, batch_size=128, chunk_size=10 if device == "cpu" else 0, device=device,
                            checkpoint_every=0, seed=1)
            alg: Any = FedAvg()
            opt = SGD(lr=0.01)
        else:
            from fedmtl.data.synthetic import linear_mixture

            data = linear_mixture(clients, dim=60, num_classes=10, min_train=10, max_train=20, n_test=5,
                                  feature_dtype="float16")
            model = build_model("linear", data.feature_shape, 10, data.meta)
            cfg = RunConfig(rounds=rounds + 1, clients_per_round=1000, batch_size=128, eval_clients=10_000,
                            device=device, checkpoint_every=0, seed=1)
            alg = Ditto(lam=0.1)
            opt = SGD(lr=0.1, momentum=0.9)
        with tempfile.TemporaryDirectory() as tmp:
            eng = make_engine(alg, model, data, RunSpec(cfg, opt), out_dir=Path(tmp), group=group)
            del data
            st = eng.init_state()
            eng.round(st)  # warm-up
            times = []
            for _ in range(rounds):
                group.barrier()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t = time.perf_counter()
                eng.round(st)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            group.barrier()
            t = time.perf_counter()
            eng.evaluate(st, ("seen",))
            eval_s = time.perf_counter() - t
            clients_obj: Any = eng.clients
            store = clients_obj.local.store
            res = {"rank": group.rank, "ranks": group.world, "workload": workload, "round_s": statistics.median(times),
                   "round_s_all": times, "eval_s": eval_s, "store_mb": store.nbytes / 2**20,
                   "held_clients": int(store.num_clients), "peak_rss_mb": _rss_mb(), "rss_before_data_mb": rss0,
                   "rank_executor": clients_obj.executor.name, "updates": "summed" if clients_obj.sum_updates
                   else "gathered", "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
            eng.clients.close()
        Path(f"{out}.rank{group.rank}.json").write_text(json.dumps(res))
    finally:
        group.close()


def _job(workload: str, ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
    with tempfile.TemporaryDirectory() as tmp:
        stem = str(Path(tmp) / "figures")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "benchmarks.distributed", workload, str(args.scale_rounds if workload == "scale" else args.rounds),
               str(args.fraction), str(args.clients),
               args.device, stem]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"distributed worker {workload} x{ranks} failed:\n{out.stderr[-4000:]}")
        return [json.loads(Path(f"{stem}.rank{r}.json").read_text()) for r in range(ranks)]


def main(args: argparse.Namespace) -> int:
    import torch

    workloads = [w for w in str(args.workloads).split(",") if w]
    bad = sorted(set(workloads) - set(WORKLOADS))
    if bad:
        print(f"fedmtl bench distributed: unknown workload(s) {bad}: choose from {list(WORKLOADS)}", file=sys.stderr)
        return 2
    ranks = [int(r) for r in str(args.ranks).split(",")] if args.device == "cpu" else [1]
    res: dict[str, Any] = {
        "benchmark": "distributed", "device": args.device,
        "rounds_timed": {"cnn": args.rounds, "scale": args.scale_rounds}, "threads_per_rank": 1,
        "backend": "gloo" if args.device == "cpu" else "nccl", "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "torch": torch.__version__, "cnn_fraction": args.fraction,
        "scale_clients": args.clients,
        "workload": {"cnn": "FedAvg, Fashion-MNIST CNN (bench models), 100 clients every round, batch 128",
                     "scale": f"Ditto, linear_mixture with {args.clients} clients (bench scale), 1,000 a round"},
        "round_s": {}, "store_mb_per_rank": {}, "peak_rss_mb_per_rank": {}, "updates": {}, "rank_executor": {},
        "runs": [],
    }
    for w in workloads:
        for r in ranks:
            figs = _job(w, r, args)
            res["runs"].extend(figs)
            res["round_s"].setdefault(w, {})[str(r)] = figs[0]["round_s"]
            res["store_mb_per_rank"].setdefault(w, {})[str(r)] = [f["store_mb"] for f in figs]
            res["peak_rss_mb_per_rank"].setdefault(w, {})[str(r)] = [f["peak_rss_mb"] for f in figs]
            res["updates"][w] = figs[0]["updates"]
            res["rank_executor"][w] = figs[0]["rank_executor"]
            print(f"{w:6s} {r} rank(s): round {figs[0]['round_s']:.3f} s, store per rank "
                  f"{[round(f['store_mb'], 1) for f in figs]} MB, peak RSS per rank "
                  f"{[round(f['peak_rss_mb']) for f in figs]} MB", flush=True)
        rs = res["round_s"][w]
        if "1" in rs and "2" in rs:
            res[f"throughput_2_vs_1_{w}"] = rs["1"] / rs["2"]
            one = res["store_mb_per_rank"][w]["1"][0]
            two = max(res["store_mb_per_rank"][w]["2"])
            res.setdefault("store_per_rank_2_vs_1", {})[w] = two / one if one else None
            res.setdefault("peak_rss_per_rank_2_vs_1", {})[w] = (max(res["peak_rss_mb_per_rank"][w]["2"])
                                                                 / res["peak_rss_mb_per_rank"][w]["1"][0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    w_, rounds_, fraction_, clients_, device_, out_ = sys.argv[1:7]
    worker(w_, int(rounds_), float(fraction_), int(clients_), device_, out_)
