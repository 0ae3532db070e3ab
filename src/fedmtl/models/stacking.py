"""A ``Model`` run on stacked parameter sets: M models on one batch (FedEM's components, IFCA's clusters:
``apply_stacked``, ``value_and_grad_stacked``), and K clients' models on their own batches side by side (the
``stacked`` executor: ``clients_logits``, ``value_and_grad_clients``, K x M components in
``value_and_grad_clients_stacked``), with what decides and prepares that path: whether a model has a clients form
(``supports_clients``), its check on the data (``verify_clients``) and the compiled step (``compiled``).

Each path takes the model's stacked closed form where it has one (``linear``, ``mlp``, a ReLU MLP given as a
``nn.Sequential``: batched products and a hand-written backward, ``models.stacked``) and otherwise its clients form
(``models.clientstack``: the module's twin, gradients by autograd through it) or, for M models, vmap (or a loop
outside transforms) over ``Model.value_and_grad``.  The closed form's parts for K clients are ``Model`` fields:
``clients_step`` ``(params (K, ...), x (K, n, ...), y, mask (K, n), step) -> (K,) losses``, one SGD step
(``models.stacked.Step``) applied in place with the gradient fused into the update; ``components_grad``
``(params (K, M, ...), x (K, n, ...), y, mask (K, n), weight (K, M, n)) -> (grads, (K, M) losses)``, the gradient of
M components of each of K clients (``models.stacked.mlp_components``); ``components_step``
``(params (K, M, ...), x, y, mask, weight, step) -> (K, M) losses``, that gradient's SGD step fused
(``optim.local_sgd_clients`` runs them).

Why a module of its own: it reads a ``Model`` (``models.base``), while ``models.base`` imports ``models.clientstack``
(``from_module`` builds the clients form, ``check_features`` checks it), so neither of those can hold it without an
import cycle; and it sits in ``models``, below ``optim`` and the algorithms that call it (``optim.local_sgd_clients``,
FedEM's ``client_update_clients``), not in ``engine``, which imports them.  What it makes per model (the compiled
steps) it keeps in the model's ``cache``, so a model and its compiled copy (``compiled``) never share one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap

from .. import batchnorm
from ..transforms import eager
from ..tree import Params
from . import replay
from .base import Model
from .clientstack import clients_value_and_grad
from .parts import ModelError
from .replay import StepGraphs

log = logging.getLogger("fedmtl")


# -- M models on one batch ---------------------------------------------------------------------------------------
def apply_stacked(model: Model, params: Params, x: Tensor) -> Tensor:
    """Forward pass of M stacked models (params with a leading M axis) on the same x: (M, n, ...)."""
    if model.stacks and model.forward is not None:
        if model.input_transform is not None:
            x = model.input_transform(x)
        return model.forward(params, x)
    if eager():  # the loop runner: one module call per model (a vmapped convolution is several times slower)
        m = next(iter(params.values())).shape[0]
        return torch.stack([model.apply({k: v[i] for k, v in params.items()}, x) for i in range(m)])
    return vmap(model.apply, in_dims=(0, None))(params, x)


def value_and_grad_stacked(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                           weight: Tensor | None = None) -> tuple[Params, Tensor]:
    """``Model.value_and_grad`` of M stacked models on the same batch; ``weight`` (M, n); loss (M,).

    Models that ``stack`` (linear, mlp) compute all M components with one matrix product per layer (a nested
    vmap over clients and components batches matmuls badly on CPU: ~15x slower here).
    """
    if model.stacks and model.analytic_grad is not None:
        if model.input_transform is not None:
            x = model.input_transform(x)
        return model.analytic_grad(params, x, y, mask, weight)
    if eager():  # the loop runner: one autograd pass per model (a vmapped convolution is several times slower)
        m = next(iter(params.values())).shape[0]
        outs = [model.value_and_grad({k: v[i] for k, v in params.items()}, x, y, mask,
                                     None if weight is None else weight[i]) for i in range(m)]
        return ({k: torch.stack([g[k] for g, _ in outs]) for k in params}, torch.stack([loss for _, loss in outs]))
    return vmap(model.value_and_grad, in_dims=(0, None, None, None, 0 if weight is not None else None))(
        params, x, y, mask, weight
    )


def stacked_grad(model: Model) -> Callable[..., tuple[Params, Tensor]]:
    """``value_and_grad_stacked`` of ``model`` as a ``grad_fn`` for ``optim.local_sgd`` (M components at once)."""
    return partial(value_and_grad_stacked, model)


# -- the clients form: K clients on their own batches (the stacked executor) ---------------------------------------
def closed_form_clients(model: Model) -> bool:
    """Whether the model's clients form is the stacked closed form (``linear``, ``mlp``, converted dense
    ``nn.Sequential`` modules): batched products and a hand-written backward."""
    return model.stacks and model.analytic_grad is not None


def supports_clients(model: Model) -> bool:
    """Whether ``value_and_grad_clients`` exists: the stacked closed form, or a clients form not refused by its
    check on the data (``verify_clients``).  Batch norm (``fedmtl.BatchNorm``) has a clients form
    (``models.clientstack.StackedBatchNorm``), never a closed form."""
    return closed_form_clients(model) or (model.clients_form is not None and model.clients_form.usable is not False)


def clients_paths(model: Model) -> dict[str, str]:
    """How the clients form computes each module with parameters: ``"stacked"``, ``"vmap"`` or ``"loop"``
    (``{"": "closed form"}`` for the closed form; empty without a clients form)."""
    if closed_form_clients(model):
        return {"": "closed form"}
    return dict(model.clients_form.layers) if model.clients_form is not None else {}


def verify_clients(model: Model, x: Tensor) -> bool:
    """Check the clients form on examples ``x`` (n >= 3, already through ``input_transform``): three clients' models
    (weights drawn around the initial ones) on their own examples, outputs and gradients of the form against the
    module applied to each, to 1e-4 of their scale (``ClientsForm.check``, which ``Model.check_features`` runs on
    the data's first examples).  A form that does not reproduce the module is not used (``supports_clients`` turns
    False; the reason is logged and kept in ``clients_form.reason``).  True for the closed form, which is exact by
    construction (tested)."""
    form = model.clients_form
    if form is None:
        return closed_form_clients(model)
    if form.usable is not None:
        return form.usable
    return form.check(x, model.module, model.init(0), model.num_classes, model.output == "binary", model.nll)


def clients_logits(model: Model, params: Params, x: Tensor) -> Tensor:
    """Outputs of K clients' models (params (K, ...)) on their own batches x (K, B, ...) already through
    ``input_transform``: (K, B) for a binary model, (K, B, C) otherwise."""
    if closed_form_clients(model):
        assert model.forward is not None
        return model.forward(params, x)
    if model.clients_form is None:
        raise ModelError(f"model {model.name!r} has no clients form")
    return model.clients_form.logits(params, x, model.output == "binary")


def clients_components_logits(model: Model, components: Params, x: Tensor) -> Tensor:
    """M components (params (M, ...), shared by the clients) on K clients' examples x (N0, ...) already through
    ``input_transform``: (M, N0) for a binary model, (M, N0, C) otherwise (FedEM's E-step on the stacked
    executor): all clients' examples as one batch (the closed form: one product per layer for the M
    components; else the clients form with the components as its clients)."""
    if closed_form_clients(model):
        assert model.forward is not None
        return model.forward(components, x)
    m = next(iter(components.values())).shape[0]
    return clients_logits(model, components, x.unsqueeze(0).expand(m, *x.shape))


def value_and_grad_clients(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                           weight: Tensor | None = None) -> tuple[Params, Tensor]:
    """``Model.value_and_grad`` of K clients' models (params (K, ...)) on their own batches x (K, B, ...) already
    through ``input_transform``, y and mask (K, B): (K stacked gradients, (K,) losses), each client's loss the
    mean over its own real samples (the ``stacked`` executor), weighted by ``weight`` (K, B) where given (as
    ``Model.loss``).  The closed form where the model has one, else autograd through the clients form: the sum
    of the clients' losses, whose gradient with respect to client k's parameters is exactly k's own."""
    if not supports_clients(model):
        raise ModelError(f"model {model.name!r} has no clients form (the stacked executor needs a closed-form "
                         "stacked gradient or a verified clients form)")
    if closed_form_clients(model):
        assert model.analytic_grad is not None
        return compiled_step(model, "closed_form", model.analytic_grad, x.device)(params, x, y, mask, weight)
    if model.batch_norm:
        return _value_and_grad_clients_bn(model, params, x, y, mask, weight)
    return clients_value_and_grad(compiled_step(model, "clients_form", partial(_clients_losses, model), x.device),
                                  params, x, y, mask, weight)


