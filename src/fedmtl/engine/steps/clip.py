"""Norm clipping (``robust.clip_norm``): each valid update's deviation from the broadcast model is scaled to L2 norm
at most ``clip_norm`` before it is combined (Sun et al., "Can you really backdoor federated learning?", 2019)."""

from __future__ import annotations

from ...robust.aggregators import clip_updates, reference_of
from .base import RoundInfo, Setting, Updates


class ClipStep:
    """Clip every valid update's deviation from the payload to ``clip_norm``."""

    def __init__(self, clip_norm: float):
        self.clip_norm = clip_norm

    @classmethod
    def build(cls, s: Setting) -> ClipStep | None:
        return cls(s.spec.robust.clip_norm) if s.spec.robust.clip_norm > 0 else None

    def __call__(self, u: Updates, info: RoundInfo) -> Updates:
        ref = reference_of(u.updates, info.payload)
        return u._replace(updates=clip_updates(u.updates, ref, u.weights, self.clip_norm))
