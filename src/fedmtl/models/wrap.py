"""``Model.from_module``'s conversions: any ``nn.Module`` as a ``Model``, with low-rank adapters where asked, a ReLU MLP
on the stacked closed form (``models.stacked``) and any other module with its clients form (``models.clientstack``).

The model class comes in as an argument (``Model.from_module`` passes ``cls``), so this module imports neither
``models.base`` nor anything that does: ``models.base`` calls it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from torch import Tensor, nn

from .inputs import Chain, Flatten
from .parts import ModelError, default_head, dense_layers

M = TypeVar("M")


def from_module(
    cls: Callable[..., M],
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
) -> M:
    """``Model.from_module``: wrap any ``nn.Module`` mapping a batch of features (n, *feature_shape) to logits as a
    ``cls`` (``Model``).

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
