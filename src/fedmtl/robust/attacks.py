"""An attack harness for experiments and tests (the ``[attack]`` table): a fixed set of malicious clients,
drawn once per run from the run's seed, that corrupt what they send.

* ``scale`` — the client sends ``payload + strength * (update - payload)`` (model replacement / boosting;
  ``strength = -100`` is "minus a hundred times its update");
* ``sign_flip`` — ``payload - strength * (update - payload)``;
* ``gaussian`` — ``payload + strength * N(0, I)``, ignoring its data (noise drawn from ``(seed, round)``);
* ``label_flip`` — the client trains honestly on its training labels flipped ``y -> C - 1 - y`` (data
  poisoning; its update is then sent as is).

Where an update is not model-shaped (MOCHA's dual steps), "payload" above reads zero.  Attacks act on the
update a client sends, never on its own state.  ``fraction`` of the seen clients (rounded) are attackers;
``summary.json`` lists them under ``"attackers"``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..data.federated import FederatedData
from ..tree import Tree

AttackKind = Literal["none", "scale", "sign_flip", "gaussian", "label_flip"]


@dataclass(frozen=True)
class AttackConfig:
    """The ``[attack]`` table."""

    kind: AttackKind = "none"
    fraction: float = 0.0
    strength: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "scale", "sign_flip", "gaussian", "label_flip"):
            raise ValueError(f"attack.kind must be none, scale, sign_flip, gaussian or label_flip, got {self.kind!r}")
        if not (math.isfinite(self.fraction) and 0 <= self.fraction <= 1):
            raise ValueError(f"attack.fraction must be in [0, 1], got {self.fraction}")
        if not (math.isfinite(self.strength) and abs(self.strength) <= 1e30):
            raise ValueError(f"attack.strength must be a finite number of magnitude <= 1e30, got {self.strength}")

    @property
    def active(self) -> bool:
        return self.kind != "none" and self.fraction > 0

    def attackers(self, num_clients: int, seed: int) -> Tensor:
        """The malicious clients (sorted ids), the same for the whole run."""
        if not self.active:
            return torch.zeros(0, dtype=torch.long)
        k = int(round(self.fraction * num_clients))
        rng = np.random.default_rng(np.random.SeedSequence([seed, 13]))
        return torch.from_numpy(np.sort(rng.choice(num_clients, size=k, replace=False))).long()


def corrupt(cfg: AttackConfig, updates: Tree, reference: Tree | None, rows: Tensor, seed: int,
            round_idx: int) -> Tree:
    """The updates with rows ``rows`` (positions of the round's attackers) replaced by what they send."""
    if cfg.kind in ("none", "label_flip") or rows.numel() == 0:
        return updates
    out = T.tmap(lambda x: x.clone(), updates)
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, round_idx, 14]).generate_state(1)[0]))
    ref = reference if reference is not None else T.tmap(lambda x: torch.zeros_like(x[0]), updates)
    for dst, r in zip(T.leaves(out), T.leaves(ref), strict=True):
        rr = rows.to(dst.device)
        sel = dst.index_select(0, rr)
        base = r.unsqueeze(0).to(dst.dtype)
        if cfg.kind == "scale":
            new = base + cfg.strength * (sel - base)
        elif cfg.kind == "sign_flip":
            new = base - cfg.strength * (sel - base)
        else:  # gaussian
            noise = torch.randn(sel.shape, generator=gen, dtype=torch.float64).to(dst.device, dst.dtype)
            new = base + cfg.strength * noise
        dst.index_copy_(0, rr, new.to(dst.dtype))
    return out


def flip_labels(data: FederatedData, attackers: Tensor) -> FederatedData:
    """``data`` with the training labels of the seen clients ``attackers`` flipped ``y -> C - 1 - y``."""
    tr = data.seen.train
    y = tr.y.clone()
    for k in attackers.tolist():
        a, b = int(tr.offsets[k]), int(tr.offsets[k + 1])
        y[a:b] = data.num_classes - 1 - y[a:b]
    seen = dataclasses.replace(data.seen, train=dataclasses.replace(tr, y=y))
    return dataclasses.replace(data, seen=seen)


__all__ = ["AttackConfig", "AttackKind", "corrupt", "flip_labels"]
