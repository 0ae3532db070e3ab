"""Speed benchmarks.  Figures are measured and written to JSON, never asserted in tests.

``fedmtl bench engine``: FedAvg on the FedEM synthetic data (300 clients, full participation, one
local epoch, batch 128) — seconds per round for the vmap runner, the loop runner, and a baseline
written the way peer libraries work (one ``nn.Module`` + ``torch.optim.SGD`` + ``DataLoader`` per
client, clients stepped one after another), plus the time to evaluate all 1.5 M test examples.

``fedmtl bench fedem``: the same for FedEM (M = 3), whose baseline keeps M modules and optimizers per
client and runs the E-step over a non-shuffled loader, as the reference implementation does.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .algorithms import FedAvg, FedEM, PerFedAvg
from .data.federated import FederatedData
from .data.synthetic import fedem_synthetic
from .engine.driver import make_engine
from .engine.executors import make_executor
from .engine.spec import RunConfig, RunSpec
from .models import build_model
from .optim import SGD
from .report import write_json

OPT = SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)


def _time_rounds(step: Callable[[], Any], rounds: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        if cuda:  # queued kernels belong to the round
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def _device_name(device: str) -> str:
    """The device as recorded in every benchmark's JSON (the GPU's name on CUDA)."""
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class PerClientBaseline:
    """One module + optimizer + DataLoader per client (and per component for FedEM), stepped serially."""

    def __init__(self, data: FederatedData, components: int, batch_size: int = 128, seed: int = 0,
                 device: str = "cpu"):
        train = data.seen.train
        self.m = components
        self.clients = []
        dev = torch.device(device)
        for k in range(train.num_clients):
            x, y = train.client(k)
            x, y = x.to(dev, torch.float32), y.to(dev)
            ds = TensorDataset(x, y.float(), torch.arange(len(y), device=dev))
            models = []
            for j in range(components):
                torch.manual_seed(seed + j)
                models.append(nn.Linear(x.shape[1], 1).to(dev))
            opts = [torch.optim.SGD(mm.parameters(), lr=OPT.lr, momentum=OPT.momentum,
                                    weight_decay=OPT.weight_decay) for mm in models]
            loader = DataLoader(ds, batch_size=batch_size, shuffle=True)
            full = DataLoader(ds, batch_size=batch_size, shuffle=False)
            pi = torch.full((components,), 1 / components, device=dev)
            self.clients.append([models, opts, loader, full, len(ds), pi])
        self.global_models = [nn.Linear(train.x.shape[1], 1).to(dev) for _ in range(components)]
        self.total = float(train.counts.sum())
        self.bce = nn.BCEWithLogitsLoss(reduction="none")

    def round(self) -> None:
        for j in range(self.m):
            g = self.global_models[j].state_dict()
            for c in self.clients:
                c[0][j].load_state_dict(g)
        for c in self.clients:
            models, opts, loader, full, n, pi = c
            if self.m > 1:  # E-step over the whole local set, one component after the other
                with torch.no_grad():
                    losses = torch.stack([torch.cat([self.bce(mm(xb).squeeze(-1), yb) for xb, yb, _ in full])
                                          for mm in models])
                q = torch.softmax(torch.log(pi).unsqueeze(1) - losses, dim=0)
                c[5] = q.mean(1)
            for j, (mm, opt) in enumerate(zip(models, opts, strict=True)):
                for xb, yb, ib in loader:
                    opt.zero_grad()
                    loss = self.bce(mm(xb).squeeze(-1), yb)
                    if self.m > 1:  # q-weighted loss of the M-step, looked up by sample index
                        loss = loss * q[j, ib]
                    loss.mean().backward()
                    opt.step()
        with torch.no_grad():
            for j in range(self.m):
                avg = {k: sum(c[0][j].state_dict()[k] * (c[4] / self.total) for c in self.clients)
                       for k in self.global_models[j].state_dict()}
                self.global_models[j].load_state_dict(avg)


def _bench(args: argparse.Namespace, which: str) -> int:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = fedem_synthetic(legacy=True)
    gen_s = time.perf_counter() - t0
    model = build_model("linear", 150, 2)
    alg = FedAvg() if which == "engine" else FedEM(num_components=3)
    rounds = args.rounds
    res: dict[str, Any] = {
        "benchmark": which, "algorithm": alg.name, "clients": data.num_clients, "batch_size": 128,
        "local_epochs": 1, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "rounds_timed": rounds,
        "data_generation_s": gen_s, "device": _device_name(args.device),
    }
    runners = ("stacked", "vmap", "loop") if alg.clients_form() else ("vmap", "loop")
    for runner in runners:
        sim = make_engine(alg, model, data, RunSpec(RunConfig(rounds=200, runner=runner, device=args.device), OPT))
        st = sim.init_state()
        ts = _time_rounds(lambda sim=sim, st=st: sim.round(st), rounds)
        res[f"{runner}_round_s"] = statistics.median(ts)
        res[f"{runner}_round_s_min"] = min(ts)
        if runner == "vmap":
            ev = _time_rounds(lambda sim=sim, st=st: sim.evaluate(st), 3)
            res["eval_all_clients_s"] = statistics.median(ev)
            res["eval_examples"] = int(data.seen.test.counts.sum() + data.seen.train.counts.sum())
    if which == "fedem":
        res.update(_perfedavg_ratios(data, model, rounds, args.device))
    base = PerClientBaseline(data, components=1 if which == "engine" else 3, device=args.device)
    ts = _time_rounds(base.round, max(2, rounds // 3))
    res["per_client_round_s"] = statistics.median(ts)
    res["speedup_vmap_vs_per_client"] = res["per_client_round_s"] / res["vmap_round_s"]
    res["speedup_vmap_vs_loop"] = res["loop_round_s"] / res["vmap_round_s"]
    res["default_runner"] = make_executor("auto", model, torch.device(args.device)).for_algorithm(alg).name
    res["speedup_default_vs_per_client"] = res["per_client_round_s"] / res[f"{res['default_runner']}_round_s"]
    res["peak_rss_mb"] = _peak_rss_mb()
    write_json(_out(args.out), res)
    for k, v in res.items():
        print(f"{k:32s} {v:.4f}" if isinstance(v, float) else f"{k:32s} {v}")
    return 0


def _perfedavg_ratios(data: FederatedData, model: Any, rounds: int, device: str = "cpu") -> dict[str, Any]:
    """Per-FedAvg (FO and HF, the synthetic config's alpha = beta = 0.01, tau = 10 meta-steps) against FedAvg, round
    times on the default (vmap) runner measured in the same run, and the ratio of examples each processes per round
    (FedAvg: one epoch; Per-FedAvg: tau meta-steps x 2 batches (FO) or x 3 batches, D'' twice (HF))."""
    out: dict[str, Any] = {}
    for name, alg in (("fedavg", FedAvg()), ("perfedavg_fo", PerFedAvg(alpha=0.01, beta=0.01, variant="fo")),
                      ("perfedavg_hf", PerFedAvg(alpha=0.01, beta=0.01, variant="hf"))):
        sim = make_engine(alg, model, data, RunSpec(RunConfig(rounds=200, runner="vmap", device=device), OPT))
        st = sim.init_state()
        out[f"{name}_round_s"] = statistics.median(_time_rounds(lambda sim=sim, st=st: sim.round(st), rounds))
    n = data.seen.train.counts.double()
    batch = n.clamp_max(128)
    for v, grads in (("fo", 2), ("hf", 4)):
        out[f"perfedavg_{v}_vs_fedavg"] = out[f"perfedavg_{v}_round_s"] / out["fedavg_round_s"]
        out[f"perfedavg_{v}_examples_vs_fedavg"] = float(10 * grads * batch.sum() / n.sum())
    return out


def _out(path: str) -> Any:
    from pathlib import Path

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


BENCHMARKS: dict[str, Callable[[argparse.Namespace], int]] = {
    "engine": lambda a: _bench(a, "engine"),
    "fedem": lambda a: _bench(a, "fedem"),
}


# ------------------------------------------------------------------------------------------ models


def matmul_gflops(n: int = 2048, reps: int = 5, device: str = "cpu", trials: int = 5) -> float:
    """The device's fp32 matrix-multiply rate (GFLOP/s) with the current thread setting: the best of ``trials``
    timings of ``reps`` products (a peak rate; one timing on a shared machine can read far below it)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    _sync(device)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def forward_macs(model: Any, x: torch.Tensor) -> int:
    """Multiply-adds of one forward pass: counted on Linear / Conv2d / LSTM layers with hooks."""
    macs = 0

    def hook(mod: nn.Module, inp: Any, out: Any) -> None:
        nonlocal macs
        if isinstance(mod, nn.Linear):
            macs += inp[0].numel() // inp[0].shape[-1] * mod.in_features * mod.out_features
        elif isinstance(mod, nn.Conv2d):
            macs += out.numel() * (mod.in_channels // mod.groups) * mod.kernel_size[0] * mod.kernel_size[1]
        elif isinstance(mod, nn.LSTM):
            n, t = inp[0].shape[0], inp[0].shape[1]
            for layer in range(mod.num_layers):
                d_in = mod.input_size if layer == 0 else mod.hidden_size
                macs += n * t * 4 * mod.hidden_size * (d_in + mod.hidden_size)

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d | nn.LSTM)]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return macs


