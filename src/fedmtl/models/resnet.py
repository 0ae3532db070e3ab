"""The CIFAR ResNet-18 that personalized-FL papers train: ``resnet``.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016: BasicBlocks (two 3x3 convolutions,
each followed by normalization, ReLU after the first and after the residual sum, Fig. 2) in four stages of doubling
width, a projection shortcut (1x1 convolution + normalization, option B of Sec. 3.3) where a block changes the shape,
global average pooling and one linear layer.  The CIFAR variant that pFL code bases use (the "ResNet-18" of
FedBN/FedRep/PFLlib-style experiments) keeps the ImageNet network's stages (64-128-256-512 channels, two blocks each,
strides 1-2-2-2) and replaces the 7x7/2 stem and its max-pool by one 3x3/1 convolution, so 32x32 inputs reach the
pool at 4x4.  With 10 classes it has 11,173,962 trainable parameters (tested against a network written with
``torch.nn`` layers).

Keys: ``width`` (the first stage's channels; stage i has ``width * 2**i``), ``blocks`` (BasicBlocks per stage, one
entry per stage; ``[2, 2, 2, 2]`` is ResNet-18), ``norm``: ``"batch"`` (``fedmtl.BatchNorm``, which the batched
engine trains with per-client real-sample statistics; FedBN keeps it local) or ``"group"`` (``nn.GroupNorm`` with
``groups`` groups; no running statistics, so every method trains it).  ``groups`` defaults to 2, the
federated-learning choice: Reddi et al. ("Adaptive Federated Optimization", ICLR 2021) train the CIFAR ResNet-18 with
group norm of two groups in place of batch norm, following Hsieh et al. ("The Non-IID Data Quagmire of Decentralized
Machine Learning", ICML 2020), who proposed group norm for non-IID data; Wu and He's own default ("Group
Normalization", ECCV 2018) is 32, which needs ``width`` to be a multiple of 32.

Weights start from PyTorch's layer initializers (as the CIFAR ResNet code that pFL libraries copy does), not the
paper's He-normal draw.  The head (``Model.head``) is the linear layer, so the body/head methods split the model
there; the representation is the last stage's pooled features (8 * ``width`` for four stages).  On a CPU the
``auto`` runner loops over clients (compute-bound convolutions); on a GPU it takes the clients form (grouped
convolutions, stacked norms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..batchnorm import BatchNorm
from ..machine import check_parameters
from ..schema import Annotated, Range, shown
from .base import Model
from .clientstack import ClientsForm
from .inputs import input_transform_for

Norm = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with normalization; the shortcut is the identity, or a 1x1 convolution (with ``stride``)
    and normalization where the block changes the channels or the resolution (He et al., Fig. 2 and Sec. 3.3 B)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Norm):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        # the projection: a 1x1 convolution at ``stride`` written as the subsampled input's 1x1 convolution (the same
        # sums; PyTorch 2.13's channels-last CPU backward of a strided 1x1 convolution corrupts the heap)
        self.stride = stride
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), norm(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is None:
            return F.relu(out + x)
        s = self.stride
        return F.relu(out + self.downsample(x[:, :, ::s, ::s] if s > 1 else x))


class ResNet(nn.Module):
    """CIFAR ResNet: 3x3 stem (stride 1, no max-pool), stages of ``BasicBlock`` (the first at stride 1, the others at
    stride 2, channels doubling), global average pooling, linear layer ``fc``.  Inputs (n, C, H, W) (or (n, H, W))."""

    def __init__(self, channels: int, out: int, width: int, blocks: Sequence[int], norm: Norm):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn1 = norm(width)
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            stage = [BasicBlock(cin if j == 0 else cout, cout, (1 if i == 0 else 2) if j == 0 else 1, norm)
                     for j in range(n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            cin = cout
        self.stages = len(blocks)
        self.fc = nn.Linear(cin, out)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3:  # grey images without a channel axis
            x = x.unsqueeze(1)
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, object] | None = None,
           width: Annotated[int, Range(1, 1024)] = 64,
           blocks: tuple[Annotated[int, Range(1, 64)], ...] | list[Annotated[int, Range(1, 64)]] = (2, 2, 2, 2),
           norm: Literal["batch", "group"] = "batch",
           groups: Annotated[int, Range(1, 1024)] = 2) -> Model:
    """The CIFAR ResNet (module docstring): ``width`` base channels, ``blocks`` BasicBlocks per stage, ``norm``
    ``"batch"`` or ``"group"`` (``groups`` groups, dividing ``width``)."""
    if len(input_shape) not in (2, 3) or min(input_shape[-2:]) < 8:
        raise ValueError(f"[model] resnet needs images (C, H, W) or (H, W) of at least 8 x 8, got shape {input_shape}")
    blocks = tuple(blocks)
    if not 1 <= len(blocks) <= 6 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
        raise ValueError(f"[model] resnet blocks must list 1 to 6 stages of at least one block each, got "
                         f"{shown(list(blocks))}")
    if norm not in ("batch", "group"):
        raise ValueError(f"[model] resnet norm must be 'batch' or 'group', got {norm!r}")
    if norm == "group" and width % groups:
        raise ValueError(f"[model] resnet groups = {groups} must divide width = {width} (every stage's channels)")
    channels = 1 if len(input_shape) == 2 else input_shape[0]
    out = 1 if num_classes == 2 else num_classes

    def make_norm(c: int) -> nn.Module:
        return BatchNorm(c) if norm == "batch" else nn.GroupNorm(groups, c)

    with torch.device("meta"):  # counted before any weight is allocated
        probe = ResNet(channels, out, width, blocks, make_norm)
    check_parameters(sum(p.numel() for p in probe.parameters()),
                     f"[model] resnet with width = {width}, blocks = {shown(list(blocks))}")
    net = ResNet(channels, out, width, blocks, make_norm)
    return Model(net, "binary" if num_classes == 2 else "multiclass", num_classes, name="resnet",
                 input_transform=input_transform_for(input_shape, meta, flatten=False), prefer_loop_on_cpu=True,
                 channels_last=True, head=("fc.weight", "fc.bias"), clients_form=ClientsForm.of(net))
