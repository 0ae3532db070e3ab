"""Weights read from a file a user or a node could have written, checked before a model uses them.

* ``read_safetensors(path, what)``: the tensors of a safetensors file (no pickle).  The file's kind and size are
  checked (``os.stat``) before it is opened, so a FIFO, a device, a directory or an oversized file is refused at
  once instead of hanging or exhausting memory; a file that is not safetensors is refused naming it.
* ``conform(t, like, where)``: ``t`` made fit to stand where the model keeps ``like``.  Its dtype must be of the
  same kind (floating point where the model's tensor is floating point; integer where it is integer by design, e.g.
  BatchNorm's ``num_batches_tracked``; bool for bool): an integer or bool tensor given for a weight is refused, never
  cast.  Its shape must be ``like``'s.  It is converted to ``like``'s dtype and *then* checked: every value finite
  (a float64 weight of 1e299 is finite but becomes Inf in float32), every integer unchanged by the conversion.
* ``check_floating(t, where)``: the check for a weight read with no model to compare it with (floating point, finite).

Errors are ``WeightsError`` (a ``ValueError``: the command line reports it in one line, exit code 2) unless the
caller passes its own class; each names the file and the tensor, and values quoted in them are cut short
(``brief``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .files import check_file

__all__ = ["WeightsError", "brief", "check_floating", "conform", "read_safetensors"]


class WeightsError(ValueError):
    """Weights that cannot be used: an unreadable file, or a tensor of the wrong kind, shape or values."""


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (the cut marked with "...")."""
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_safetensors(path: str | Path, what: str, error: type[Exception] = WeightsError,
                     limit: int | None = None) -> dict[str, Tensor]:
    """The tensors of the safetensors file ``path`` (on the CPU, in their stored dtypes).  ``what`` names the file's
    role in errors (e.g. ``"model.weights"``); ``limit``: its largest size in bytes (default: the machine's RAM)."""
    from safetensors import safe_open

    from .machine import physical_memory

    path = Path(path)
    try:
        check_file(path, physical_memory() if limit is None else limit, f"{what} (safetensors)", error)
    except FileNotFoundError:
        raise error(f"{what}: {path}: no such file") from None
    except OSError as e:
        raise error(f"{what}: {path}: cannot be read ({e.strerror or e})") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as e:  # a corrupt or foreign file: safetensors' own errors are of several types
        raise error(f"{what}: {path}: not a readable safetensors file ({brief(str(e))})") from None


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


def conform(t: Tensor, like: Tensor, where: str, error: type[Exception] = WeightsError) -> Tensor:
    """``t`` converted to ``like``'s dtype, after checking that its dtype is of ``like``'s kind and its shape is
    ``like``'s, and checked again after the conversion (finite values; integers unchanged).  ``where`` (the file
    and the tensor's name) starts every error."""
    want, got = _kind(like.dtype), _kind(t.dtype)
    if got != want:
        why = "; integer and bool tensors are never cast to weights" if want == "floating point" else ""
        raise error(f"{where}: dtype {t.dtype}, expected {want} (the model keeps {like.dtype}){why}")
    if tuple(t.shape) != tuple(like.shape):
        raise error(f"{where}: shape {brief(tuple(t.shape))}, expected {brief(tuple(like.shape))}")
    out = t.to(like.dtype)
    if want == "floating point":
        finite = torch.isfinite(out)
        if not bool(finite.all()):
            n = int((~finite).sum())
            if bool(torch.isfinite(t).all()):
                raise error(f"{where}: {n} value(s) beyond the range of {like.dtype} (Inf once converted from "
                            f"{t.dtype}, e.g. {brief(float(t[~finite][0]))})")
            raise error(f"{where}: holds NaN or Inf ({n} value(s))")
    elif want == "integer" and not bool((out.to(t.dtype) == t).all()):
        raise error(f"{where}: values out of the range of {like.dtype} (stored as {t.dtype})")
    return out


def check_floating(t: Tensor, where: str, error: type[Exception] = WeightsError) -> Tensor:
    """``t`` itself if it is a floating-point tensor of finite values (a weight read without a model to compare it
    with); else ``error`` naming ``where``."""
    if not t.dtype.is_floating_point:
        raise error(f"{where}: dtype {t.dtype}, expected floating point")
    if not bool(torch.isfinite(t).all()):
        raise error(f"{where}: holds NaN or Inf ({int((~torch.isfinite(t)).sum())} value(s))")
    return t
