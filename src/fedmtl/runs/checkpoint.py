"""Checkpoints: written atomically, read without pickle.

A checkpoint holds tensors and plain data only (``torch.save`` of dicts, lists, numbers and strings; the
server state flattened to ``{path: tensor}`` by ``tree.to_named``), and is read back with
``torch.load(weights_only=True)``, which refuses anything else: a crafted file cannot run code.  A file that
is not a checkpoint, is truncated or corrupt, or holds another format gives a ``CheckpointError`` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import tree as T
from ..engine.round import EngineState
from ..files import atomic, check_file, signals_deferred

FORMAT = "fedmtl-checkpoint/2"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (unreadable, tampered, or from another run)."""


def save(path: str | Path, state: EngineState, config: dict[str, Any], clients: dict[str, Any],
         evaluation: dict[str, Any] | None = None, base: str | None = None, data: str | None = None) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: never a partial file (and an interruption
    during the write waits for it: ``signals_deferred``).  ``evaluation``: the per-client evaluation of this round
    (``Engine.evaluate``'s ``{group: {split: {metric: array}}}``), kept with the last round's checkpoint so that
    resuming a finished run reports it again instead of evaluating every client again (``evaluation_of``).
    ``base``: the digest of an adapted model's frozen base (``fedmtl.models.lora.base_digest``), which the checkpoint
    does not hold; ``check_matches`` refuses a resume over another base.  ``data``: the digest of the data the run
    trains on (``fedmtl.data.federated.data_digest``), held likewise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "round": state.round,
        "server": {k: v.detach().cpu() for k, v in T.to_named(state.server).items()},
        "clients": clients, "history": state.history, "counters": state.counters, "config": config,
    }
    if state.asynchronous is not None:
        payload["async"] = state.asynchronous.named()
    if base is not None:
        payload["base_sha256"] = base
    if data is not None:
        payload["data_sha256"] = data
    if evaluation is not None:
        payload["evaluation"] = {f"{g}/{s}/{k}": torch.from_numpy(np.array(v, copy=True))
                                 for g, splits in evaluation.items() for s, m in splits.items() for k, v in m.items()}
    if T.leaves(state.server_opt):
        payload["server_opt"] = {k: v.detach().cpu() for k, v in T.to_named(state.server_opt).items()}
    # the write waits for a signal (signals_deferred); 0600 as mkstemp makes it (private), whole or not at all
    with signals_deferred(), atomic(path, "wb", private=True) as f:
        torch.save(payload, f)


