"""The one module that asks torch's private functorch state which ``torch.func`` transforms are active.

The engine's fast paths depend on it: an eager step (no transform) may branch on values; under vmap alone a step
may update the tensors it allocated in place; under ``grad`` it must stay functional.  These probes use private
torch API (``torch._C._functorch``), so they live here only, each with a fallback that is always correct (the
functional path), and ``tests/test_transforms.py`` pins their answers on the installed torch version.
"""

from __future__ import annotations

import torch
from torch import Tensor


def eager() -> bool:
    """True when no torch.func transform (vmap, grad, jvp) is active."""
    try:
        return torch._C._functorch.peek_interpreter_stack() is None
    except AttributeError:  # another torch: assume a transform, the functional paths are always correct
        return False


def only_vmap() -> bool:
    """True when every active torch.func transform is a vmap (or none is): then a step may update the tensors it
    allocated itself in place.  Under ``grad``/``jvp`` (an algorithm differentiating through its local steps)
    in-place updates would corrupt the derivative, so the steps stay functional there."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        return all(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())
    except (ImportError, AttributeError):  # another torch: the functional steps
        return False


def unbatched(t: Tensor | None) -> Tensor | None:
    """The stacked tensor under one level of vmap that ``t`` (a per-client view inside the vmapped function) is a
    slice of; None when ``t`` is not batched (or this torch cannot say)."""
    if t is None:
        return None
    try:
        f = torch._C._functorch
        return f.get_unwrapped(t) if f.is_batchedtensor(t) else None
    except AttributeError:
        return None
