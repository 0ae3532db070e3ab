"""What ``Model`` (``models.base``) is built from and shares with the model builders: its error, the parameter splits
(body/head, FedBN's shared/local), a module's default head and dense layers, and the gradient of a loss written as a
function of the parameters (plain autograd outside torch.func transforms, ``torch.func.grad_and_value`` inside).

Nothing here knows ``Model``, so every module of the package may import it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from ..transforms import eager
from ..tree import Params


class ModelError(ValueError):
    """A model that cannot be used (wrong kind of object, or incompatible with the data)."""


def split_names(params: Params, names: tuple[str, ...]) -> tuple[Params, Params]:
    """(the entries not in ``names``, the entries in ``names``), both in ``params``' order (body/head, FedBN's
    shared/local split)."""
    chosen = set(names)
    return ({k: v for k, v in params.items() if k not in chosen}, {k: v for k, v in params.items() if k in chosen})


def default_head(module: nn.Module) -> tuple[str, ...] | None:
    """The parameters of the last sub-module (in registration order) that owns parameters, when other parameters
    lie below it; ``None`` for a one-layer module."""
    owners = [(name, m) for name, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if len(owners) < 2:
        return None
    name, last = owners[-1]
    return tuple(f"{name}.{p}" if name else p for p, _ in last.named_parameters(recurse=False))


def value_and_grad_of(fn: Callable[[Params], Tensor], params: Params) -> tuple[Params, Tensor]:
    """(gradient of the scalar ``fn(params)`` w.r.t. ``params``, its value) for a loss of an algorithm's own:
    plain autograd outside torch.func transforms (the loop runner), ``torch.func.grad_and_value`` inside (vmap)."""
    if eager():
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = fn(leaves)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        out = {k: torch.zeros_like(v) if g is None else g.contiguous() for (k, v), g in zip(params.items(), grads,
                                                                                          strict=True)}
        return out, loss.detach()
    return grad_and_value(fn)(params)


def dense_layers(module: nn.Module, binary: bool) -> tuple[list[tuple[str, str | None]], bool] | None:
    """The dense layers of a ReLU MLP written as an ``nn.Sequential`` (an optional leading ``nn.Flatten``, then
    ``nn.Linear`` layers separated by ``nn.ReLU``, ending with a ``nn.Linear``; ``nn.Identity`` and ``nn.Dropout(p=0)``
    anywhere): ((weight name, bias name) per layer, has the flatten), or None for any other module (which keeps the
    module's autograd path).  What the user's module computes is exactly ``models.stacked.mlp_forward``'s."""
    if not isinstance(module, nn.Sequential):
        return None
    items = [(name, m) for name, m in module.named_children()
             if not isinstance(m, nn.Identity) and not (isinstance(m, nn.Dropout) and m.p == 0)]
    flatten = bool(items) and isinstance(items[0][1], nn.Flatten)
    if flatten:
        fl = items[0][1]
        if isinstance(fl, nn.Flatten) and (fl.start_dim, fl.end_dim) != (1, -1):
            return None
        items = items[1:]
    layers: list[tuple[str, str | None]] = []
    for i, (name, m) in enumerate(items):
        want_linear = i % 2 == 0
        if want_linear and isinstance(m, nn.Linear):
            layers.append((f"{name}.weight", f"{name}.bias" if m.bias is not None else None))
        elif not want_linear and isinstance(m, nn.ReLU):
            continue
        else:
            return None
    if not layers or len(items) % 2 == 0:  # ends with a ReLU, or empty
        return None
    if binary and module.get_submodule(layers[-1][0].rsplit(".", 1)[0]).out_features != 1:
        return None
    return layers, flatten
