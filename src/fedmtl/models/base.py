"""Models as a module skeleton plus a loss; parameters always travel as ``Params``.

``Model.apply(params, x)`` is a pure function (``torch.func.functional_call``) that works under
``torch.func.vmap``.  Two output kinds are supported:

* ``"binary"``: one logit per sample, logistic (BCE) loss, class probabilities ``[1 - s, s]`` with
  ``s = sigmoid(logit)`` (the FedEM reference code's linear model on the synthetic data);
* ``"multiclass"``: C logits, softmax cross-entropy.

``nll(out, y)`` returns the per-sample negative log-likelihood (the loss that FedEM's E-step uses),
``log_proba(out)`` the (n, C) log class probabilities (FedEM mixes probabilities, never logits).

How a model runs on stacked parameters (M models on one batch; K clients: the stacked executor) is
``models.stacking``'s; its input transforms are ``models.inputs``', ``from_module``'s conversions ``models.wrap``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from ..transforms import eager
from ..tree import Params
from . import wrap
from .parts import (
    ModelError,
    activation_elems,
    check_module,
    check_output,
    fresh_params,
    head_input,
    module_device,
    split_names,
    value_and_grad_bn,
    value_and_grad_of,
)

if TYPE_CHECKING:
    from .clientstack import ClientsForm
    from .lora import AdapterConfig


@dataclass(frozen=True)
class Model:
    """A parameter-free description of a network: a module skeleton and its output kind."""

    module: nn.Module
    output: str  # "binary" | "multiclass"
    num_classes: int
    input_transform: Callable[[Tensor], Tensor] | None = field(default=None, compare=False)
    name: str = "model"
    #: optional closed-form ``(params, x, y, mask, weight) -> (grads, loss)``; must equal autograd's
    analytic_grad: Callable[..., tuple[Params, Tensor]] | None = field(default=None, compare=False)
    #: ``forward`` and ``analytic_grad`` also take M stacked parameter sets (a leading axis on every tensor) on the same
    #: x, returning (M, n, ...) logits and (M,) losses: FedEM's components in one product (``linear``, ``mlp``)
    stacks: bool = False
    #: optional pure forward ``(params, x) -> out`` used instead of ``functional_call`` (e.g. an LSTM
    #: written with batched matmuls, which vmap batches well where ``nn.LSTM`` does not)
    forward: Callable[[Params, Tensor], Tensor] | None = field(default=None, compare=False)
    #: compute-bound on CPU (large convolutions): the ``auto`` runner loops over clients on CPU
    prefer_loop_on_cpu: bool = False
    #: the same on a GPU: the ``auto`` runner loops over clients there too (a recurrent net, whose vmapped
    #: recurrence dispatches thousands of small batched operations per step where cuDNN runs one fused kernel)
    prefer_loop_on_cuda: bool = False
    #: outside torch.func transforms on CPU, run the module's convolutions in the channels-last memory format (inputs
    #: and 4-d weights re-laid out per call; gradients come back in the parameters' own layout): PyTorch's CPU pooling
    #: and convolutions are much faster so (a FEMNIST CNN step: ~25% on one thread), equal up to rounding (tested)
    channels_last: bool = False
    #: outside torch.func transforms, run the module itself (e.g. nn.LSTM's fused CPU kernel), not ``forward`` (equal)
    module_when_eager: bool = False
    #: the features are integer token ids (an embedding's input): float features are refused, not truncated
    token_input: bool = False
    #: the names of the parameters that form the *head* (the last layer(s) mapping the representation to the
    #: logits); the rest is the *body*.  Body/head methods (FedPer, FedRep, LG-FedAvg, FedBABU, FedRoD, kNN-Per,
    #: MOON, Omni-Fedge) read it; ``None``: the model has no such split (a single layer), and those methods refuse it
    head: tuple[str, ...] | None = None
    #: optional pure ``(params, x) -> (n, d)`` representation (the head's input); default: captured as the module runs
    embed: Callable[[Params, Tensor], Tensor] | None = field(default=None, compare=False)
    #: the parameter names of the model's ``fedmtl.BatchNorm`` layers (affine weights and running statistics), found
    #: from the module; empty for a model without batch norm.  FedBN keeps them per client
    batch_norm: tuple[str, ...] = field(init=False, default=(), compare=False)
    #: the stacked executor's closed forms (``models.stacking``): K clients' fused SGD step (``models.stacked.Step``),
    #: the gradient of M components per client and its fused step
    clients_step: Callable[..., Tensor] | None = field(default=None, compare=False)
    components_grad: Callable[..., tuple[Params, Tensor]] | None = field(default=None, compare=False)
    components_step: Callable[..., Tensor] | None = field(default=None, compare=False)
    #: where a run starts: ``None``, fresh weights from the module's initializer seeded by the run (``init``); or
    #: these weights (``from_module(..., init="module")``: the module's own, e.g. pretrained).  Further independent
    #: models a method keeps (FedEM's other components, IFCA's other clusters) are still drawn from the initializer
    initial_params: Params | None = field(default=None, compare=False, repr=False)
    #: the module's clients form (``models.clientstack``: a twin running K clients' stacked parameters at once), checked
    #: on the data before use (``check_features``); ``None`` for a model without one
    clients_form: ClientsForm | None = field(default=None, compare=False, repr=False)
    #: the low-rank adapters the module carries (``fedmtl.models.lora``): its parameters are the adapters (and the
    #: ``train`` modules), the frozen base is buffers; ``None`` for a model trained in full
    adapters: AdapterConfig | None = field(default=None, compare=False)
    #: compile the clients' step (``run.compile``: ``models.stacking.compiled``), which keeps it in ``cache`` (per
    #: model instance: a copy starts with an empty one)
    compile_clients: bool = field(default=False, compare=False)
    #: replay the stacked executor's local steps as CUDA graphs (``run.compile = "auto"`` on a GPU:
    #: ``models.replay``), which keeps them in ``cache``
    replay_steps: bool = field(default=False, compare=False)
    cache: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_norm", check_module(self.module, self.output, self.num_classes,
                                                            self.initial_params, self.head))

    # -- body / head -----------------------------------------------------------------------------
    def head_names(self, method: str) -> tuple[str, ...]:
        """The head's parameter names, or a clear error naming ``method`` where the model declares no split."""
        if self.head is None:
            raise ModelError(f"{method} splits the model into a shared body and a head, but model {self.name!r} "
                             "declares no body/head split (a one-layer model such as 'linear' has no body): use "
                             "'mlp', a CNN or the LSTM, or give Model.from_module(..., head=[...])")
        return self.head

    def split(self, params: Params, method: str = "this method") -> tuple[Params, Params]:
        """(body, head) of ``params`` (``head_names``), both in the model's parameter order."""
        return split_names(params, self.head_names(method))

    def head_module(self) -> nn.Module:
        """The sub-module that owns the head's parameters (its input is the representation)."""
        names = self.head_names("the representation")
        prefix = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        return self.module.get_submodule(prefix)

    def apply_head(self, params: Params, z: Tensor) -> Tensor:
        """Logits of representations ``z`` (``features``) under the head entries of ``params`` (the full parameters or
        only a head's): ``apply_head(p, features(p, x)) == apply(p, x)`` (tested), one forward pass for methods that
        need both the representation and the logits."""
        names = self.head_names("the head")
        prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        out = functional_call(self.head_module(), {k[len(prefix):]: params[k] for k in names}, (z,))
        if self.output == "binary" and out.dim() > 1 and out.shape[-1] == 1:
            return out.reshape(out.shape[:-1])
        return out

    def features(self, params: Params, x: Tensor) -> Tensor:
        """(n, d) representation of ``x``: the input of the head (``embed`` where the model gives one)."""
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.embed is not None:
            return self.embed(params, x)
        return head_input(self.module, self.head_module(), params, x).flatten(1)

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        num_classes: int,
        output: Literal["multiclass", "binary"] | None = None,
        input_transform: Callable[[Tensor], Tensor] | None = None,
        name: str | None = None,
        prefer_loop_on_cpu: bool | None = None,
        head: list[str] | tuple[str, ...] | None | Literal["auto"] = "auto",
        channels_last: bool | None = None,
        init: Literal["seeded", "module"] = "seeded",
        adapters: Any = None,
    ) -> Model:
        """Wrap any ``nn.Module`` mapping a batch of features (n, *feature_shape) to logits, converted for the
        ``stacked`` executor (a ReLU MLP to the stacked closed form, any other module to its clients form).
        ``output``: ``"multiclass"`` or ``"binary"`` (left out: binary exactly when ``num_classes == 2`` and the last
        ``nn.Linear`` has one output); ``input_transform`` runs on every batch first; ``init``: ``"seeded"`` (the
        module's initializer, seeded by the run) or ``"module"`` (its current weights); ``head``: the body/head split
        (``"auto"``: the last sub-module with parameters); ``adapters``: low-rank adapters (``fedmtl.models.lora``);
        ``prefer_loop_on_cpu``, ``channels_last``: the CPU path (None: by the layers).  In full:
        ``fedmtl.models.wrap.from_module``."""
        return wrap.from_module(cls, module, num_classes, output, input_transform, name, prefer_loop_on_cpu, head,
                                channels_last, init, adapters)

    def check_features(self, x: Tensor) -> None:
        """Run the model on a few examples ``x`` (n, *features) of the data and check the output shape; a
        model that does not fit the data fails here with a clear message, before any training.  With 3 examples or
        more, a clients form is checked on them too (``ClientsForm.check``: ``models.stacking.verify_clients``)."""
        if self.token_input and (x.is_floating_point() or x.is_complex()):
            raise ModelError(f"model {self.name!r} reads integer token ids, but the data's features are {x.dtype} "
                             f"(shape {tuple(x.shape[1:])}); use a model for real-valued features (linear, mlp, cnn)")
        params = self.init(0)
        x = x.to(self.device)  # the module may already sit on a run's device (an engine moves it there)
        try:
            with torch.no_grad():
                out = self.apply(params, x)
        except Exception as e:  # any failure of a user's module on the data is reported as one error
            raise ModelError(f"model {self.name!r} cannot run on the data's features (shape {tuple(x.shape[1:])}, "
                             f"dtype {x.dtype}): {type(e).__name__}: {e}") from e
        check_output(self.name, self.output, self.num_classes, out, x.shape[0])
        if self.clients_form is not None and x.shape[0] >= 3:  # the clients form checked on the same examples
            self.clients_form.check(self.input_transform(x) if self.input_transform is not None else x, self.module,
                                    params, self.num_classes, self.output == "binary", self.nll)

    def activation_elems(self, x: Tensor) -> int:
        """Elements one example's prediction holds at its peak (``models.parts.activation_elems``: the largest
        operation's inputs and outputs per example), measured once per feature shape and dtype on two examples ``x``
        (n >= 2, as the data holds them) with the module's own weights, and kept in ``cache``.  Evaluation chunks its
        clients by it (``run.eval_chunk_elems``)."""
        key = f"activation_elems {tuple(x.shape[1:])} {x.dtype}"
        if key not in self.cache:
            params: Params = dict(self.module.named_parameters())
            self.cache[key] = activation_elems(lambda xb: self.apply(params, xb), x[:2].to(self.device))
        return int(self.cache[key])

    def init(self, seed: int) -> Params:
        """Fresh parameters from the module's own initializer, seeded without touching global RNG, on the module's
        device (``models.parts.fresh_params``: drawn on the CPU, so a run starts from the same model on a GPU)."""
        return fresh_params(self.module, seed, self.adapters is not None)

    def start(self, seed: int) -> Params:
        """The run's initial model: ``initial_params`` (copies, on the module's device) if set, else ``init(seed)``."""
        if self.initial_params is None:
            return self.init(seed)
        dev = self.device
        return {k: v.clone().to(dev) for k, v in self.initial_params.items()}

    @property
    def device(self) -> torch.device:
        """Where the module's parameters (or, without any, its buffers) are: the CPU, or a run's device."""
        return module_device(self.module)

    def apply(self, params: Params, x: Tensor) -> Tensor:
        """Forward pass: (n, *features) -> (n,) logits (binary) or (n, C) logits."""
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.forward is not None and not (self.module_when_eager and eager()):
            out = self.forward(params, x)
        elif x.dim() == 4 and self.runs_channels_last(x.device) and eager():
            # clone, not contiguous(): a 1-channel tensor already counts as channels-last without its strides
            cl = torch.channels_last
            params = {k: v.clone(memory_format=cl) if v.dim() == 4 else v for k, v in params.items()}
            out = functional_call(self.module, params, (x.clone(memory_format=cl),))
        else:
            out = functional_call(self.module, params, (x,))
        if self.output == "binary" and out.dim() > 1 and out.shape[-1] == 1:
            return out.reshape(out.shape[:-1])
        return out

    def runs_channels_last(self, device: torch.device) -> bool:
        """Whether the module runs channels-last on ``device`` outside transforms (``channels_last``: CPU only)."""
        return self.channels_last and device.type == "cpu"

    def nll(self, out: Tensor, y: Tensor) -> Tensor:
        """Per-sample negative log-likelihood, shape out.shape[:-1] (multiclass) or out.shape (binary); ``out`` may
        carry leading axes (e.g. M components) that ``y`` (n,) broadcasts against."""
        if self.output == "binary":
            # log(1 + e^z) - y z  ==  BCE-with-logits, numerically stable
            return F.softplus(out) - y.to(out.dtype) * out
        logp = F.log_softmax(out, dim=-1)
        idx = y.long().expand(out.shape[:-1]).unsqueeze(-1)
        return -torch.gather(logp, -1, idx).squeeze(-1)

    def log_proba(self, out: Tensor) -> Tensor:
        """(n, C) log class probabilities."""
        if self.output == "binary":
            return torch.stack([F.logsigmoid(-out), F.logsigmoid(out)], dim=-1)
        return F.log_softmax(out, dim=-1)

    def loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
        """Batch mean of ``weight * nll`` over the real samples (``mask`` = 1; padding = 0), divided by their number
        as a DataLoader batch mean would: with ``weight`` = FedEM responsibilities the reference q-weighted loss
        ``sum(q * l) / batch_size``."""
        return self.masked_mean(self.nll(self.apply(params, x), y), mask, weight)

    @staticmethod
    def masked_mean(nll: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
        """``loss``'s reduction of per-sample values ``nll`` (..., n): the sum of ``weight * nll`` over the real
        samples divided by their number, per leading entry (one loss per stacked model for (M, n))."""
        m = mask.to(nll.dtype)
        w = m if weight is None else m * weight
        return (nll * w).sum(-1) / m.sum().clamp_min(1.0)

    def value_and_grad(self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
                       ) -> tuple[Params, Tensor]:
        """(gradient of ``loss`` w.r.t. params, loss); closed form where the model has one."""
        if self.analytic_grad is not None:
            if self.input_transform is not None:
                x = self.input_transform(x)
            return self.analytic_grad(params, x, y, mask, weight)
        if self.batch_norm:
            return value_and_grad_bn(self.loss, params, x, y, mask, weight)
        if eager():  # plain autograd: torch.func.grad's per-op overhead is 5x here for recurrent nets
            return value_and_grad_of(lambda p: self.loss(p, x, y, mask, weight), params)
        return grad_and_value(self.loss)(params, x, y, mask, weight)

    @property
    def path(self) -> str:
        """How the model computes: ``"closed form"`` (stacked products and a hand-written backward: ``linear``,
        ``mlp``, and ReLU MLPs given as a ``nn.Sequential``), ``"forward"`` (its own pure forward under autograd),
        or ``"module"`` (``torch.func.functional_call`` of the module under autograd).  On the stacked executor a
        model without the closed form runs its clients form instead (``models.stacking.clients_paths``)."""
        if self.analytic_grad is not None:
            return "closed form"
        return "forward" if self.forward is not None else "module"

