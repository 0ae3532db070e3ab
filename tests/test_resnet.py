"""The CIFAR ResNet (``resnet``): its layout and size against a network written by hand with ``torch.nn`` layers
(torch's own batch norm and group norm), the same outputs from the same weights in training and prediction, FedAvg
training it, and the executors agreeing on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedmtl
from fedmtl import tree as T
from fedmtl.batchnorm import training
from fedmtl.models import build_model


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class _Reference(nn.Module):
    """The CIFAR ResNet-18 of He et al. (3x3 stem, no max-pool), written independently with torch.nn layers."""

    def __init__(self, width: int, blocks, classes: int, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = norm(width)
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            layers.append(nn.Sequential(*[_Block(cin if j == 0 else cout, cout, 2 if (i and not j) else 1, norm)
                                          for j in range(n)]))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


def _stats_free(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}


def test_resnet18_has_the_reference_layout_and_size():
    m = build_model("resnet", (3, 32, 32), 10)
    ref = _Reference(64, (2, 2, 2, 2), 10, nn.BatchNorm2d)
    ours = dict(m.module.named_parameters())
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in _stats_free(ref.state_dict()).items()}
    trainable = sum(v.numel() for v in ours.values() if v.requires_grad)
    assert trainable == sum(p.numel() for p in ref.parameters()) == 11_173_962  # the CIFAR ResNet-18's known size
    assert m.head == ("fc.weight", "fc.bias") and len(m.batch_norm) == 4 * 20  # 20 norms: stem, 16 in blocks, 3 short


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_resnet_equals_the_torch_reference_from_the_same_weights(norm):
    torch.manual_seed(0)
    width, blocks = 8, (2, 1, 1, 1)
    m = build_model("resnet", (3, 16, 16), 5, width=width, blocks=list(blocks), norm=norm, groups=4)
    ref = _Reference(width, blocks, 5, nn.BatchNorm2d if norm == "batch" else (lambda c: nn.GroupNorm(4, c)))
    p = {k: v + 0.1 * torch.randn_like(v) if not k.endswith("running_var") else v.abs() + 0.5
         for k, v in m.init(1).items()}  # affine weights and statistics off their defaults
    missing, unexpected = ref.load_state_dict(p, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing)
    x = torch.randn(6, 3, 16, 16)
    ref.eval()
    with torch.no_grad():
        assert torch.allclose(m.apply(p, x), ref(x), atol=1e-4)
    ref.train()
    with torch.no_grad(), training(torch.ones(6)) as updates:
        out = m.apply(p, x)
        want = ref(x)
    assert torch.allclose(out, want, atol=1e-4)
    if norm == "batch":  # the running statistics move as torch's
        sd = ref.state_dict()
        assert set(updates) == {k for k in p if k.endswith(("running_mean", "running_var"))}
        for k, v in updates.items():
            assert torch.allclose(v, sd[k], atol=1e-5), k


def _images(seed: int = 0) -> fedmtl.FederatedData:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(3 * 16 * 16, 3))
    pairs = []
    for n in (12, 7, 10):  # batches of 5: the last ones hold 2 examples (never 1: a batch statistic of one)
        x = rng.normal(size=(n, 3, 16, 16)).astype(np.float32)
        pairs.append((x, np.argmax(x.reshape(n, -1) @ w, 1)))
    return fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)


def _run(runner: str, norm: str, rounds: int, algorithm: str = "fedavg", epochs: int = 1) -> fedmtl.RunResult:
    cfg = {"algorithm": {"name": algorithm}, "optim": {"lr": 0.05, "momentum": 0.9},
           "model": {"name": "resnet", "width": 4, "blocks": [1, 1, 1, 1], "norm": norm},
           "run": {"rounds": rounds, "batch_size": 5, "runner": runner, "eval_every": rounds, "seed": 1,
                   "local_epochs": epochs}}
    return fedmtl.run(cfg, data=_images())


@pytest.mark.slow
def test_fedavg_trains_a_tiny_resnet():
    losses = [r["train_loss"] for r in _run("loop", "batch", 4, epochs=3).history]
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_a_tiny_resnet_is_the_same_on_every_executor(norm):
    out = {r: _run(r, norm, 1) for r in ("loop", "vmap", "stacked")}
    assert out["stacked"].summary["path"]["executor"] == "stacked"
    for r in ("vmap", "stacked"):
        for a, b in zip(T.leaves(out["loop"].server), T.leaves(out[r].server), strict=True):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (r, float((a - b).abs().max()))
