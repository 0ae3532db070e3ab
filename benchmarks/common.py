"""What the benchmarks share: their common flags, the device check, round timing and the machine's description."""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the JSON file to write")


def add_rounds(p: argparse.ArgumentParser, default: int = 10, what: str = "rounds timed (the median is reported)"
               ) -> None:
    p.add_argument("--rounds", type=int, default=default, help=what)


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def device_error(dev: str) -> str | None:
    """Why ``--device dev`` cannot be used here (None: it can): ``run.device``'s rule (``fedmtl.machine``)."""
    from fedmtl.machine import torch_device

    try:
        torch_device(dev, "--device")
    except ValueError as e:
        return str(e)
    return None


def check_device(args: argparse.Namespace) -> bool:
    """Print the device error of ``args.device`` (if any) to stderr; True where the device can be used."""
    msg = device_error(args.device)
    if msg:
        print(f"error: {msg}", file=sys.stderr)
    return msg is None


def time_rounds(step: Callable[[], Any], rounds: int, warmup: int | None = None) -> list[float]:
    """Seconds of ``rounds`` calls of ``step`` after ``warmup`` untimed ones (CUDA work queued by a call is waited
    for within it).  By default one untimed call, two on a GPU: a round's steps are recorded as CUDA graphs in the
    second round (``run.compile = "auto"``) and replayed from the third."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range((2 if cuda else 1) if warmup is None else warmup):
        step()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        if cuda:  # queued kernels belong to the round
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def central_epoch(module: Any, x: Any, y: Any, batch: int, lr: float, device: Any, seed: int = 0,
                  channels_last: bool = False) -> Callable[[], None]:
    """One epoch of plain SGD (rate ``lr``, batch ``batch``, a fresh shuffle each call) of a copy of ``module`` on
    ``(x, y)`` on ``device``: the floor the benchmarks hold a round against (the same model trained centrally on the
    same examples).  ``channels_last``: a CNN in the channels-last memory format."""
    import copy

    import torch

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    mod = copy.deepcopy(module).to(device, memory_format=fmt)
    opt = torch.optim.SGD(mod.parameters(), lr=lr)
    x, y = x.to(device), y.to(device)
    gen = torch.Generator().manual_seed(seed)

    def epoch() -> None:
        order = torch.randperm(len(y), generator=gen).to(device)
        for i in range(len(y) // batch):
            idx = order[i * batch:(i + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(mod(x[idx].contiguous(memory_format=fmt)), y[idx]).backward()
            opt.step()

    return epoch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def device_name(device: str) -> str:
    """The device as recorded in every benchmark's JSON (the GPU's name on CUDA)."""
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()})"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def out_path(path: str) -> Path:
    """``path`` with its folder created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


__all__ = ["add_device", "add_out", "add_rounds", "add_threads", "check_device", "device_error", "device_name",
           "out_path", "peak_rss_mb", "sync", "time_rounds"]
