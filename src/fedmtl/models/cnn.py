"""Convolutional networks of the FedEM experiments.

* ``cnn_femnist``: FEMNIST/EMNIST CNN of Marfoq et al. (and LEAF): conv(C->32, 5x5) - ReLU - maxpool 2 -
  conv(32->64, 5x5) - ReLU - maxpool 2 - dense(1024 -> 2048) - ReLU - dense(2048 -> classes) on 28x28.
* ``cnn_bn``: the FEMNIST CNN with batch normalization (``fedmtl.BatchNorm``) after each convolution and after the
  hidden dense layer, before the ReLU, as the FedBN paper's CNNs (Li et al., ICLR 2021, Appendix); for FedBN.
* ``cnn_cifar``: a small CIFAR CNN (conv 32 - conv 64 - dense 512).  The FedEM paper uses an
  ImageNet-pretrained MobileNetV2 on CIFAR; pretrained weights cannot be fetched offline here, so that
  option is left out.
* ``cnn_pfl``: the ``simple_cnn`` of pfl-research's image-classification benchmarks (Granqvist et al., "pfl-research:
  simulation framework for accelerating research in Private Federated Learning", 2024; its CIFAR-10 benchmark):
  conv(C->32, 3x3) - ReLU - conv(32->64, 3x3) - ReLU - maxpool 2 - dense(flat -> 128) - ReLU - dense(128 -> classes),
  no padding (14 x 14 x 64 = 12,544 features on 32 x 32).  Deviations, stated here: its two dropout layers (0.25
  after the pooling, 0.5 after the hidden dense layer) are left out, since the engine trains and evaluates one
  module with no train/eval mode (and the clients form refuses dropout); its Glorot-uniform weights are drawn by
  PyTorch's default initializers here (``Model.from_module(..., init="module")`` starts from given weights).

Both run under the vmap runner (torch.func batches conv2d); on CPU they are compute-bound and the
``auto`` runner loops over clients, which is faster there (``prefer_loop_on_cpu``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..batchnorm import BatchNorm
from ..machine import check_parameters
from ..schema import Annotated, Range
from .base import Model
from .clientstack import ClientsForm
from .inputs import input_transform_for
from .parts import default_head


def _flat_dim(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    c = 1 if len(input_shape) == 2 else input_shape[0]
    hw = input_shape[-2:]
    with torch.no_grad():
        return int(features(torch.zeros(1, c, *hw)).numel())


def _cnn(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None, widths: tuple[int, int],
         hidden: int, name: str, batch_norm: bool = False) -> Model:
    if len(input_shape) not in (2, 3):
        raise ValueError(f"{name} needs image inputs (H, W) or (C, H, W), got shape {input_shape}")
    c = 1 if len(input_shape) == 2 else input_shape[0]

    def norm(n: int) -> list[nn.Module]:
        return [BatchNorm(n)] if batch_norm else []

    features = nn.Sequential(
        nn.Conv2d(c, widths[0], 5), *norm(widths[0]), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], 5), *norm(widths[1]), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    out = 1 if num_classes == 2 else num_classes
    flat = _flat_dim(features, input_shape)
    check_parameters((flat + 1) * hidden + (hidden + 1) * out, f"[model] {name} with hidden = {hidden}")
    net = nn.Sequential(features, nn.Linear(flat, hidden), *norm(hidden), nn.ReLU(), nn.Linear(hidden, out))
    return Model(net, "binary" if num_classes == 2 else "multiclass", num_classes, name=name,
                 input_transform=input_transform_for(input_shape, meta, flatten=False), prefer_loop_on_cpu=True,
                 channels_last=True, head=default_head(net),  # the head: the last dense layer
                 # the stacked executor's form on a GPU (grouped convolutions; on a CPU the loop is faster: measured)
                 clients_form=ClientsForm.of(net))


def femnist_cnn(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
                hidden: Annotated[int, Range(1, 10**5)] = 2048) -> Model:
    return _cnn(input_shape, num_classes, meta, (32, 64), hidden, "cnn_femnist")


def bn_cnn(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
           hidden: Annotated[int, Range(1, 10**5)] = 2048) -> Model:
    return _cnn(input_shape, num_classes, meta, (32, 64), hidden, "cnn_bn", batch_norm=True)


def pfl_cnn(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
            hidden: Annotated[int, Range(1, 10**5)] = 128) -> Model:
    """pfl-research's ``simple_cnn`` (module docstring): two unpadded 3x3 convolutions, one pooling, one hidden dense
    layer."""
    if len(input_shape) not in (2, 3):
        raise ValueError(f"cnn_pfl needs image inputs (H, W) or (C, H, W), got shape {input_shape}")
    c = 1 if len(input_shape) == 2 else input_shape[0]
    features = nn.Sequential(nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten())
    out = 1 if num_classes == 2 else num_classes
    flat = _flat_dim(features, input_shape)
    check_parameters((flat + 1) * hidden + (hidden + 1) * out, f"[model] cnn_pfl with hidden = {hidden}")
    net = nn.Sequential(features, nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, out))
    return Model(net, "binary" if num_classes == 2 else "multiclass", num_classes, name="cnn_pfl",
                 input_transform=input_transform_for(input_shape, meta, flatten=False), prefer_loop_on_cpu=True,
                 channels_last=True, head=default_head(net), clients_form=ClientsForm.of(net))


def cifar_cnn(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
              hidden: Annotated[int, Range(1, 10**5)] = 512) -> Model:
    return _cnn(input_shape, num_classes, meta, (32, 64), hidden, "cnn_cifar")
