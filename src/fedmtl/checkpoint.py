"""Atomic checkpoints of a simulation (server state, all client states, history, counters)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .simulate import SimState


def save(path: str | Path, state: SimState, config: dict[str, Any]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: never a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "round": state.round, "server": state.server, "clients": state.clients,
        "history": state.history, "counters": state.counters, "config": config,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | Path, device: torch.device | str = "cpu") -> tuple[SimState, dict[str, Any]]:
    payload = torch.load(Path(path), map_location=device, weights_only=False)
    state = SimState(payload["round"], payload["server"], payload["clients"], payload["history"], payload["counters"])
    return state, payload["config"]
