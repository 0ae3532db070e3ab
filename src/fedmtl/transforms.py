"""The one module that asks torch's private functorch state which ``torch.func`` transforms are active.

The engine's fast paths depend on it: an eager step (no transform) may branch on values; under vmap alone a step
may update the tensors it allocated in place; under ``grad`` it must stay functional.  These probes use private
torch API (``torch._C._functorch``), so they live here only, each with a fallback that is always correct (the
functional path), and ``tests/test_transforms.py`` pins their answers on the installed torch version.
"""

from __future__ import annotations

import torch


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