def load(path: str | Path) -> dict[str, Any]:
    """Read and sanity-check a checkpoint (format, round, finite server state); tensors on the CPU."""
    from ..machine import physical_memory

    path = Path(path)
    try:
        size = check_file(path, physical_memory(), "checkpoint", CheckpointError)  # before reading: no FIFO, device
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    if size == 0:
        raise CheckpointError(f"{path}: an empty file, not a fedmtl checkpoint (checkpoints are written atomically: "
                              "this one was not written by fedmtl)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle refusal, truncation, corruption: all mean "not a usable checkpoint"
        if "Weights only load failed" in str(e):
            raise CheckpointError(f"{path}: not a fedmtl checkpoint: it holds objects other than tensors and plain "
                                  "data, which are never unpickled") from None
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: not a readable fedmtl checkpoint ({type(e).__name__}"
                              f"{': ' + first if first else ''})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a fedmtl checkpoint of format {FORMAT!r}")
    missing = {"round", "server", "clients", "history", "counters", "config"} - set(payload)
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint (missing {sorted(missing)})")
    rnd = payload["round"]
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
        raise CheckpointError(f"{path}: invalid round {rnd!r}")
    for key in ("server", "server_opt"):
        named = payload.get(key, {})
        if not isinstance(named, dict) or not all(isinstance(v, torch.Tensor) for v in named.values()):
            raise CheckpointError(f"{path}: the {key.replace('_', ' ')} state must be named tensors")
        for name, v in named.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise CheckpointError(f"{path}: {key.replace('_', ' ')} state {name} holds NaN or Inf")
    named = payload.get("evaluation", {})
    if not isinstance(named, dict) or not all(isinstance(k, str) and k.count("/") == 2 and isinstance(v, torch.Tensor)
                                              and v.dim() == 1 for k, v in named.items()):
        raise CheckpointError(f"{path}: the stored evaluation must be named vectors ('group/split/metric')")
    named = payload.get("async", {})  # clients in flight: their losses and excluded updates may be NaN
    if not isinstance(named, dict) or not all(isinstance(v, torch.Tensor) for v in named.values()):
        raise CheckpointError(f"{path}: the asynchronous state must be named tensors")
    if not isinstance(payload["history"], list) or not isinstance(payload["counters"], dict):
        raise CheckpointError(f"{path}: malformed history or counters")
    clients = payload["clients"]
    if not isinstance(clients, dict) or clients.get("kind") not in ("memory", "mmap", "remote") or not all(
            isinstance(v, torch.Tensor) for k, v in clients.items() if k != "kind"):
        # (memory: the written rows; mmap: the store's files hold them; remote: Flower nodes keep them)
        raise CheckpointError(f"{path}: malformed client states (a dict of a store kind and tensors expected)")
    if not isinstance(payload["config"], dict):
        raise CheckpointError(f"{path}: malformed config")
    if not isinstance(payload.get("base_sha256", ""), str) or not isinstance(payload.get("data_sha256", ""), str):
        raise CheckpointError(f"{path}: malformed base or data digest")
    return payload


def evaluation_of(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The per-client evaluation stored with a checkpoint (``save``'s ``evaluation``) as ``Engine.evaluate`` gives
    it, or None where it holds none or the metrics of a split differ in length."""
    named = payload.get("evaluation")
    if not named:
        return None
    out: dict[str, Any] = {}
    for key, v in named.items():
        g, s, k = key.split("/")
        out.setdefault(g, {}).setdefault(s, {})[k] = v.numpy()
    if any(len({len(v) for v in m.values()}) != 1 for splits in out.values() for m in splits.values()):
        return None
    return out


def check_matches(payload: dict[str, Any], path: str | Path, config: dict[str, Any], rounds: int,
                  base: str | None = None, source: str | None = None, data: str | None = None) -> None:
    """Refuse a checkpoint written by another configuration, past this run's last round, or (``base``: this run's
    ``base_digest``) over other frozen base weights than this run's.  ``source``: the config file of the command,
    which the advice names where the run must start again (``rundir.resume_advice``)."""
    if payload["config"] != config:
        from .rundir import config_diff, resume_advice

        diff = config_diff(payload["config"], config)
        if diff:  # (tuples and lists compare equal there: a config read back from config.toml is the same)
            raise CheckpointError(f"{path}: the checkpoint was written with another configuration "
                                  f"({'; '.join(diff[:8])}{'; ...' if len(diff) > 8 else ''}); "
                                  f"{resume_advice(Path(path).parent, payload['config'], source)}")
    digests = (("base_sha256", base, "the adapters were trained on other base weights than this run's (base digest",
                "the file named by model.adapters.base (or the module given) has changed since; resume with the base "
                "it was trained on"),
               ("data_sha256", data, "the run was trained on other data than this config now builds (data digest",
                "the files its [data] reads (data.path, data.data_dir: relative paths are read from the current "
                "folder) differ; resume from the folder the run started in, with the data it was trained on"))
    for key, now, what, advice in digests:
        saved = payload.get(key)
        if now is not None and saved is not None and saved != now:
            raise CheckpointError(f"{path}: {what} {saved[:12]}... in the checkpoint, {now[:12]}... now): {advice}")
    if payload["round"] > rounds:
        raise CheckpointError(f"{path}: checkpoint of round {payload['round']} but the run has {rounds} rounds")
    if len(payload["history"]) != payload["round"] or not all(isinstance(r, dict) for r in payload["history"]):
        raise CheckpointError(f"{path}: the history does not match the checkpoint's round {payload['round']}")