def _per_client_module_round(module: nn.Module, data: FederatedData, batch_size: int, transform: Any,
                             device: torch.device | None = None, channels_last: bool = False) -> None:
    """One FedAvg round the way peer libraries run it: module + optimizer + DataLoader per client (the client's
    data moved to ``device`` first, as a peer library's client holds its data there).  ``channels_last``: the
    module (already converted by the caller) gets its batches in the channels-last layout (a tuned plain loop)."""
    train = data.seen.train
    global_state = {k: v.clone() for k, v in module.state_dict().items()}
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    total = float(train.counts.sum())
    for k in range(train.num_clients):
        module.load_state_dict(global_state)
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
        x, y = train.client(k)
        if device is not None:
            x, y = x.to(device), y.to(device)
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True):
            opt.zero_grad()
            xb = transform(xb)
            if channels_last:
                xb = xb.clone(memory_format=torch.channels_last)
            nn.functional.cross_entropy(module(xb), yb).backward()
            opt.step()
        w = len(y) / total
        for name, v in module.state_dict().items():
            acc[name] += v * w
    module.load_state_dict(acc)


def _bench_models(args: argparse.Namespace) -> int:
    from .data.text import shakespeare
    from .data.vision import fashion_mnist

    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "cpu_count": os.cpu_count(), "device": _device_name(args.device),
                           "matmul_gflops": matmul_gflops(device=args.device), "rounds_timed": args.rounds}
    rss0 = _peak_rss_mb()
    fm = fashion_mnist(num_clients=100, partition="label_groups", fraction=args.fraction, download=False)
    res["fmnist_federation_bytes"] = int(sum(s.x.numel() * s.x.element_size() + s.y.numel() * 8
                                             for s in fm.seen.splits().values()))
    res["peak_rss_mb_after_fmnist"] = _peak_rss_mb()
    res["peak_rss_mb_before_fmnist"] = rss0
    sh = shakespeare(stride=80, seed=1)
    keep = torch.arange(100)  # the first 100 roles (a random order of all roles)
    from .data.federated import ClientGroup, Split

    def sub(s: Split) -> Split:
        return Split.from_lists([s.client(int(k))[0] for k in keep], [s.client(int(k))[1] for k in keep])

    sh = FederatedData(ClientGroup(sub(sh.seen.train), sub(sh.seen.test)), sh.num_classes, name="shakespeare100",
                       meta=sh.meta)
    # (data, model, batch size (FedEM's reference experiments use 128), clients per vmap call: on a CPU 10 bounds
    # the host memory; a GPU holds all 100 clients' activations (0 = no limit), and each call's per-operator
    # dispatch cost is paid once for all of them)
    chunk = 10 if torch.device(args.device).type == "cpu" else 0
    workloads = {
        "cnn": (fm, build_model("cnn_femnist", fm.feature_shape, 10, fm.meta), 128, chunk),
        "lstm": (sh, build_model("lstm", sh.feature_shape, 80, sh.meta), 32, chunk),
    }
    workloads = {k: v for k, v in workloads.items() if k in args.models.split(",")}
    opt = SGD(lr=0.01)
    dev = torch.device(args.device)
    times: dict[str, dict[str, float]] = {k: {} for k in workloads}

    def timed(key: str, runner: str) -> None:
        data, model, bsz, chunk = workloads[key]
        warmup = 0 if runner == "vmap" and dev.type == "cpu" else 1  # one untimed round (a CPU vmap round: minutes)
        if runner.startswith("per_client"):
            tx = model.input_transform or (lambda x: x)
            cl = runner == "per_client_channels_last"
            mod = copy.deepcopy(model.module).to(dev, memory_format=torch.channels_last) if cl else model.module.to(dev)
            t = _time_rounds(lambda m=mod, d=data, b=bsz, t=tx, cl=cl: _per_client_module_round(m, d, b, t, dev, cl),
                             max(1, args.rounds), warmup)
        else:
            sim = make_engine(FedAvg(), model, data, RunSpec(RunConfig(
                rounds=10, runner=runner, batch_size=bsz, chunk_size=chunk, device=args.device), opt))
            st = sim.init_state()
            t = _time_rounds(lambda sim=sim, st=st: sim.round(st), args.rounds, warmup)
        times[key][runner] = statistics.median(t)
        print(f"{key} {runner}: {times[key][runner]:.2f} s/round", flush=True)

    default = {k: make_executor("auto", v[1], dev).name for k, v in workloads.items()}
    # the default path and the per-client modules of every workload first: the peak RSS up to here is the default
    # path's (the vmap runner of the CNN and LSTM holds every client's activations and peaks far higher on a CPU)
    for key in workloads:
        timed(key, default[key])
        timed(key, "per_client")
    res["peak_rss_mb_default_path"] = _peak_rss_mb()
    if "cnn" in workloads and workloads["cnn"][1].runs_channels_last(dev):
        # the default path runs the CNN channels-last (Model.channels_last); a plain loop tuned the same way, for
        # an honest comparison of what the engine itself adds
        timed("cnn", "per_client_channels_last")
    for key in workloads:
        for runner in ("vmap", "loop"):
            if runner != default[key] and args.runners == "all":
                timed(key, runner)
    # the floor's rate measured again after the rounds; the higher reading is the peak, used by every floor
    res["matmul_gflops"] = max(res["matmul_gflops"], matmul_gflops(device=args.device))
    if "mlp" in args.models.split(","):  # all 70,000 images (56,000 training examples), as the figures
        full = fashion_mnist(num_clients=100, partition="label_groups", download=False)
        res.update(_bench_mlp(full, args.rounds, res["matmul_gflops"], args.device))
    for key, (data, model, bsz, chunk) in workloads.items():
        n_train = int(data.seen.train.counts.sum())
        tx = model.input_transform or (lambda x: x)
        macs = forward_macs(model.module.cpu(), tx(data.seen.train.x[:8])) / 8 * n_train * 3  # fwd + bwd ~ 3 fwd
        res[f"{key}_train_examples"] = n_train
        res[f"{key}_round_macs"] = macs
        res[f"{key}_floor_s"] = 2 * macs / (res["matmul_gflops"] * 1e9)
        res[f"{key}_round_s"] = times[key]
        res[f"{key}_batch_size"] = bsz
        res[f"{key}_vmap_chunk"] = chunk
        res[f"{key}_default_runner"] = default[key]
        res[f"{key}_floor_ratio"] = times[key][default[key]] / res[f"{key}_floor_s"]
        res[f"speedup_default_vs_per_client_{key}"] = times[key]["per_client"] / times[key][default[key]]
        if "per_client_channels_last" in times[key]:
            res[f"speedup_default_vs_per_client_channels_last_{key}"] = (times[key]["per_client_channels_last"]
                                                                         / times[key][default[key]])
        if "vmap" in times[key]:
            res[f"speedup_vmap_vs_per_client_{key}"] = times[key]["per_client"] / times[key]["vmap"]
    res["peak_rss_mb"] = _peak_rss_mb()
    write_json(_out(args.out), res)
    for k, v in res.items():
        print(f"{k:40s} {v}")
    return 0


