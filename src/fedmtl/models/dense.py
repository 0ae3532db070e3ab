"""Dense models: ``linear`` (closed-form gradient; FedEM's M components in one matrix product) and ``mlp``."""

from __future__ import annotations

import numpy as np
from torch import nn

from ..model import Model, _linear_grad, default_head, input_transform_for


def linear(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
           bias: bool = True) -> Model:
    """Logistic (2 classes: one logit) or softmax regression on the flattened features."""
    out_dim = 1 if num_classes == 2 else num_classes
    output = "binary" if num_classes == 2 else "multiclass"
    d = int(np.prod(input_shape))
    return Model(nn.Linear(d, out_dim, bias=bias), output, num_classes, name="linear",
                 analytic_grad=_linear_grad, input_transform=input_transform_for(input_shape, meta, True))


def mlp(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
        hidden: tuple[int, ...] | list[int] = (64,)) -> Model:
    """Fully connected ReLU network with the given hidden widths."""
    layers: list[nn.Module] = []
    d = int(np.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    out_dim = 1 if num_classes == 2 else num_classes
    layers.append(nn.Linear(d, out_dim))
    output = "binary" if num_classes == 2 else "multiclass"
    net = nn.Sequential(*layers)  # the head: the last dense layer
    return Model(net, output, num_classes, name="mlp", input_transform=input_transform_for(input_shape, meta, True),
                 head=default_head(net) if hidden else None)
