"""``fedmtl bench models``: FedAvg rounds of the Fashion-MNIST CNN and the Shakespeare LSTM on every runner and with
per-client modules, and the Fashion-MNIST MLP (FedAvg, FedEM) against their FLOP floors.  Figures are measured and
written to JSON, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedmtl.algorithms import FedAvg, FedEM
from fedmtl.data.federated import FederatedData
from fedmtl.engine.executors import make_executor
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.models import build_model
from fedmtl.optim import SGD
from fedmtl.runs.driver import make_engine
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, device_name, out_path, peak_rss_mb, sync, time_rounds


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p)
    add_threads(p)
    add_device(p)
    p.add_argument("--fraction", type=float, default=0.25, help="fraction of Fashion-MNIST used by the CNN")
    p.add_argument("--models", default="mlp,cnn,lstm", help="which workloads (mlp, cnn, lstm)")
    p.add_argument("--runners", choices=("all", "default"), default="all",
                   help="also time the non-default runner of the CNN and LSTM (on a CPU their vmap rounds take minutes "
                        "and ~10 GB), or only the default one")


def matmul_gflops(n: int = 2048, reps: int = 5, device: str = "cpu", trials: int = 5) -> float:
    """The device's fp32 matrix-multiply rate (GFLOP/s) with the current thread setting: the best of ``trials``
    timings of ``reps`` products (a peak rate; one timing on a shared machine can read far below it)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    sync(device)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


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


def main(args: argparse.Namespace) -> int:
    from fedmtl.data.text import shakespeare
    from fedmtl.data.vision import fashion_mnist

    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "cpu_count": os.cpu_count(), "device": device_name(args.device),
                           "matmul_gflops": matmul_gflops(device=args.device), "rounds_timed": args.rounds}
    rss0 = peak_rss_mb()
    fm = fashion_mnist(num_clients=100, partition="label_groups", fraction=args.fraction, download=False)
    res["fmnist_federation_bytes"] = int(sum(s.x.numel() * s.x.element_size() + s.y.numel() * 8
                                             for s in fm.seen.splits().values()))
    res["peak_rss_mb_after_fmnist"] = peak_rss_mb()
    res["peak_rss_mb_before_fmnist"] = rss0
    sh = shakespeare(stride=80, seed=1)
    keep = torch.arange(100)  # the first 100 roles (a random order of all roles)
    from fedmtl.data.federated import ClientGroup, Split

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
        warmup = 0 if runner == "vmap" and dev.type == "cpu" else None  # time_rounds' untimed rounds (a CPU vmap
        # round: minutes)
        if runner.startswith("per_client"):
            tx = model.input_transform or (lambda x: x)
            cl = runner == "per_client_channels_last"
            mod = copy.deepcopy(model.module).to(dev, memory_format=torch.channels_last) if cl else model.module.to(dev)
            t = time_rounds(lambda m=mod, d=data, b=bsz, t=tx, cl=cl: _per_client_module_round(m, d, b, t, dev, cl),
                             max(1, args.rounds), warmup)
        else:
            sim = make_engine(FedAvg(), model, data, RunSpec(RunConfig(
                rounds=10, runner=runner, batch_size=bsz, chunk_size=chunk, device=args.device), opt))
            st = sim.init_state()
            t = time_rounds(lambda sim=sim, st=st: sim.round(st), args.rounds, warmup)
        times[key][runner] = statistics.median(t)
        print(f"{key} {runner}: {times[key][runner]:.2f} s/round", flush=True)

    default = {k: make_executor("auto", v[1], dev).name for k, v in workloads.items()}
    # the default path and the per-client modules of every workload first: the peak RSS up to here is the default
    # path's (the vmap runner of the CNN and LSTM holds every client's activations and peaks far higher on a CPU)
    for key in workloads:
        timed(key, default[key])
        timed(key, "per_client")
    res["peak_rss_mb_default_path"] = peak_rss_mb()
    if "cnn" in workloads and workloads["cnn"][1].runs_channels_last(dev):
        # the default path runs the CNN channels-last (Model.channels_last); a plain loop tuned the same way, for
        # an honest comparison of what the engine itself adds
        timed("cnn", "per_client_channels_last")
    for key in workloads:
        for runner in ("stacked", "vmap", "loop"):  # stacked: the model's clients form (grouped convolutions,
            if runner != default[key] and args.runners == "all":  # stacked gates)
                timed(key, runner)
    # the floor's rate measured again after the rounds; the higher reading is the peak, used by every floor
    res["matmul_gflops"] = max(res["matmul_gflops"], matmul_gflops(device=args.device))
    if "mlp" in args.models.split(","):  # all 70,000 images (56,000 training examples), as the figures
        full = fashion_mnist(num_clients=100, partition="label_groups", download=False)
        res.update(bench_mlp(full, args.rounds, res["matmul_gflops"], args.device))
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
        for runner in ("vmap", "stacked"):
            if runner in times[key]:
                res[f"speedup_{runner}_vs_per_client_{key}"] = times[key]["per_client"] / times[key][runner]
    res["peak_rss_mb"] = peak_rss_mb()
    write_json(out_path(args.out), res)
    for k, v in res.items():
        print(f"{k:40s} {v}")
    return 0


def bench_mlp(fm: FederatedData, rounds: int, gflops: float, device: str = "cpu") -> dict[str, Any]:
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
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.bmm(a, w)
    sync(device)
    out["mlp_bmm_gflops"] = 2 * 25 * 128 * 784 * 200 * 10 / (time.perf_counter() - t0) / 1e9
    for alg, flops in ((FedAvg(), 6), (FedEM(num_components=3), 24)):
        floor = flops * params * n / (gflops * 1e9)
        # on a GPU also the steps run eagerly (``run.compile = false``) against the default, replayed as CUDA graphs
        variants = (("", model, "auto"), ("_autograd", autograd, "auto"))
        if torch.device(device).type == "cuda":
            variants += (("_eager", model, False),)
        for tag, m, compile_ in variants:
            sim = make_engine(alg, m, fm, RunSpec(RunConfig(rounds=10, batch_size=128, device=device,
                                                            compile=compile_), SGD(0.05, 0.9, 5e-4)))
            st = sim.init_state()
            t = statistics.median(time_rounds(lambda sim=sim, st=st: sim.round(st), rounds))
            out[f"mlp_{alg.name}_round_s{tag}"] = t
            print(f"mlp {alg.name}{tag}: {t:.2f} s/round", flush=True)
        out[f"mlp_{alg.name}_floor_s"] = floor
        out[f"mlp_{alg.name}_floor_ratio"] = out[f"mlp_{alg.name}_round_s"] / floor
        out[f"mlp_{alg.name}_speedup_vs_autograd"] = out[f"mlp_{alg.name}_round_s_autograd"] / out[
            f"mlp_{alg.name}_round_s"]
    return out


__all__ = ["add_arguments", "bench_mlp", "forward_macs", "main", "matmul_gflops"]