def _bench_mlp(fm: FederatedData, rounds: int, gflops: float, device: str = "cpu") -> dict[str, Any]:
    """FedAvg and FedEM (M = 3) rounds with the MLP 784-200-10 on the Fashion-MNIST federation (batch 128, one
    epoch, momentum SGD) on the default runner, against their FLOP floors: 6 FLOPs per parameter per training
    example (forward 2, backward 4) for FedAvg; FedEM trains M components (6 M) and its E-step runs their forward
    passes on the local data (2 M): 24 FLOPs per parameter per example.  Also the same rounds with autograd
    (``torch.func.grad``) instead of the stacked-layer path, measured in the same run."""
    model = build_model("mlp", fm.feature_shape, fm.num_classes, fm.meta, hidden=(200,))
    autograd = dataclasses.replace(model, forward=None, analytic_grad=None, stacks=False)
    n = int(fm.seen.train.counts.sum())
    params = sum(v.numel() for v in model.init(0).values())
    out: dict[str, Any] = {"mlp_train_examples": n, "mlp_params": params, "mlp_batch_size": 128,
                           "mlp_default_runner": make_executor("auto", model, torch.device(device)).name}
    # the batched GEMM of the first layer's forward at this workload's shapes (25 clients x 128 examples x 784 -> 200):
    # the rate the stacked path's largest products reach, against the square-matmul rate of the floor
    a, w = torch.randn(25, 128, 784, device=device), torch.randn(25, 784, 200, device=device)
    torch.bmm(a, w)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.bmm(a, w)
    _sync(device)
    out["mlp_bmm_gflops"] = 2 * 25 * 128 * 784 * 200 * 10 / (time.perf_counter() - t0) / 1e9
    for alg, flops in ((FedAvg(), 6), (FedEM(num_components=3), 24)):
        floor = flops * params * n / (gflops * 1e9)
        for tag, m in (("", model), ("_autograd", autograd)):
            sim = make_engine(alg, m, fm, RunSpec(RunConfig(rounds=10, batch_size=128, device=device),
                                                      SGD(0.05, 0.9, 5e-4)))
            st = sim.init_state()
            t = statistics.median(_time_rounds(lambda sim=sim, st=st: sim.round(st), rounds))
            out[f"mlp_{alg.name}_round_s{tag}"] = t
            print(f"mlp {alg.name}{tag}: {t:.2f} s/round", flush=True)
        out[f"mlp_{alg.name}_floor_s"] = floor
        out[f"mlp_{alg.name}_floor_ratio"] = out[f"mlp_{alg.name}_round_s"] / floor
        out[f"mlp_{alg.name}_speedup_vs_autograd"] = out[f"mlp_{alg.name}_round_s_autograd"] / out[
            f"mlp_{alg.name}_round_s"]
    return out


