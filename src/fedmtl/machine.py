"""What the machine has: its memory (the one place that asks the operating system) and its devices
(``run.device``: checked as written on any machine, ``check_device``; against this machine's GPUs where a run
starts, ``torch_device``)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def physical_memory() -> int:
    """Bytes of RAM on this machine (2^40 where the operating system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


#: what ``run.device`` (and ``--device``) accepts
DEVICES = "'cpu', 'cuda' or 'cuda:N' (N the index of a GPU, 0 to 999)"
_DEVICE = re.compile(r"cpu|cuda(?::(0|[1-9][0-9]{0,2}))?")


def check_device(name: object, where: str = "run.device") -> str:
    """``name`` if it is a device this library runs on, written ``cpu``, ``cuda`` or ``cuda:N`` (the whole string
    checked: no ``cuda:-1``, ``cuda:1e3``, ``cuda:0x1`` or 20-digit index); else ``ValueError`` naming ``where``.
    Needs no GPU: whether the machine has that device is ``torch_device``'s question."""
    from .schema import shown

    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"{where} must be {DEVICES}, got {shown(name)}")
    return name


def torch_device(name: str, where: str = "run.device") -> torch.device:
    """The ``torch.device`` for ``name`` (``check_device``) on this machine: a CUDA device needs CUDA here, and
    ``cuda:N`` an N below the number of GPUs; else ``ValueError`` naming ``where`` and what the machine has."""
    import torch

    check_device(name, where)
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{where} = {name!r} but this machine has no CUDA device (torch.cuda.is_available() is "
                             f"False); use {where} = 'cpu'")
        count = torch.cuda.device_count()
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            raise ValueError(f"{where} = {name!r} but this machine has {count} GPU(s): cuda:0 to cuda:{count - 1}")
    return torch.device(name)


def check_parameters(count: int, what: str) -> None:
    """Refuse, before a tensor is allocated, a model of ``count`` parameters whose float32 weights, gradients,
    momentum and one client copy (16 bytes a parameter) need more than 80% of this machine's memory: a typo such as
    ``hidden = [100000, 100000]`` (10^10 parameters) is a one-line ``ValueError`` naming ``what``, not minutes of
    swapping followed by an out-of-memory kill."""
    need, have = 16 * count, physical_memory()
    if need > 0.8 * have:
        raise ValueError(f"{what}: {count:.3g} parameters need about {need / 2**30:.1f} GiB (weights, gradients, "
                         f"momentum, one client's copy), more than this machine's {have / 2**30:.1f} GiB of memory: "
                         "a smaller model")