def _value_and_grad_clients_bn(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                               weight: Tensor | None) -> tuple[Params, Tensor]:
    """``value_and_grad_clients`` of a model with batch norm, as ``Model.value_and_grad`` (``models.parts.
    value_and_grad_bn``) for each client: the losses in training mode (each client's batch statistics of its real
    samples, ``models.clientstack.StackedBatchNorm``), and the entries of the running statistics holding each
    client's updated values instead of a gradient (a layer that did not run keeps them).  Not compiled
    (``run.compile``): the statistics leave the step as a side output."""
    stats: dict[str, Tensor] = {}

    def losses(p: Params, *args: Any) -> Tensor:
        with batchnorm.training(mask) as updates:
            out = _clients_losses(model, p, *args)
        stats.update(updates)
        return out

    g, loss = clients_value_and_grad(losses, params, x, y, mask, weight)
    return {k: stats[k].detach() if k in stats else params[k] if batchnorm.is_statistic(k) else v
            for k, v in g.items()}, loss


def value_and_grad_clients_stacked(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                                   weight: Tensor | None = None) -> tuple[Params, Tensor]:
    """``value_and_grad_stacked`` of K clients: M components per client (params (K, M, ...)) on the client's own
    batch x (K, B, ...) already through ``input_transform``, y and mask (K, B), per-sample weights (K, M, B):
    (grads (K, M, ...), (K, M) losses).  The closed form where the model has one (``components_grad``), else
    the clients form over the K x M models, each client's batch read by its M components."""
    if not supports_clients(model):
        raise ModelError(f"model {model.name!r} has no clients form")
    k, m = next(iter(params.values())).shape[:2]
    if closed_form_clients(model) and model.components_grad is not None:
        return compiled_step(model, "components", model.components_grad, x.device)(params, x, y, mask, weight)

    def rep(t: Tensor) -> Tensor:  # each client's rows once per component
        return t.unsqueeze(1).expand(k, m, *t.shape[1:]).reshape(k * m, *t.shape[1:])

    flat = {n: v.reshape(k * m, *v.shape[2:]) for n, v in params.items()}
    w = None if weight is None else weight.reshape(k * m, *weight.shape[2:])
    g, loss = value_and_grad_clients(model, flat, rep(x), rep(y), rep(mask), w)
    return {n: v.reshape(params[n].shape) for n, v in g.items()}, loss.reshape(k, m)