BENCHMARKS["models"] = _bench_models


def _bench_networked(args: argparse.Namespace) -> int:
    from .networked.bench import main

    return main(args)


BENCHMARKS["networked"] = _bench_networked


def _bench_scale(args: argparse.Namespace) -> int:
    from .bench_scale import main

    return main(args)


BENCHMARKS["scale"] = _bench_scale


def _bench_flower(args: argparse.Namespace) -> int:
    from .flower.bench import run

    # round 1 pays start-up; the median of the later rounds is reported
    run(args.out, clients=args.clients, rounds=max(args.rounds, 3))
    return 0


BENCHMARKS["flower"] = _bench_flower


# ------------------------------------------------------------------------------------------ seeds


def _bench_seeds(args: argparse.Namespace) -> int:
    """``fedmtl bench seeds``: wall time of ``fedmtl run`` on the synthetic FedEM config (200 rounds) with one
    seed and with 5 seeds (``--seeds 1-5``, one batched computation), each a fresh process as a user runs it;
    ``ratio_5_vs_1`` = the 5-seed time over the 1-seed time, both measured in this call (alternating, the median
    of ``--repeats``).  Also the training seconds of each command (the runs' ``train_seconds_this_process``; medians
    and every repeat)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from .resources import config_path

    config = str(config_path("synthetic/fedem.toml"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    times: dict[int, list[float]] = {1: [], 5: []}
    train: dict[int, list[float]] = {1: [], 5: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for n in (1, 5):
                out = Path(tmp) / f"r{rep}-s{n}"
                cmd = [sys.executable, "-m", "fedmtl", "-q", "run", config, "--out", str(out),
                       "--set", f"run.threads={args.threads}", "--device", args.device]
                cmd += ["--seeds", "1-5"] if n == 5 else []
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                times[n].append(time.perf_counter() - t0)
                runs = [out] if n == 1 else [out / f"seed-{s}" for s in range(1, 6)]
                train[n].append(sum(json.loads((r / "summary.json").read_text())["train_seconds_this_process"]
                                    for r in runs))
    t1, t5 = statistics.median(times[1]), statistics.median(times[5])
    res = {
        "benchmark": "seeds", "config": "configs/synthetic/fedem.toml", "rounds": 200, "seeds": [1, 2, 3, 4, 5],
        "torch_threads": args.threads, "torch": torch.__version__, "device": _device_name(args.device),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "repeats": args.repeats,
        "one_seed_s": t1, "five_seeds_s": t5, "one_seed_all_s": times[1], "five_seeds_all_s": times[5],
        "one_seed_train_s": statistics.median(train[1]), "five_seeds_train_s": statistics.median(train[5]),
        "one_seed_train_all_s": train[1], "five_seeds_train_all_s": train[5],
        "ratio_5_vs_1": t5 / t1, "train_ratio_5_vs_1": statistics.median(train[5]) / statistics.median(train[1]),
    }
    write_json(_out(args.out), res)
    for k, v in res.items():
        print(f"{k:24s} {v:.4f}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0


BENCHMARKS["seeds"] = _bench_seeds


def _bench_peers(args: argparse.Namespace) -> int:
    from .bench_peers import main

    return main(args)


BENCHMARKS["peers"] = _bench_peers
