"""Models as a module skeleton plus a loss; parameters always travel as ``Params``.

``Model.apply(params, x)`` is a pure function (``torch.func.functional_call``) that works under
``torch.func.vmap``.  Two output kinds are supported:

* ``"binary"``: one logit per sample, logistic (BCE) loss, class probabilities ``[1 - s, s]`` with
  ``s = sigmoid(logit)`` (the FedEM reference code's linear model on the synthetic data);
* ``"multiclass"``: C logits, softmax cross-entropy.

``nll(out, y)`` returns the per-sample negative log-likelihood (the loss that FedEM's E-step uses),
``log_proba(out)`` the (n, C) log class probabilities (FedEM mixes probabilities, never logits).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from .. import batchnorm
from ..transforms import eager
from ..tree import Params
from .inputs import Chain, Flatten
from .parts import ModelError, default_head, dense_layers, split_names, value_and_grad_of

if TYPE_CHECKING:
    from .clientstack import ClientsForm
    from .lora import AdapterConfig

log = logging.getLogger("fedmtl")


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
    #: outside torch.func transforms on CPU, run the module's convolutions in the channels-last memory format
    #: (inputs and 4-d weights re-laid out per call; gradients come back in the parameters' own layout).  PyTorch's
    #: CPU max-pooling and convolutions are much faster so (a FEMNIST CNN step: about 25% on one thread here); the
    #: results equal the default layout's up to float rounding (tested)
    channels_last: bool = False
    #: outside torch.func transforms, run the module itself (e.g. nn.LSTM's fused CPU kernel) instead
    #: of ``forward``; both must agree (tested)
    module_when_eager: bool = False
    #: the features are integer token ids (an embedding's input): float features are refused, not truncated
    token_input: bool = False
    #: the names of the parameters that form the *head* (the last layer(s) mapping the representation to the
    #: logits); the rest is the *body*.  Body/head methods (FedPer, FedRep, LG-FedAvg, FedBABU, FedRoD, kNN-Per,
    #: MOON, Omni-Fedge) read it; ``None``: the model has no such split (a single layer), and those methods refuse it
    head: tuple[str, ...] | None = None
    #: optional pure ``(params, x) -> (n, d)`` representation (the head's input); default: the head module's
    #: input captured while the module runs
    embed: Callable[[Params, Tensor], Tensor] | None = field(default=None, compare=False)
    #: the parameter names of the model's ``fedmtl.BatchNorm`` layers (affine weights and running statistics), found
    #: from the module; empty for a model without batch norm.  FedBN keeps them per client
    batch_norm: tuple[str, ...] = field(init=False, default=(), compare=False)
    #: optional ``(params (K, ...), x (K, n, ...), y, mask (K, n), step) -> (K,) losses``: one SGD step
    #: (``models.stacked.Step``) of K clients applied in place with the gradient fused into the update
    clients_step: Callable[..., Tensor] | None = field(default=None, compare=False)
    #: optional ``(params (K, M, ...), x (K, n, ...), y, mask (K, n), weight (K, M, n)) -> (grads, (K, M) losses)``:
    #: the closed-form gradient of M components of each of K clients (``models.stacked.mlp_components``)
    components_grad: Callable[..., tuple[Params, Tensor]] | None = field(default=None, compare=False)
    #: optional ``(params (K, M, ...), x, y, mask, weight, step) -> (K, M) losses``: that gradient's SGD step fused
    components_step: Callable[..., Tensor] | None = field(default=None, compare=False)
    #: where a run starts: ``None``, fresh weights from the module's initializer seeded by the run (``init``); or
    #: these weights (``from_module(..., init="module")``: the module's own, e.g. pretrained).  Further independent
    #: models a method keeps (FedEM's other components, IFCA's other clusters) are still drawn from the initializer
    initial_params: Params | None = field(default=None, compare=False, repr=False)
    #: the module's clients form (``fedmtl.models.clientstack``): a twin running K clients' stacked parameters on
    #: their batches side by side, its standard layers converted to client-stacked forms (batched products, grouped
    #: convolutions, stacked gates); made by ``from_module`` and the built-in CNNs, verified on real examples before
    #: use (``verify_clients``); ``None`` for a model without one
    clients_form: ClientsForm | None = field(default=None, compare=False, repr=False)
    #: the low-rank adapters the module carries (``fedmtl.models.lora``): its parameters are the adapters (and the
    #: ``train`` modules), the frozen base is buffers; ``None`` for a model trained in full
    adapters: AdapterConfig | None = field(default=None, compare=False)
    #: compile the clients' step (``value_and_grad_clients``) with ``torch.compile`` (``run.compile``; ``compiled``)
    compile_clients: bool = field(default=False, compare=False)
    _compiled: dict[str, Compiled] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise ModelError(f"Model.module must be a torch.nn.Module, got {type(self.module).__name__}")
        if self.output not in ("binary", "multiclass"):
            raise ModelError(f"Model.output must be 'binary' or 'multiclass', got {self.output!r}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ModelError(f"num_classes must be an int >= 2, got {self.num_classes!r}")
        if self.output == "binary" and self.num_classes != 2:
            raise ModelError(f"a binary model has 2 classes, got num_classes={self.num_classes}")
        if not any(True for _ in self.module.parameters()):
            raise ModelError(f"{type(self.module).__name__} has no parameters to train")
        torch_bn = [n for n, m in self.module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if torch_bn:
            raise ModelError(f"{type(self.module).__name__} uses torch.nn batch norm ({torch_bn[0]!r}), whose running "
                             "statistics are buffers updated in place (vmap refuses that, padding would enter the "
                             "batch statistics, and prediction would use batch statistics): use fedmtl.BatchNorm, a "
                             "drop-in replacement whose statistics are entries of the parameter tree")
        object.__setattr__(self, "batch_norm", batchnorm.name_batchnorms(self.module))
        stray = [k for k, _ in self.module.named_parameters() if batchnorm.is_statistic(k) and k not in self.batch_norm]
        if stray:
            raise ModelError(f"parameters {stray} are named like batch-norm statistics ({batchnorm.STATISTICS}) but "
                             "are not a fedmtl.BatchNorm's; training would assign them: rename them")
        if self.initial_params is not None:
            shapes = {k: tuple(v.shape) for k, v in self.module.named_parameters()}
            if {k: tuple(v.shape) for k, v in self.initial_params.items()} != shapes:
                raise ModelError(f"Model.initial_params must hold the module's parameters {list(shapes)} with their "
                                 "shapes")
        if self.head is not None:
            names = dict(self.module.named_parameters())
            unknown = [h for h in self.head if h not in names]
            if unknown:
                raise ModelError(f"Model.head names {unknown}, which are not parameters of "
                                 f"{type(self.module).__name__} (its parameters: {list(names)})")
            if self.head and len(self.head) == len(names):
                raise ModelError(f"Model.head holds every parameter of {type(self.module).__name__}: a head needs a "
                                 "body below it (use head=None for a model without a body/head split)")

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
        captured: list[Tensor] = []

        def grab(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
            captured.append(args[0])
            raise _Captured

        handle = self.head_module().register_forward_pre_hook(grab)
        try:
            functional_call(self.module, params, (x,))
        except _Captured:
            pass
        finally:
            handle.remove()
        return captured[0].flatten(1)

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
        """Wrap any ``nn.Module`` mapping a batch of features (n, *feature_shape) to logits.

        ``adapters``: fine-tune with low-rank adapters (``fedmtl.models.lora``): an ``AdapterConfig``, a dict of its
        fields (rank, alpha, target, train, base) or a ``peft.LoraConfig``.  The module (a copy; its weights are the
        pretrained base, or ``base`` names a safetensors file of them) is frozen and shared by every client; the
        adapters on its targeted Linear layers (and the ``train`` modules) are what the clients train and send.
        ``init="seeded"`` then draws fresh adapters per run (B = 0: every run starts at the base model).  ``head``
        defaults to the ``train`` modules' parameters where there are some.

        ``output``: ``"multiclass"`` (the module returns (n, num_classes) logits, softmax cross-entropy) or
        ``"binary"`` (one logit per example, (n, 1), logistic loss; needs ``num_classes=2``).  Left out, it is
        binary exactly when ``num_classes == 2`` and the module's last ``nn.Linear`` has one output.
        ``input_transform`` runs on every batch before the module (e.g. uint8 images to normalized floats).
        ``init``: ``"seeded"`` (default) makes the initial weights with the module's own initializer
        (``reset_parameters``), seeded by the run; ``"module"`` starts every run from the module's current weights
        (yours, e.g. pretrained; copied now, so later changes to the module do not move them).
        The module is converted for the ``stacked`` executor: a ReLU MLP given as a ``nn.Sequential`` to the stacked
        closed form (batched products and a hand-written backward), any other module to its clients form
        (``fedmtl.models.clientstack``: Linear, Conv1d/2d, Embedding, LayerNorm, GroupNorm, LSTM/GRU/RNN and
        MultiheadAttention layers in client-stacked forms, any other layer with parameters vmapped or looped over the
        clients inside it), checked against the module on the run's first examples.
        ``prefer_loop_on_cpu``: the executor on a CPU when the run says ``runner = "auto"``; None (default) decides by
        the module's layers: a module with convolutions or recurrent layers loops over clients there (compute-bound
        layers run fastest per client on a CPU: measured), anything else runs the ``stacked`` executor where it has a
        clients form and vmaps otherwise.  On a GPU every module with a clients form runs ``stacked``.
        ``summary.json`` records the path taken, layer by layer.
        ``head``: the parameter names of the head for body/head methods; ``"auto"`` takes the last sub-module
        that owns parameters (``None`` for a one-layer module).  ``channels_last``: run a convolutional module in
        the channels-last memory format on CPU outside torch.func transforms (faster pooling and convolutions); None
        (default) does so for modules with 2-d convolutions.
        Any module works with the ``loop`` executor; ``vmap`` needs operations that ``torch.func.vmap``
        batches (most do; in-place updates of buffers such as BatchNorm's running statistics do not).
        """
        if not isinstance(module, nn.Module):
            raise ModelError(f"Model.from_module needs a torch.nn.Module, got {type(module).__name__}")
        if output is None:
            last = [m for m in module.modules() if isinstance(m, nn.Linear)]
            output = "binary" if num_classes == 2 and last and last[-1].out_features == 1 else "multiclass"
        if init not in ("seeded", "module"):
            raise ModelError(f"Model.from_module init must be 'seeded' or 'module', got {init!r}")
        adapter_cfg = None
        if adapters is not None:
            from .lora import AdapterConfig, apply_adapters

            try:
                adapter_cfg = AdapterConfig.of(adapters)
                module = apply_adapters(module, adapter_cfg)
            except (TypeError, ValueError) as e:
                raise ModelError(str(e)) from None
            if head == "auto" and adapter_cfg.train:
                head = tuple(k for k, _ in module.named_parameters() if "lora_" not in k) or "auto"
        initial = ({k: v.detach().cpu().clone() for k, v in module.named_parameters()} if init == "module" else None)
        fast: dict[str, Any] = {}
        dense = dense_layers(module, output == "binary")
        if dense is not None:  # a ReLU MLP: the stacked closed form (the built-in mlp's fast paths)
            from .stacked import mlp_functions

            layers, flatten = dense
            fast = {"stacks": True, **mlp_functions(layers, output == "binary")._asdict()}
            if flatten:  # the module's leading nn.Flatten, done before the closed form (a no-op in the module then)
                input_transform = Chain(input_transform, Flatten()) if input_transform is not None else Flatten()
        else:  # any other module: its clients form where its layers have stacked forms (verified on the data first)
            from .clientstack import ClientsForm

            fast = {"clients_form": ClientsForm.of(module)}
        recurrent = any(isinstance(m, nn.RNNBase) for m in module.modules())
        if channels_last is None:  # a CNN's pooling and convolutions on one CPU thread: ~30% faster so (measured)
            channels_last = any(isinstance(m, nn.Conv2d) for m in module.modules())
        if prefer_loop_on_cpu is None:  # the rule: compute-bound layers loop on a CPU
            prefer_loop_on_cpu = recurrent or any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
        return cls(module, output, num_classes, input_transform=input_transform,
                   name=name or type(module).__name__, prefer_loop_on_cpu=prefer_loop_on_cpu,
                   prefer_loop_on_cuda=recurrent,  # cuDNN's fused recurrence beats a vmapped one (measured, H100)
                   channels_last=channels_last,
                   head=default_head(module) if head == "auto" else (None if head is None else tuple(head)),
                   initial_params=initial, adapters=adapter_cfg, **fast)

    def check_features(self, x: Tensor) -> None:
        """Run the model on a few examples ``x`` (n, *features) of the data and check the output shape; a
        model that does not fit the data fails here with a clear message, before any training.  With 3 examples or
        more, a clients form is verified on them too (``verify_clients``)."""
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
        want = (x.shape[0],) if self.output == "binary" else (x.shape[0], self.num_classes)
        if tuple(out.shape) != want:
            raise ModelError(f"model {self.name!r} returns shape {tuple(out.shape)} for {x.shape[0]} examples; a "
                             f"{self.output} model with {self.num_classes} classes must return "
                             f"{'(n, 1) or (n,)' if self.output == 'binary' else f'(n, {self.num_classes})'}")
        if not out.is_floating_point():
            raise ModelError(f"model {self.name!r} returns {out.dtype} logits; it must return floating point")
        if self.clients_form is not None and x.shape[0] >= 3:  # the clients form checked on the same examples
            self.verify_clients(self.input_transform(x) if self.input_transform is not None else x)

    def init(self, seed: int) -> Params:
        """Fresh parameters from the module's own initializer, seeded without touching global RNG, on the module's
        device.  They are drawn on the CPU whatever that device is, so a run starts from the same model on a GPU
        as on the CPU (CUDA's generator draws other numbers for the same seed)."""
        dev = self.device
        if dev.type != "cpu":
            self.module.cpu()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for m in self.module.modules():
                    reset = getattr(m, "reset_parameters", None)
                    # with adapters the frozen base (buffers) keeps its weights: only modules that own parameters
                    # (the adapters, the trained modules) are drawn afresh
                    if reset is not None and (self.adapters is None or any(True for _ in m.parameters(False))):
                        reset()
                return {k: v.detach().clone().to(dev) for k, v in self.module.named_parameters()}
        finally:
            if dev.type != "cpu":
                self.module.to(dev)

    def start(self, seed: int) -> Params:
        """The run's initial model: ``initial_params`` (copies, on the module's device) if set, else ``init(seed)``."""
        if self.initial_params is None:
            return self.init(seed)
        dev = self.device
        return {k: v.clone().to(dev) for k, v in self.initial_params.items()}

    @property
    def device(self) -> torch.device:
        """Where the module's parameters (or, without any, its buffers) are: the CPU, or a run's device."""
        for t in (*self.module.parameters(), *self.module.buffers()):
            return t.device
        return torch.device("cpu")

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
        """Per-sample negative log-likelihood, shape out.shape[:-1] (multiclass) or out.shape (binary).

        ``out`` may carry leading axes (e.g. M components) that ``y`` (n,) broadcasts against.
        """
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
        """Batch mean of ``weight * nll`` over the real samples (``mask`` = 1; padding = 0).

        Divides by the number of real samples, as a DataLoader batch mean would.  With ``weight`` =
        FedEM responsibilities this is the reference q-weighted loss ``sum(q * l) / batch_size``.
        """
        return self.masked_mean(self.nll(self.apply(params, x), y), mask, weight)

    @staticmethod
    def masked_mean(nll: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
        """``loss``'s reduction of per-sample values ``nll`` (..., n): the sum of ``weight * nll`` over the real
        samples divided by their number, per leading entry (one loss per stacked model for (M, n))."""
        m = mask.to(nll.dtype)
        w = m if weight is None else m * weight
        return (nll * w).sum(-1) / m.sum().clamp_min(1.0)


    def apply_stacked(self, params: Params, x: Tensor) -> Tensor:
        """Forward pass of M stacked models (params with a leading M axis) on the same x: (M, n, ...)."""
        if self.stacks and self.forward is not None:
            if self.input_transform is not None:
                x = self.input_transform(x)
            return self.forward(params, x)
        if eager():  # the loop runner: one module call per model (a vmapped convolution is several times slower)
            m = next(iter(params.values())).shape[0]
            return torch.stack([self.apply({k: v[i] for k, v in params.items()}, x) for i in range(m)])
        return vmap(self.apply, in_dims=(0, None))(params, x)

    def value_and_grad_stacked(
        self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
    ) -> tuple[Params, Tensor]:
        """``value_and_grad`` of M stacked models on the same batch; ``weight`` (M, n); loss (M,).

        Models that ``stack`` (linear, mlp) compute all M components with one matrix product per layer (a nested
        vmap over clients and components batches matmuls badly on CPU: ~15x slower here).
        """
        if self.stacks and self.analytic_grad is not None:
            if self.input_transform is not None:
                x = self.input_transform(x)
            return self.analytic_grad(params, x, y, mask, weight)
        if eager():  # the loop runner: one autograd pass per model (a vmapped convolution is several times slower)
            m = next(iter(params.values())).shape[0]
            outs = [self.value_and_grad({k: v[i] for k, v in params.items()}, x, y, mask,
                                        None if weight is None else weight[i]) for i in range(m)]
            return ({k: torch.stack([g[k] for g, _ in outs]) for k in params}, torch.stack([loss for _, loss in outs]))
        return vmap(self.value_and_grad, in_dims=(0, None, None, None, 0 if weight is not None else None))(
            params, x, y, mask, weight
        )

    @property
    def path(self) -> str:
        """How the model computes: ``"closed form"`` (stacked products and a hand-written backward: ``linear``,
        ``mlp``, and ReLU MLPs given as a ``nn.Sequential``), ``"forward"`` (its own pure forward under autograd),
        or ``"module"`` (``torch.func.functional_call`` of the module under autograd).  On the stacked executor a
        model without the closed form runs its clients form instead (``clients_paths``)."""
        if self.analytic_grad is not None:
            return "closed form"
        return "forward" if self.forward is not None else "module"

    @property
    def closed_form_clients(self) -> bool:
        """Whether the model's clients form is the stacked closed form (``linear``, ``mlp``, converted dense
        ``nn.Sequential`` modules): batched products and a hand-written backward."""
        return self.stacks and self.analytic_grad is not None

    @property
    def supports_clients(self) -> bool:
        """Whether ``value_and_grad_clients`` exists: the stacked closed form, or a clients form not refused by its
        check on the data (``verify_clients``); models without batch norm."""
        if self.batch_norm:
            return False
        return self.closed_form_clients or (self.clients_form is not None and self.clients_form.usable is not False)

    def clients_logits(self, params: Params, x: Tensor) -> Tensor:
        """Outputs of K clients' models (params (K, ...)) on their own batches x (K, B, ...) already through
        ``input_transform``: (K, B) for a binary model, (K, B, C) otherwise."""
        if self.closed_form_clients:
            assert self.forward is not None
            return self.forward(params, x)
        if self.clients_form is None:
            raise ModelError(f"model {self.name!r} has no clients form")
        out = self.clients_form(params, x)
        if self.output == "binary" and out.dim() > 2 and out.shape[-1] == 1:
            return out.reshape(out.shape[:-1])
        return out

    def clients_components_logits(self, components: Params, x: Tensor) -> Tensor:
        """M components (params (M, ...), shared by the clients) on K clients' examples x (N0, ...) already through
        ``input_transform``: (M, N0) for a binary model, (M, N0, C) otherwise (FedEM's E-step on the stacked
        executor): all clients' examples as one batch (the closed form: one product per layer for the M
        components; else the clients form with the components as its clients)."""
        if self.closed_form_clients:
            assert self.forward is not None
            return self.forward(components, x)
        m = next(iter(components.values())).shape[0]
        return self.clients_logits(components, x.unsqueeze(0).expand(m, *x.shape))

    def verify_clients(self, x: Tensor) -> bool:
        """Check the clients form on examples ``x`` (n >= 3, already through ``input_transform``): three clients'
        models (weights drawn around the initial ones) on their own examples, outputs and gradients of the form
        against the module applied to each, to 1e-4 of their scale (``ClientsForm.verify``).  A form that does not
        reproduce the module is not used (``supports_clients`` turns False; the reason is logged and kept in
        ``clients_form.reason``).  True for the closed form, which is exact by construction (tested)."""
        form = self.clients_form
        if form is None:
            return self.closed_form_clients
        if form.usable is not None:
            return form.usable
        n = x.shape[0] // 3
        if n < 1:
            raise ModelError("verifying a clients form needs at least 3 examples")
        gen = torch.Generator().manual_seed(0)
        base = self.init(0)

        def near(v: Tensor, i: int) -> Tensor:  # client i's weights: far enough apart that mixing them shows
            if i == 0 or not v.is_floating_point():
                return v
            scale = max(float(v.detach().float().std()) if v.numel() > 1 else 0.0, float(v.detach().abs().mean()), 0.05)
            return v + 0.5 * scale * torch.randn(v.shape, generator=gen).to(v)

        stacked = {k: torch.stack([near(v, i) for i in range(3)]) for k, v in base.items()}
        xs = x[:3 * n].reshape(3, n, *x.shape[1:])
        ys = torch.randint(0, self.num_classes, (3, n), generator=gen).to(x.device)
        mask = torch.ones(3, n, device=x.device)

        def module_out(p: Params, xi: Tensor) -> Tensor:  # the module itself on transformed examples
            out = functional_call(self.module, p, (xi,))
            return out.reshape(out.shape[:-1]) if self.output == "binary" and out.shape[-1:] == (1,) else out

        def compare() -> str | None:
            with torch.no_grad():
                got = self.clients_logits(stacked, xs)
            grads, _ = self._clients_value_and_grad(stacked, xs, ys, mask)
            for i in range(3):
                p = {k: v[i] for k, v in stacked.items()}
                with torch.no_grad():
                    want = module_out(p, xs[i])
                if got[i].shape != want.shape:
                    return f"outputs shaped {tuple(got[i].shape)} instead of {tuple(want.shape)}"
                if not _close(got[i], want):
                    return (f"outputs differ from the module's by {float((got[i] - want).abs().max()):.3g} (its code "
                            "mixes examples, or its batch axis is not the first)")
                def loss(q: Params, i: int = i) -> Tensor:
                    return self.masked_mean(self.nll(module_out(q, xs[i]), ys[i]), mask[i])

                for k, g in value_and_grad_of(loss, p)[0].items():
                    if not _close(grads[k][i], g):
                        err = float((grads[k][i] - g).abs().max())
                        return f"the gradient of {k!r} differs from the module's by {err:.3g}"
            return None

        return form.verify(compare)

    def clients_paths(self) -> dict[str, str]:
        """How the clients form computes each module with parameters: ``"stacked"``, ``"vmap"`` or ``"loop"``
        (``{"": "closed form"}`` for the closed form; empty without a clients form)."""
        if self.closed_form_clients:
            return {"": "closed form"}
        return dict(self.clients_form.layers) if self.clients_form is not None else {}

    def value_and_grad_clients_stacked(self, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                                       weight: Tensor | None = None) -> tuple[Params, Tensor]:
        """``value_and_grad_stacked`` of K clients: M components per client (params (K, M, ...)) on the client's own
        batch x (K, B, ...) already through ``input_transform``, y and mask (K, B), per-sample weights (K, M, B):
        (grads (K, M, ...), (K, M) losses).  The closed form where the model has one (``components_grad``), else
        the clients form over the K x M models, each client's batch read by its M components."""
        if not self.supports_clients:
            raise ModelError(f"model {self.name!r} has no clients form")
        k, m = next(iter(params.values())).shape[:2]
        if self.closed_form_clients and self.components_grad is not None:
            return self._maybe_compiled("components", self.components_grad, x.device)(params, x, y, mask, weight)

        def rep(t: Tensor) -> Tensor:  # each client's rows once per component
            return t.unsqueeze(1).expand(k, m, *t.shape[1:]).reshape(k * m, *t.shape[1:])

        flat = {n: v.reshape(k * m, *v.shape[2:]) for n, v in params.items()}
        w = None if weight is None else weight.reshape(k * m, *weight.shape[2:])
        g, loss = self.value_and_grad_clients(flat, rep(x), rep(y), rep(mask), w)
        return {n: v.reshape(params[n].shape) for n, v in g.items()}, loss.reshape(k, m)

    def value_and_grad_clients(self, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                               weight: Tensor | None = None) -> tuple[Params, Tensor]:
        """``value_and_grad`` of K clients' models (params (K, ...)) on their own batches x (K, B, ...) already
        through ``input_transform``, y and mask (K, B): (K stacked gradients, (K,) losses), each client's loss the
        mean over its own real samples (the ``stacked`` executor), weighted by ``weight`` (K, B) where given (as
        ``Model.loss``).  The closed form where the model has one, else autograd through the clients form: the sum
        of the clients' losses, whose gradient with respect to client k's parameters is exactly k's own."""
        if not self.supports_clients:
            raise ModelError(f"model {self.name!r} has no clients form (the stacked executor needs a closed-form "
                             "stacked gradient or a verified clients form)")
        if self.closed_form_clients:
            assert self.analytic_grad is not None
            return self._maybe_compiled("closed_form", self.analytic_grad, x.device)(params, x, y, mask, weight)
        return self._clients_value_and_grad(params, x, y, mask, weight)

    def compiled(self, on: bool = True) -> Model:
        """This model with its clients' step compiled by ``torch.compile`` (``run.compile``): the closed form's
        gradient, or the clients form's loss (its backward compiled with it).  On a GPU in the ``reduce-overhead``
        mode (CUDA graphs: the step's kernels replayed without a launch each).  Where compiling fails (no compiler)
        the step runs eagerly, with one warning."""
        return self if self.compile_clients == on else dataclasses.replace(self, compile_clients=on)

    def _maybe_compiled(self, name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        if not self.compile_clients:
            return fn
        c = self._compiled.get(name)
        if c is None:
            c = self._compiled[name] = Compiled(fn, "reduce-overhead" if device.type == "cuda" else "default")
        return c

    def _clients_losses(self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
                        ) -> Tensor:
        """(K,) each client's mean loss over its own real samples (``weight``-ed), through the clients form."""
        m = mask.to(torch.float32)
        w = m if weight is None else m * weight
        nll = self.nll(self.clients_logits(params, x), y)  # (K, B)
        return (nll * w).sum(-1) / m.sum(-1).clamp_min(1.0)

    def _clients_value_and_grad(self, params: Params, x: Tensor, y: Tensor, mask: Tensor,
                                weight: Tensor | None = None) -> tuple[Params, Tensor]:
        """Autograd through the clients form (``value_and_grad_clients``)."""
        losses = self._maybe_compiled("clients_form", self._clients_losses, x.device)
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = losses(leaves, x, y, mask, weight)
            grads = torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)
        return ({k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(params.items(), grads, strict=True)},
                loss.detach())

    def value_and_grad(
        self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
    ) -> tuple[Params, Tensor]:
        """(gradient of ``loss`` w.r.t. params, loss); closed form where the model has one."""
        if self.analytic_grad is not None:
            if self.input_transform is not None:
                x = self.input_transform(x)
            return self.analytic_grad(params, x, y, mask, weight)
        if self.batch_norm:
            return self._value_and_grad_bn(params, x, y, mask, weight)
        if eager():  # plain autograd: torch.func.grad's per-op overhead is 5x here for recurrent nets
            with torch.enable_grad():
                leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
                loss = self.loss(leaves, x, y, mask, weight)
                grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            out = {k: torch.zeros_like(v) if g is None else g.contiguous()  # channels_last: back to the params' layout
                   for (k, v), g in zip(params.items(), grads, strict=True)}
            return out, loss.detach()
        return grad_and_value(self.loss)(params, x, y, mask, weight)

    def _value_and_grad_bn(
        self, params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None
    ) -> tuple[Params, Tensor]:
        """``value_and_grad`` of a model with ``BatchNorm``: the loss in training mode (batch statistics of the real
        samples); the entries of the running statistics hold their updated values instead of a gradient, which
        ``local_sgd`` assigns (``fedmtl.batchnorm``)."""

        def loss_and_stats(p: Params) -> tuple[Tensor, dict[str, Tensor]]:
            with batchnorm.training(mask) as updates:
                loss = self.loss(p, x, y, mask, weight)
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


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal to 1e-4 of their scale (a clients form against its module: sums in another order)."""
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max().clamp_min(1e-3))))


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


class _Captured(Exception):
    """Stops a forward pass once the head's input is captured (``Model.features``)."""
