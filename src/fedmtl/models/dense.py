"""Dense models: ``linear`` and ``mlp``, both on the stacked-layer fast path (``models.stacked``: hand-written
backpropagation as batched matrix products, FedEM's M components in the batch axis of each product)."""

from __future__ import annotations

import numpy as np
from torch import nn

from ..batchnorm import BatchNorm
from ..machine import check_parameters
from ..schema import Annotated, Range, shown
from .base import Model
from .clientstack import ClientsForm
from .inputs import input_transform_for
from .parts import default_head
from .stacked import mlp_functions

Width = Annotated[int, Range(1, 10**5)]  # a hidden layer's units


def linear(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
           bias: bool = True) -> Model:
    """Logistic (2 classes: one logit) or softmax regression on the flattened features."""
    out_dim = 1 if num_classes == 2 else num_classes
    output = "binary" if num_classes == 2 else "multiclass"
    d = int(np.prod(input_shape))
    fns = mlp_functions([("weight", "bias" if bias else None)], output == "binary")
    return Model(nn.Linear(d, out_dim, bias=bias), output, num_classes, name="linear", stacks=True,
                 input_transform=input_transform_for(input_shape, meta, True), **fns._asdict())


def mlp(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
        hidden: tuple[Width, ...] | list[Width] = (64,), batch_norm: bool = False) -> Model:
    """Fully connected ReLU network with the given hidden widths; ``batch_norm`` puts a ``fedmtl.BatchNorm`` after
    each hidden dense layer, before its ReLU (for FedBN; that variant runs autograd through the module or, on the
    stacked executor, through its clients form, not the closed form)."""
    if not isinstance(batch_norm, bool):
        raise ValueError(f"mlp batch_norm must be true or false, got {batch_norm!r}")
    layers: list[nn.Module] = []
    d = int(np.prod(input_shape))
    widths = [d, *hidden, 1 if num_classes == 2 else num_classes]
    check_parameters(sum((a + 1) * b for a, b in zip(widths, widths[1:], strict=False)),  # before any allocation
                     f"[model] mlp with hidden = {shown(list(hidden))} on {d} features")
    for h in hidden:
        layers += [nn.Linear(d, h), *([BatchNorm(h)] if batch_norm else []), nn.ReLU()]
        d = h
    out_dim = 1 if num_classes == 2 else num_classes
    layers.append(nn.Linear(d, out_dim))
    output = "binary" if num_classes == 2 else "multiclass"
    net = nn.Sequential(*layers)  # the head: the last dense layer
    transform = input_transform_for(input_shape, meta, True)
    head = default_head(net) if hidden else None
    if batch_norm and hidden:
        return Model(net, output, num_classes, name="mlp", input_transform=transform, head=head,
                     clients_form=ClientsForm.of(net))
    dense = [(f"{i}.weight", f"{i}.bias") for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
    return Model(net, output, num_classes, name="mlp", input_transform=transform, head=head, stacks=True,
                 **mlp_functions(dense, output == "binary")._asdict())
