"""The private functorch probes (``fedmtl.transforms``) answer correctly on the installed torch: if a torch upgrade
changes torch._C._functorch, these fail before the engine silently leaves its fast paths."""

from __future__ import annotations

import torch
from torch.func import grad, vmap

from fedmtl import transforms


def test_probes_see_which_transforms_are_active():
    seen: dict[str, tuple[bool, bool]] = {}

    def probe(tag: str):
        def f(x):
            seen[tag] = (transforms.eager(), transforms.only_vmap())
            return (x * x).sum()
        return f

    probe("none")(torch.ones(3))
    vmap(probe("vmap"))(torch.ones(2, 3))
    grad(probe("grad"))(torch.ones(3))
    vmap(grad(probe("vmap_grad")))(torch.ones(2, 3))
    assert seen == {"none": (True, True), "vmap": (False, True), "grad": (False, False),
                    "vmap_grad": (False, False)}, (torch.__version__, seen)
