"""What ``Model`` (``models.base``) is built from and shares with the model builders: its error, the parameter splits
(body/head, FedBN's shared/local), a module's default head and dense layers, and the gradient of a loss written as a
function of the parameters (plain autograd outside torch.func transforms, ``torch.func.grad_and_value`` inside).

Nothing here knows ``Model``: ``models.base``, ``models.wrap`` and ``models.clientstack`` import it, so it imports
none of them (no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import batchnorm
from ..transforms import eager
from ..tree import Params


class ModelError(ValueError):
    """A model that cannot be used (wrong kind of object, or incompatible with the data)."""


def check_module(module: nn.Module, output: str, num_classes: int, initial_params: Params | None,
                 head: tuple[str, ...] | None) -> tuple[str, ...]:
    """Refuse (``ModelError``) a model description that cannot work: ``Model``'s fields ``module``, ``output``,
    ``num_classes``, ``initial_params`` and ``head`` as ``Model.__post_init__`` gets them.  Returns the parameter names
    of the module's ``fedmtl.BatchNorm`` layers (``Model.batch_norm``)."""
    if not isinstance(module, nn.Module):
        raise ModelError(f"Model.module must be a torch.nn.Module, got {type(module).__name__}")
    if output not in ("binary", "multiclass"):
        raise ModelError(f"Model.output must be 'binary' or 'multiclass', got {output!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ModelError(f"num_classes must be an int >= 2, got {num_classes!r}")
    if output == "binary" and num_classes != 2:
        raise ModelError(f"a binary model has 2 classes, got num_classes={num_classes}")
    if not any(True for _ in module.parameters()):
        raise ModelError(f"{type(module).__name__} has no parameters to train")
    torch_bn = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if torch_bn:
        raise ModelError(f"{type(module).__name__} uses torch.nn batch norm ({torch_bn[0]!r}), whose running "
                         "statistics are buffers updated in place (vmap refuses that, padding would enter the "
                         "batch statistics, and prediction would use batch statistics): use fedmtl.BatchNorm, a "
                         "drop-in replacement whose statistics are entries of the parameter tree")
    batch_norm = batchnorm.name_batchnorms(module)
    stray = [k for k, _ in module.named_parameters() if batchnorm.is_statistic(k) and k not in batch_norm]
    if stray:
        raise ModelError(f"parameters {stray} are named like batch-norm statistics ({batchnorm.STATISTICS}) but "
                         "are not a fedmtl.BatchNorm's; training would assign them: rename them")
    if initial_params is not None:
        shapes = {k: tuple(v.shape) for k, v in module.named_parameters()}
        if {k: tuple(v.shape) for k, v in initial_params.items()} != shapes:
            raise ModelError(f"Model.initial_params must hold the module's parameters {list(shapes)} with their "
                             "shapes")
    if head is not None:
        names = dict(module.named_parameters())
        unknown = [h for h in head if h not in names]
        if unknown:
            raise ModelError(f"Model.head names {unknown}, which are not parameters of "
                             f"{type(module).__name__} (its parameters: {list(names)})")
        if head and len(head) == len(names):
            raise ModelError(f"Model.head holds every parameter of {type(module).__name__}: a head needs a "
                             "body below it (use head=None for a model without a body/head split)")
    return batch_norm


def check_output(name: str, output: str, num_classes: int, out: Tensor, n: int) -> None:
    """Refuse (``ModelError``) the logits ``out`` of model ``name`` for ``n`` examples where their shape or dtype does
    not fit its ``output`` kind and ``num_classes`` (``Model.check_features``)."""
    want = (n,) if output == "binary" else (n, num_classes)
    if tuple(out.shape) != want:
        raise ModelError(f"model {name!r} returns shape {tuple(out.shape)} for {n} examples; a {output} model with "
                         f"{num_classes} classes must return "
                         f"{'(n, 1) or (n,)' if output == 'binary' else f'(n, {num_classes})'}")
    if not out.is_floating_point():
        raise ModelError(f"model {name!r} returns {out.dtype} logits; it must return floating point")


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters (or, without any, its buffers) are; the CPU for a module without tensors."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def fresh_params(module: nn.Module, seed: int, adapters: bool) -> Params:
    """Fresh parameters from ``module``'s own initializer (``reset_parameters``), seeded without touching global RNG,
    on the module's device.  They are drawn on the CPU whatever that device is, so a run starts from the same model
    on a GPU as on the CPU (CUDA's generator draws other numbers for the same seed).  ``adapters``: the module
    carries low-rank adapters, whose frozen base (buffers) keeps its weights: only modules that own parameters (the
    adapters, the trained modules) are drawn afresh."""
    dev = module_device(module)
    if dev.type != "cpu":
        module.cpu()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in module.modules():
                reset = getattr(m, "reset_parameters", None)
                if reset is not None and (not adapters or any(True for _ in m.parameters(False))):
                    reset()
            return {k: v.detach().clone().to(dev) for k, v in module.named_parameters()}
    finally:
        if dev.type != "cpu":
            module.to(dev)


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


class _Captured(Exception):
    """Stops a forward pass once the head's input is captured (``head_input``)."""


def head_input(module: nn.Module, head: nn.Module, params: Params, x: Tensor) -> Tensor:
    """The input of the sub-module ``head`` while ``module`` runs on ``x`` under ``params`` (the forward stops
    there): ``Model.features``' default representation."""
    captured: list[Tensor] = []

    def grab(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
        captured.append(args[0])
        raise _Captured

    handle = head.register_forward_pre_hook(grab)
    try:
        functional_call(module, params, (x,))
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured[0]


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


def value_and_grad_bn(loss_fn: Callable[..., Tensor], params: Params, x: Tensor, y: Tensor, mask: Tensor,
                      weight: Tensor | None) -> tuple[Params, Tensor]:
    """``Model.value_and_grad`` of a model with ``BatchNorm`` (``loss_fn``: its ``loss``): the loss in training mode
    (batch statistics of the real samples); the entries of the running statistics hold their updated values instead
    of a gradient, which ``local_sgd`` assigns (``fedmtl.batchnorm``)."""

    def loss_and_stats(p: Params) -> tuple[Tensor, dict[str, Tensor]]:
        with batchnorm.training(mask) as updates:
            loss = loss_fn(p, x, y, mask, weight)
        return loss, dict(updates)

    if eager():
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(not batchnorm.is_statistic(k)) for k, v in params.items()}
            loss, stats = loss_and_stats(leaves)
            learn = [k for k in leaves if not batchnorm.is_statistic(k)]
            grads = dict(zip(learn, torch.autograd.grad(loss, [leaves[k] for k in learn], allow_unused=True),
                             strict=True))
        out = {k: stats[k].detach() if k in stats else v if batchnorm.is_statistic(k)  # a layer not run: kept
               else torch.zeros_like(v) if grads[k] is None else grads[k].contiguous() for k, v in params.items()}
        return out, loss.detach()
    g, (loss, stats) = grad_and_value(loss_and_stats, has_aux=True)(params)
    out = {k: stats[k] if k in stats else v if batchnorm.is_statistic(k) else g[k] for k, v in params.items()}
    return out, loss


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


class _OpSizes(TorchDispatchMode):
    """Records, for every tensor operation run inside, the elements of its tensor inputs and outputs together."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's ``__torch_dispatch__`` in ``torch._dynamo.disable`` unless told otherwise, which imports
        # the whole compiler stack (1.5 s) at the first measurement of every process; this mode is never traced
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sizes.append(sum(t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, Tensor)))
        return out


def activation_elems(forward: Callable[[Tensor], Any], x: Tensor) -> int:
    """An estimate of the elements one example's forward pass holds at its peak: the largest number of elements that
    one tensor operation reads and writes (activations in and out: a layer's output, an attention score matrix), per
    example.  Measured once without gradients on one and on two of the examples ``x`` (n >= 2): the operations'
    sizes differ by one example's share, in which the parameters (the same for both) cancel.  Where the two passes
    run different operations, the two-example pass's largest operation counts whole (parameters included: a larger,
    still safe estimate).  Evaluation sizes its chunks of clients and examples with it (``engine.clients``)."""
    runs = []
    for n in (1, 2):
        with torch.no_grad(), _OpSizes() as rec:
            forward(x[:n])
        runs.append(rec.sizes)
    one, two = runs
    if len(one) != len(two) or not one:
        return max(two, default=1)
    return max(1, max(b - a for a, b in zip(one, two, strict=True)))