def _clients_losses(model: Model, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
                    ) -> Tensor:
    """(K,) each client's mean loss over its own real samples (``weight``-ed), through the clients form."""
    m = mask.to(torch.float32)
    w = m if weight is None else m * weight
    nll = model.nll(clients_logits(model, params, x), y)  # (K, B)
    return (nll * w).sum(-1) / m.sum(-1).clamp_min(1.0)


# -- compilation ---------------------------------------------------------------------------------------------------
def compiled(model: Model, setting: bool | str = True, device: torch.device | str = "cpu") -> Model:
    """``model`` with its clients' step made as ``run.compile`` says for ``device``: ``true``, compiled by
    ``torch.compile`` (the closed form's gradient, or the clients form's loss, its backward compiled with it; on a
    GPU in the ``reduce-overhead`` mode); where compiling fails (no compiler) the step runs eagerly, with one
    warning.  ``"auto"``: on a GPU, each local step recorded once as a CUDA graph and replayed (``models.replay``),
    eager on the CPU.  ``false``: eager.  A copy (with an empty ``cache``) where the setting changes."""
    on = setting is True
    graphs = setting == "auto" and torch.device(device).type == "cuda"
    if model.compile_clients == on and model.replay_steps == graphs:
        return model
    return dataclasses.replace(model, compile_clients=on, replay_steps=graphs)


def step_graphs(model: Model, device: torch.device, signature: Hashable) -> StepGraphs | None:
    """The recorded local steps of ``signature`` (``models.replay.StepGraphs``, kept in the model's ``cache``) where
    the model replays its steps on ``device`` (``compiled``) and no ``torch.func`` transform is active (the held
    tensors are plain tensors), else ``None``."""
    if not (model.replay_steps or replay.EMULATE) or not replay.replays(device) or not eager():
        return None
    return replay.step_graphs(model.cache, signature, device)


def compiled_step(model: Model, name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn``, or where the model compiles its clients' step (``compiled``) the ``Compiled`` form of it, made once
    per model and kept in its ``cache`` under ``name``."""
    if not model.compile_clients:
        return fn
    c = model.cache.get(name)
    if c is None:
        c = model.cache[name] = Compiled(fn, "reduce-overhead" if device.type == "cuda" else "default")
    return c


class Compiled:
    """``fn`` compiled by ``torch.compile`` (``mode``), or ``fn`` itself where compiling fails: the first calls fall
    back to ``fn`` on any error of the compiler (one warning), and once a compiled call succeeded its errors are
    the function's own."""

    def __init__(self, fn: Callable[..., Any], mode: str):
        self.fn, self.mode = fn, mode
        self.compiled: Callable[..., Any] | None = None
        self.failed, self.ran = False, False

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return self.fn(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, mode=self.mode)
            out = self.compiled(*args)
        except Exception as e:
            if self.ran:
                raise
            self.failed = True
            log.warning("run.compile: torch.compile failed (%s: %s); the step runs eagerly", type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return self.fn(*args)
        self.ran = True
        return out
