"""Where a run's examples live (``run.data_on_device``): on the run's device, moved there once, or on the host.

On a GPU a round's work is a few milliseconds of kernels; gathering its batches on the host, converting them there
(uint8 images to float32) and copying them over cost far more.  So the federation is moved to the device **once**,
in its stored dtype (uint8 images, int64 tokens, float16 features), and a round's batches are gathered there by
index and converted there (``executors.TrainBatches``, the model's ``input_transform``).  Only the per-call gather
indices travel, a few bytes per example.  The per-client offsets stay on the host: the host computes a round's
gather indices from them (and from the round's batch orders, drawn on the host), and reading them back from the
device would stall the host on the device once per call.

Where the federation does not fit (``auto`` measures its bytes against the device's free memory, or
``data_on_device = false``), the batches are gathered on the host, still in their stored dtype, staged in pinned
memory and copied without waiting (``fedmtl.hostsync.to_device``), and converted on the device.  On a CPU the host
is the device: both settings hold the data where it is and run the same code.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Literal

import torch

from ..data.federated import ClientGroup, FederatedData, Split

#: ``run.data_on_device``: true, false, or "auto" (resident where it takes at most ``AUTO_SHARE`` of the free memory)
DataOnDevice = bool | Literal["auto"]

#: ``auto``: the federation stays resident where its bytes are at most this share of the device's free memory (the
#: rest is left to the models, their gradients and a round's batches)
AUTO_SHARE = 0.5


def federation_bytes(data: FederatedData) -> int:
    """Bytes of every split's examples and labels (seen and unseen clients), in their stored dtypes."""
    groups = [data.seen] if data.unseen is None else [data.seen, data.unseen]
    return sum(t.numel() * t.element_size() for g in groups for s in g.splits().values() for t in (s.x, s.y))


def fits(nbytes: int, free_bytes: int, share: float = AUTO_SHARE) -> bool:
    """Whether a federation of ``nbytes`` stays resident on a device with ``free_bytes`` free (``auto``)."""
    return nbytes <= share * free_bytes


def resident(data: FederatedData, device: torch.device, mode: DataOnDevice) -> bool:
    """Whether ``data`` lives on ``device`` for a run with ``run.data_on_device = mode`` (on a CPU it always does)."""
    if device.type != "cuda":
        return True
    if mode == "auto":
        free, _total = torch.cuda.mem_get_info(device)
        return fits(federation_bytes(data), free)
    return bool(mode)


def _split_on(s: Split, device: torch.device) -> Split:
    # examples and labels move in their stored dtype; the offsets stay on the host (the module docstring says why)
    return Split(s.x.to(device), s.y.to(device), s.offsets)


def _group_on(g: ClientGroup, device: torch.device) -> ClientGroup:
    return ClientGroup(_split_on(g.train, device), _split_on(g.test, device),
                       None if g.val is None else _split_on(g.val, device))


#: (id of a host federation, device) -> its device copy: engines built on the same data (the replicas of a run with
#: several seeds, a benchmark's runs) share one copy, dropped when the host federation is
_PLACED: dict[tuple[int, str], FederatedData] = {}


def place(data: FederatedData, device: torch.device, mode: DataOnDevice) -> FederatedData:
    """``data`` with its examples on ``device`` where ``resident`` says so (else, and on a CPU, ``data`` itself)."""
    if device.type == "cpu" or data.seen.train.x.device.type != "cpu" or mode is False:
        return data
    key = (id(data), str(device))
    placed = _PLACED.get(key)  # looked up first: auto's second look would count the first copy against itself
    if placed is None:
        if not resident(data, device, mode):
            return data
        placed = _PLACED[key] = replace(data, seen=_group_on(data.seen, device),
                                        unseen=None if data.unseen is None else _group_on(data.unseen, device))
        weakref.finalize(data, _PLACED.pop, key, None)
    return placed


