"""What the adapter methods share: a model's low-rank adapters split into their A and B matrices
(``fedmtl.models.lora``), and the refusal of a model without adapters."""

from __future__ import annotations

from ..models.base import Model, ModelError
from ..models.lora import adapter_names
from ..models.parts import split_names
from ..tree import Params


def check_adapters(model: Model, method: str) -> None:
    """``method`` trains low-rank adapters: a model without them is refused before any work."""
    if model.adapters is None:
        raise ModelError(f"{method} trains low-rank adapters, and model {model.name!r} has none: add a "
                         "[model.adapters] table (rank, alpha, target) or build it with Model.from_module(module, "
                         "num_classes, adapters=...)")


def split_b(model: Model, params: Params, method: str) -> tuple[Params, Params]:
    """(everything but the adapters' B matrices, the B matrices) of ``params``, each in the model's order."""
    check_adapters(model, method)
    return split_names(params, adapter_names(model.module)[1])


def split_a(model: Model, params: Params, method: str) -> tuple[Params, Params]:
    """(everything but the adapters' A matrices, the A matrices) of ``params``, each in the model's order."""
    check_adapters(model, method)
    return split_names(params, adapter_names(model.module)[0])


__all__ = ["check_adapters", "split_a", "split_b"]
