"""The host synchronisations of a round on a GPU, each named where it happens.

A round on a GPU queues its kernels and returns to Python at once; the host waits for the GPU only where it must
read a result.  A round makes exactly these waits (``tests/test_device.py`` runs rounds of every executor under
``torch.cuda.set_sync_debug_mode("error")`` and fails on any other):

* **the round's screen** (``Clients.accept``): which clients' results are finite and their training losses, read once
  per round in one device-to-host copy, after every client's steps are queued, never per step.  The server needs
  them to leave out non-finite updates, to warn of them and to report the round's loss.
* **client states to the host store** (stateful methods only: FedEM's mixture weights, Ditto's personal models):
  ``ClientStore`` keeps every client's state in host memory (or a memory-mapped file), so the trained clients' new
  states are copied back once per round, right after the screen (the GPU has finished them by then).

Everything else is queued without waiting: host-built index tables go to the device with non-blocking copies
(``to_device``), and the aggregation leaves out excluded rows with masks computed on the device rather than with
``nonzero``.  ``host_sync`` marks the two waits above, so that the debug mode lets them pass; ``host_waits`` lists
every other wait of a call.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

R = TypeVar("R")
_PACKAGE = Path(__file__).resolve().parent


@contextmanager
def host_sync(reason: str) -> Iterator[None]:
    """A documented host synchronisation (``reason`` names it; see the module docstring): inside the block the CUDA
    sync debug mode, where a test turned it on, is off."""
    del reason  # for the reader: every wait of a round is named where it happens
    if not torch.cuda.is_initialized():
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    if before == 0:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def to_device(x: Tensor, device: torch.device | str) -> Tensor:
    """``x`` on ``device``; a host tensor bound for a GPU is staged in pinned memory (a dense copy: an expanded view's
    entries share memory) and copied without the host waiting (the pinned block is not reused before the copy is
    done: torch's host allocator records the copy)."""
    device = torch.device(device)
    if x.device.type != "cpu" or device.type != "cuda":
        return x.to(device)
    return x.contiguous().pin_memory().to(device, non_blocking=True)  # contiguous: an expanded view cannot be pinned


def host_waits(fn: Callable[[], R]) -> tuple[R, list[str]]:
    """``fn()`` run under ``torch.cuda.set_sync_debug_mode("warn")``, and every host synchronisation CUDA reported
    while it ran (those inside ``host_sync`` pass unreported), each as the line of fedmtl that asked for it
    (``file.py:LINE code``).  The debug mode is a prototype that does not see every synchronisation."""
    found: list[str] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = str(message)
        if "synchroniz" not in text.lower() or "prototype" in text:
            return
        ours = [f for f in traceback.extract_stack() if Path(f.filename).resolve().is_relative_to(_PACKAGE)
                and Path(f.filename).name != "hostsync.py"]
        found.append(f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line}" if ours else
                     f"{filename}:{lineno}")

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, found


__all__ = ["host_sync", "host_waits", "to_device"]
