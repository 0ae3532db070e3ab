"""Where the time of one round goes: the ``bench models`` MLP FedAvg round (Fashion-MNIST, 100 clients, batch 128,
the default executor) timed, then one round under ``torch.profiler`` (the operators' self CPU and self CUDA time,
top 15 of each), under ``cProfile`` (top 15 by cumulative time) and, on a GPU, under
``torch.cuda.set_sync_debug_mode("warn")`` (every host synchronisation of the round, by the line of fedmtl that
asked for it).

Not a ``fedmtl bench`` benchmark (it writes a text report, not figures): run it from a checkout as
``python -m benchmarks.profile_round --device cuda --out DIR [--data-on-device true|false|auto] [--tag NAME]``;
``DIR/profile-NAME.txt`` is written.  It also runs against an older checkout's ``src`` (without
``run.data_on_device``) for a before-and-after on the same machine.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


def _engine(device: str, data_on_device: str, model_name: str = "mlp", alg_name: str = "fedavg",
            compile_step: str = "") -> Any:
    from fedmtl.algorithms import FedAvg, FedEM
    from fedmtl.data.vision import fashion_mnist
    from fedmtl.engine.spec import RunConfig, RunSpec
    from fedmtl.models import build_model
    from fedmtl.optim import SGD
    try:
        from fedmtl.runs.driver import make_engine
    except ImportError:  # an older checkout, before the runs wing
        from fedmtl.engine.driver import make_engine  # type: ignore[no-redef]

    fm = fashion_mnist(num_clients=100, partition="label_groups", download=False)
    if model_name == "cnn":  # bench models' CNN workload
        model = build_model("cnn_femnist", fm.feature_shape, 10, fm.meta)
        opt = SGD(0.01)
    else:
        model = build_model("mlp", fm.feature_shape, fm.num_classes, fm.meta, hidden=(200,))
        opt = SGD(0.05, 0.9, 5e-4)
    alg = FedEM(num_components=3) if alg_name == "fedem" else FedAvg()
    run: dict[str, Any] = {"rounds": 10, "batch_size": 128, "device": device}
    if compile_step:  # run.compile (absent from the options of an older checkout: left at its default)
        run["compile"] = {"true": True, "false": False}.get(compile_step, compile_step)
    if "data_on_device" in {f.name for f in dataclasses.fields(RunConfig)}:  # absent before the key existed
        run["data_on_device"] = {"true": True, "false": False}.get(data_on_device, data_on_device)
    return make_engine(alg, model, fm, RunSpec(RunConfig(**run), opt))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _round_times(sim: Any, st: Any, device: str, n: int) -> list[float]:
    import time

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sim.round(st)
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _syncs(sim: Any, st: Any) -> list[str]:
    """The host synchronisations of one round, each as the line of fedmtl that caused it (``fedmtl.hostsync``)."""
    try:
        from fedmtl.hostsync import host_waits
    except ImportError:  # an older checkout
        return ["(not listed: this checkout has no fedmtl.hostsync)"]
    return host_waits(lambda: sim.round(st))[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="folder for profile-TAG.txt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds timed after two untimed ones (median reported)")
    p.add_argument("--data-on-device", default="auto", choices=("auto", "true", "false"))
    p.add_argument("--tag", default="round")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"), help="bench models' MLP or CNN workload")
    p.add_argument("--alg", default="fedavg", choices=("fedavg", "fedem"))
    p.add_argument("--compile", default="", choices=("", "true", "false", "auto"), help="run.compile (default: "
                   "the key's default)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sim = _engine(args.device, args.data_on_device, args.model, args.alg, args.compile)
    st = sim.init_state()
    warm = _round_times(sim, st, args.device, 3 if args.compile in ("true", "auto") else 2)  # compiles, records
    times = _round_times(sim, st, args.device, args.rounds)
    lines = [f"{args.model.upper()} {args.alg} round (bench models), device {args.device}"
             + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
             + f", torch {torch.__version__}, {args.threads} threads, data_on_device "
             f"{args.data_on_device if hasattr(sim.cfg, 'data_on_device') else '(no such key: an older checkout)'}, "
             f"executor {sim.clients.executor.name}, data held on {sim.clients.data.seen.train.x.device}, "
             f"compile {getattr(sim.cfg, 'compile', None)}",
             f"round seconds: median {statistics.median(times):.4f} of {[round(t, 4) for t in times]} (untimed first "
             f"rounds: {[round(t, 3) for t in warm]})", ""]
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        sim.round(st)
        _sync(args.device)
    ka = prof.key_averages()
    lines += ["== torch.profiler: top 15 by self CPU time ==", ka.table(sort_by="self_cpu_time_total", row_limit=15)]
    if args.device.startswith("cuda"):
        lines += ["== torch.profiler: top 15 by self CUDA time ==",
                  ka.table(sort_by="self_cuda_time_total", row_limit=15)]
    pr = cProfile.Profile()
    pr.enable()
    sim.round(st)
    _sync(args.device)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(15)
    lines += ["== cProfile: top 15 by cumulative time ==", s.getvalue()]
    if args.device.startswith("cuda"):
        try:
            found = _syncs(sim, st)
        except Exception as e:  # the report keeps what was measured
            found = [f"(the sync debug mode failed: {e!r:.200})"]
        counts: dict[str, int] = {}
        for f in found:
            counts[f] = counts.get(f, 0) + 1
        lines += [f"== host synchronisations in one round (set_sync_debug_mode('warn')): {len(found)} ==",
                  *(f"{n:5d}  {w}" for w, n in sorted(counts.items(), key=lambda kv: -kv[1]))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{args.tag}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:2]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
