"""Input transforms: data is stored compactly (uint8 images, float16 features) and converted on the fly, per batch,
by the model's ``input_transform`` (``Model.input_transform``; ``input_transform_for`` picks one from the data's
``meta``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class Chain:
    """Two input transforms, one after the other."""

    def __init__(self, first: Callable[[Tensor], Tensor], second: Callable[[Tensor], Tensor]):
        self.first, self.second = first, second

    def __call__(self, x: Tensor) -> Tensor:
        return self.second(self.first(x))


class ImageNormalize:
    """uint8 images -> float (x / 255 - mean) / std, shaped (n, C, H, W) or flattened (n, C*H*W)."""

    def __init__(self, mean: float | tuple[float, ...], std: float | tuple[float, ...], flatten: bool):
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.flatten = flatten
        self._consts: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(shift, scale) of the fused multiply-add on ``device``, copied there once (not once per call)."""
        c = self._consts.get(device)
        if c is None:
            c = self._consts[device] = ((-self.mean / self.std).to(device), (1.0 / (255.0 * self.std)).to(device))
        return c

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() == 3:  # (n, H, W) grey images
            x = x.unsqueeze(1)
        # (x / 255 - mean) / std as one fused multiply-add on the converted batch (two passes instead of four)
        shift, scale = self._on(x.device)
        x = torch.addcmul(shift, x.to(torch.float32), scale)
        return x.flatten(1) if self.flatten else x

    def into(self, x: Tensor, out: Tensor) -> Tensor:
        """``self(x)`` written into the float32 storage ``out`` (at least as many elements) without a converted copy
        of ``x`` in between: the stacked executor reuses one workspace for a round's batches, which saves the
        conversion pass and the page faults of a fresh buffer each round.  The same values as ``self(x)``
        (tested)."""
        if x.dim() == 3:
            x = x.unsqueeze(1)
        o = out[:x.numel()].view(x.shape)
        shift, scale = self._on(x.device)
        torch.addcmul(shift, x, scale, out=o)
        return o.flatten(1) if self.flatten else o


class Flatten:
    """Flattens (n, ...) features to (n, d) float32 (also the cast of compactly stored float16 features)."""

    def __call__(self, x: Tensor) -> Tensor:
        return x.flatten(1).to(torch.float32)


class ToFloat32:
    """Casts compactly stored (float16) features to float32 on the fly, keeping their shape."""

    def __call__(self, x: Tensor) -> Tensor:
        return x.to(torch.float32)


def input_transform_for(
    input_shape: tuple[int, ...], meta: dict[str, object] | None, flatten: bool
) -> Callable[[Tensor], Tensor] | None:
    meta = meta or {}
    if meta.get("input") == "image":
        return ImageNormalize(meta.get("mean", 0.0), meta.get("std", 1.0), flatten)  # type: ignore[arg-type]
    if flatten and (len(input_shape) > 1 or meta.get("input") == "float16"):
        return Flatten()
    if meta.get("input") == "float16":
        return ToFloat32()
    return None
