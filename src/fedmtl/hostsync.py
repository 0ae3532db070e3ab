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
``nonzero``.  ``host_sync`` marks the two waits above, so that the debug mode lets them pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


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


__all__ = ["host_sync", "to_device"]
